"""The Hugging Face export reads what to fold from the model's own ``block_layout``, not from a list of
schemes: a norm scheme that brings its own per-layer factor is folded (transformers' logits equal
lnstrain's, fp32, within 1e-4, and the import gives the weights back), and a layout LLaMA's block
cannot compute is refused, naming the scheme and what LLaMA lacks.

``NormScheme`` is a closed enum, so a "new scheme" here is ``pre_ln`` given another ``block_layout``,
patched where the model and the exporter both read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from lnstrain.checkpoint.hf_io import load_hf_llama_state_dict, save_hf_checkpoint
from lnstrain.checkpoint.hf_exportable import export_problems
from lnstrain.checkpoint.hf_llama import from_hf_state_dict, to_hf_state_dict
from lnstrain.checkpoint.lns_fold import NORM_GAINS, SUBLAYER_OUTPUTS, UNFOLDED_WEIGHTS_FILE
from lnstrain.model import block, norm_schemes
from lnstrain.model.config import NormScheme
from lnstrain.model.norm_schemes import BlockLayout, Placement
from tests.checkpoint.test_hf_export import export_and_compare, perturbed_model, tiny_cfg


def give_pre_ln_the_layout(monkeypatch, layout_of: Callable[[int], BlockLayout]) -> None:
    """From now on norm_scheme=pre_ln builds layer ℓ as ``layout_of(ℓ)``, in the model and in the exporter."""
    original = norm_schemes.block_layout

    def patched(cfg, layer_number):
        if NormScheme(cfg.norm_scheme) == NormScheme.PRE_LN:
            return layout_of(layer_number)
        return original(cfg, layer_number)

    monkeypatch.setattr(norm_schemes, "block_layout", patched)
    monkeypatch.setattr(block, "block_layout", patched)


def its_own_factor(layer_number: int) -> float:
    """Not LNS's 1/sqrt(l): a factor no exporter could know about by the scheme's name."""
    return 0.5 + 1.5 / layer_number ** 2


@pytest.mark.parametrize("where", ["norm_output_scale", "sublayer_output_scale"])
def test_a_new_schemes_own_factor_is_folded_and_unfolded(where, monkeypatch, tmp_path):
    give_pre_ln_the_layout(monkeypatch, lambda n: BlockLayout(Placement.PRE, **{where: its_own_factor(n)}))
    cfg = tiny_cfg(norm_scheme="pre_ln", num_kv_heads=2)
    export_and_compare(cfg, tmp_path)  # transformers computes lnstrain's logits: the factors are in the weights
    record = json.loads((tmp_path / "config.json").read_text())["lnstrain"]
    assert record["norm_scheme"] == "pre_ln"
    assert record["lns_folded_into"] == (NORM_GAINS if where == "norm_output_scale" else SUBLAYER_OUTPUTS)
    assert record["layer_factors"] == [its_own_factor(n) for n in range(1, cfg.num_layers + 1)]
    assert (tmp_path / UNFOLDED_WEIGHTS_FILE).is_file() == (where == "norm_output_scale")
    original = perturbed_model(cfg).state_dict()
    imported = load_hf_llama_state_dict(tmp_path, cfg)
    assert sorted(imported) == sorted(original)
    for name, tensor in original.items():  # x * f / f may differ in the last bit where no side file keeps x
        torch.testing.assert_close(imported[name], tensor, rtol=1e-6, atol=0, msg=name)


def test_the_factor_follows_the_layout_not_the_scheme_name(monkeypatch):
    """The same pre_ln state dict exports differently once pre_ln's layout carries a factor."""
    cfg = tiny_cfg(norm_scheme="pre_ln")
    state = perturbed_model(cfg).state_dict()
    plain = to_hf_state_dict(state, cfg)["model.layers.2.input_layernorm.weight"]
    give_pre_ln_the_layout(monkeypatch, lambda n: BlockLayout(Placement.PRE, norm_output_scale=its_own_factor(n)))
    folded = to_hf_state_dict(state, cfg)["model.layers.2.input_layernorm.weight"]
    assert torch.equal(folded, plain * its_own_factor(3))


@dataclass(frozen=True)
class GatedLayout(BlockLayout):
    """A layout with a field the exporter has never heard of."""

    output_gate: float = 1.0


@pytest.mark.parametrize("layout_of, reason", [
    (lambda n: BlockLayout(Placement.PRE, norm_output_scale=its_own_factor(n), sublayer_output_scale=0.5),
     "Pre-LN multiplies both the pre-sublayer norms' output and the sublayers' output by a factor"),
    (lambda n: BlockLayout(Placement.PRE, layerscale_init=0.1 if n == 2 else None),
     "Pre-LN's layers multiply each sublayer's output by a learned per-channel gain (layers 2)"),
    (lambda n: BlockLayout(Placement.POST if n <= 2 else Placement.PRE),
     "Pre-LN's first layers are Post-LN (norm(x + f(x)) in layers 1-2)"),
    (lambda n: BlockLayout(Placement.PRE, residual_scale=2.0),
     "Pre-LN scales the residual branch"),
    (lambda n: GatedLayout(Placement.PRE, output_gate=0.5),
     "Pre-LN sets BlockLayout.output_gate, which the Hugging Face export does not know how to express"),
], ids=["two-factors", "layerscale-in-one-layer", "post-ln-first-layers", "scaled-residual", "unknown-field"])
def test_a_layout_llama_cannot_compute_is_refused(layout_of, reason, monkeypatch):
    give_pre_ln_the_layout(monkeypatch, layout_of)
    cfg = tiny_cfg(norm_scheme="pre_ln")
    [problem] = export_problems(cfg)
    assert problem.startswith(f"model.norm_scheme=pre_ln cannot be exported as a Hugging Face LLaMA: {reason}")
    assert "Exportable schemes for this model: lns, lns_after_sublayer, lns_gain_init" in problem
    with pytest.raises(ValueError, match="model.norm_scheme=pre_ln cannot be exported"):
        to_hf_state_dict({}, cfg)
    with pytest.raises(ValueError, match="cannot import a LLaMA checkpoint into model.norm_scheme=pre_ln"):
        from_hf_state_dict({}, cfg)


def test_a_tensor_the_export_would_leave_behind_is_refused():
    cfg = tiny_cfg(norm_scheme="pre_ln")
    state = {**perturbed_model(cfg).state_dict(), "layers.1.attention_layerscale.gain": torch.ones(32)}
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) a Hugging Face LLaMA has no place for "
                                         r"\(e.g. layers.1.attention_layerscale.gain\)"):
        to_hf_state_dict(state, cfg)
