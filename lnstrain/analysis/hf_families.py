"""The Hugging Face model families the depth analysis reads, and where each keeps its norms.

A family is what config.json's ``model_type`` names. Its entry says where the list of blocks is
(from the causal-LM module transformers builds), which norms each block has and what each one
normalises (its role), and how a norm's weight becomes its gain. The placement of the norms, which
the report and the claim table use, follows from the roles:

    pre       x + f(norm(x))                         attention_input, mlp_input
    sandwich  x + norm_out(f(norm_in(x)))            both inputs and both outputs (Gemma 2, Gemma 3)
    output    x + norm(f(x))                         attention_output, mlp_output (OLMo 2)
    post      norm(x + f(x))                         attention_residual, mlp_residual (GPT-1)

Each family is tested against transformers with a layer deleted (tests/analysis/test_hf_source.py).
Adding one is an entry here and a line in that test's list.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class NormPlacement(str, enum.Enum):
    PRE = "pre"
    SANDWICH = "sandwich"
    OUTPUT = "output"
    POST = "post"

    @property
    def norm_scheme(self) -> str:
        """The analysis's name for it: lnstrain's scheme names where they exist (pre_ln, sandwich_ln,
        post_ln), and output_ln for a norm on each sublayer's output."""
        return f"{self.value}_ln"


_PLACEMENT_OF_ROLES = {
    frozenset({"attention_input", "mlp_input"}): NormPlacement.PRE,
    frozenset({"attention_input", "attention_output", "mlp_input", "mlp_output"}): NormPlacement.SANDWICH,
    frozenset({"attention_output", "mlp_output"}): NormPlacement.OUTPUT,
    frozenset({"attention_residual", "mlp_residual"}): NormPlacement.POST,
}
_PRE = (("attention_input", "input_layernorm"), ("mlp_input", "post_attention_layernorm"))
_SANDWICH = (("attention_input", "input_layernorm"), ("attention_output", "post_attention_layernorm"),
             ("mlp_input", "pre_feedforward_layernorm"), ("mlp_output", "post_feedforward_layernorm"))


@dataclass(frozen=True)
class HFFamily:
    """Where a family's blocks and norms are, and how its norms apply their weight."""

    title: str
    norms: tuple[tuple[str, str], ...] = _PRE
    """(role, attribute of the block) of each residual-stream norm of a block, in the block's order."""
    blocks: str = "model.layers"
    """Dotted path from the causal-LM module to the list of blocks."""
    gain_offset: float = 0.0
    """The norm multiplies by (gain_offset + weight): 1 for the Gemma families, 0 for the rest."""

    @property
    def placement(self) -> NormPlacement:
        return _PLACEMENT_OF_ROLES[frozenset(role for role, _ in self.norms)]

    @property
    def norm_roles(self) -> tuple[str, ...]:
        return tuple(role for role, _ in self.norms)

    def block_list(self, model: Any) -> Any:
        """The module's list of blocks (AttributeError when transformers laid it out differently)."""
        found = model
        for part in self.blocks.split("."):
            found = getattr(found, part)
        return found


FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("LLaMA"),
    "mistral": HFFamily("Mistral"),
    "mixtral": HFFamily("Mixtral (MoE)"),
    "qwen2": HFFamily("Qwen2"),
    "qwen2_moe": HFFamily("Qwen2-MoE"),
    "qwen3": HFFamily("Qwen3"),
    "qwen3_moe": HFFamily("Qwen3-MoE"),
    "phi3": HFFamily("Phi-3"),
    "deepseek_v2": HFFamily("DeepSeek-V2"),
    "deepseek_v3": HFFamily("DeepSeek-V3"),
    "gemma": HFFamily("Gemma", gain_offset=1.0),
    "gemma2": HFFamily("Gemma 2", _SANDWICH, gain_offset=1.0),
    "gemma3_text": HFFamily("Gemma 3 (text only: 270M, 1B)", _SANDWICH, gain_offset=1.0),
    "gemma3": HFFamily("Gemma 3 (with vision: 4B and up; the language model is analysed)", _SANDWICH,
                       blocks="model.language_model.layers", gain_offset=1.0),
    "olmo2": HFFamily("OLMo 2", (("attention_output", "post_attention_layernorm"),
                                 ("mlp_output", "post_feedforward_layernorm"))),
    "gpt2": HFFamily("GPT-2", (("attention_input", "ln_1"), ("mlp_input", "ln_2")), blocks="transformer.h"),
    "openai-gpt": HFFamily("GPT-1", (("attention_residual", "ln_1"), ("mlp_residual", "ln_2")), blocks="transformer.h"),
}
"""config.json's model_type -> family."""


def supported_families() -> str:
    return ", ".join(f"{family.title} ({name!r}, {family.placement.norm_scheme})" for name, family in FAMILIES.items())


def family_of(path: Any, config: dict[str, Any]) -> HFFamily:
    """The family of a model directory's config.json (ValueError naming the supported ones)."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported by the depth analysis; supported "
                         f"(model_type, norm placement): {supported_families()}. Another family needs its block "
                         "list and norms added to lnstrain/analysis/hf_families.py FAMILIES, with a test")
    return FAMILIES[model_type]
