"""Tiny random Hugging Face models of every family the depth analysis reads, saved with a tiny tokenizer.

Nothing is downloaded: each config is built here (4 layers of width 32 by default), the weights are
drawn from a seed (norm weights too, so that a wrong gain convention shows), and the tokenizer is a
byte-level BPE trained on the tiny grammar corpus with the `tokenizers` library. Families whose
real tokenizer puts BOS first get one that does; the others get one that adds nothing. Per-layer
features are switched on where the family has them, so that a layer's own type matters: sliding
windows on some layers only (Mistral, Qwen2, Gemma 2 and 3), a dense layer among MoE ones
(Qwen2-MoE, Qwen3-MoE, DeepSeek).

    python -m lnstrain.testing.tiny_hf_models llama gemma2 olmo2 --output tiny_hf
    # -> tiny_hf/llama/, tiny_hf/gemma2/, tiny_hf/olmo2/ (save_pretrained + tokenizer), tiny_hf/text.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lnstrain.testing.tiny_corpus import tiny_documents

VOCAB = 320
NUM_LAYERS = 4
BOS, EOS = "<s>", "<|endoftext|>"
BOS_FIRST = {"llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "gemma3", "deepseek_v2", "deepseek_v3"}
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "deepseek_v2",
            "deepseek_v3", "gemma", "gemma2", "gemma3_text", "gemma3", "olmo2", "gpt2", "openai-gpt"]
"""Every family of lnstrain/analysis/hf_families.py, in its order."""


def _shape(num_layers: int, hidden: int) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def _alternating(num_layers: int) -> list[str]:
    return ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(num_layers)]


def family_config(family: str, num_layers: int = NUM_LAYERS, hidden: int = 32):
    """A config of `family` with `num_layers` layers of width `hidden` (4 attention heads)."""
    import transformers

    shape = _shape(num_layers, hidden)
    head_dim, moe = hidden // 4, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    deepseek = dict(shape, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                    moe_intermediate_size=hidden // 2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                    qk_rope_head_dim=head_dim, qk_nope_head_dim=head_dim, v_head_dim=head_dim)
    gpt = dict(vocab_size=VOCAB, n_embd=hidden, n_layer=num_layers, n_head=4, n_positions=64, initializer_range=0.2)
    gemma3_text = dict(shape, head_dim=head_dim, sliding_window=8, layer_types=_alternating(num_layers))
    builders = {
        "llama": lambda: transformers.LlamaConfig(**shape),
        "mistral": lambda: transformers.MistralConfig(**shape, sliding_window=8),
        "mixtral": lambda: transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": lambda: transformers.Qwen2Config(**shape, use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=num_layers // 2),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**shape, **moe, shared_expert_intermediate_size=hidden,
                                                         mlp_only_layers=[1]),
        "qwen3": lambda: transformers.Qwen3Config(**shape, head_dim=head_dim),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**shape, **moe, head_dim=head_dim, mlp_only_layers=[1]),
        "phi3": lambda: transformers.Phi3Config(**shape),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(**{k: v for k, v in deepseek.items()
                                                                 if k not in ("n_group", "topk_group")}),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**deepseek),
        "gemma": lambda: transformers.GemmaConfig(**shape, head_dim=head_dim),
        "gemma2": lambda: transformers.Gemma2Config(**shape, head_dim=head_dim, sliding_window=8),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**gemma3_text),
        "gemma3": lambda: transformers.Gemma3Config(
            text_config=gemma3_text, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4, tie_word_embeddings=False),
        "olmo2": lambda: transformers.Olmo2Config(**shape),
        "gpt2": lambda: transformers.GPT2Config(**gpt, bos_token_id=0, eos_token_id=1),
        "openai-gpt": lambda: transformers.OpenAIGPTConfig(**gpt),
    }
    if family not in builders:
        raise ValueError(f"no tiny config for {family!r}; known: {', '.join(builders)}")
    return builders[family]()


def save_bpe_tokenizer(directory: Path, documents: list[str], add_bos: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS if add_bos else None,
                            eos_token=EOS).save_pretrained(str(directory))


@torch.no_grad()
def randomize_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every norm weight drawn around 1 (around 0 where the norm multiplies by 1 + weight, Gemma's),
    so that each norm's gain differs from its neighbours'."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1:
            centre = 0.0 if float(weight.detach().abs().max()) == 0.0 else 1.0  # Gemma's start at 0
            weight.copy_(centre + 0.3 * torch.randn(weight.shape, generator=generator))


def save_tiny_model(directory: Path, family: str, documents: list[str], seed: int = 0, num_layers: int = NUM_LAYERS,
                    hidden: int = 32) -> Path:
    """A random model of `family` and its tokenizer, written to `directory` as save_pretrained does."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, num_layers, hidden))
    randomize_norms(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(str(directory))
    save_bpe_tokenizer(directory, documents, add_bos=family in BOS_FIRST)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tiny random Hugging Face models, each with a tokenizer, and the "
                                                 "text they were trained on, for trying tools/analyze_depth.py --hf")
    parser.add_argument("families", nargs="+", choices=FAMILIES, metavar="FAMILY", help=", ".join(FAMILIES))
    parser.add_argument("--output", required=True, help="folder: one subfolder per family, and text.jsonl")
    parser.add_argument("--layers", type=int, default=NUM_LAYERS)
    parser.add_argument("--hidden", type=int, default=32, help="width (a multiple of 4)")
    parser.add_argument("--documents", type=int, default=400, help="documents of the grammar corpus in text.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    documents = tiny_documents(args.documents, args.seed)
    (output / "text.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents),
                                       encoding="utf-8")
    for family in args.families:
        save_tiny_model(output / family, family, documents, args.seed, args.layers, args.hidden)
        print(f"{output / family}: a random {family} model, {args.layers} layers of width {args.hidden}")
    print(f"{output / 'text.jsonl'}: {len(documents)} documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
