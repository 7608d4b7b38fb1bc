"""Checkpoints of sharded layouts read back as the single-process model, and the tools on top.

One 4-rank spawn loads a known full state dict (``initialize_from``, as ``checkpoint.init_from``) into engines at (tensor 2, pipeline 2) untied and
tied, and (tensor 2, data 2) with the single KV head replicated under ZeRO-0, and saves each. The
readers must give back exactly that state dict (fp32 masters from ZeRO partitions or the module
weights), whatever the split; the vocabulary is padded differently at tensor sizes 1 and 2
(200 -> 240 vs 288 rows) so that the padding is dropped and restored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.checkpoint.test_hf_export import perturbed_model, reference_llama_logits, tokens
from tests.tool_scripts import load_tool

SHAPE = ["model.num_layers=4", "model.vocab_size=200", "model.make_vocab_size_divisible_by=48",
         "model.num_heads=4", "model.num_kv_heads=2"]
CASES = {
    "tp2_pp2": (2, 2, []),
    "tp2_pp2_tied": (2, 2, ["model.tie_embeddings=true"]),
    "tp2_dp2_zero0_replicated_kv": (2, 1, ["model.num_kv_heads=1", "parallel.zero_stage=0"]),
}


def _config(corpus: TinyCorpus, directory: Path, case: str, world_size: int):
    tensor, pipeline, extra = CASES[case]
    overrides = tiny_run_overrides(corpus, directory) + SHAPE + extra + [
        f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}", f"run.name={case}"]
    return load_config(TINY_RUN_CONFIG, overrides, world_size)


def save_known_states(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict[str, str]:
    from lnstrain.checkpoint.consolidated_file import save_consolidated
    from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition
    from lnstrain.checkpoint.reshard import initialize_from
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training.engine import build_engine

    saved = {}
    for case in CASES:
        config = _config(corpus, root, case, world_size)
        groups = ParallelGroups.build(config.parallel.tensor, config.parallel.pipeline)
        training = build_engine(config, groups)
        init_file = save_consolidated(root / f"known_{case}_rank{rank}.safetensors",
                                      perturbed_model(config.model).state_dict())
        initialize_from(training, init_file)  # what checkpoint.init_from does
        manager = CheckpointManager(config, (groups.tp_size, groups.pp_size, groups.dp_size), None, None)
        saved[case] = str(manager.save(training, TrainingPosition(step=1, consumed_samples=8)))
    return saved


@pytest.fixture(scope="module")
def saved_checkpoints(tiny_corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    saved = run_distributed(save_known_states, 4, tiny_corpus, root, timeout_s=600)[0]
    return {case: Path(path) for case, path in saved.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_consolidation_equals_the_single_process_weights(saved_checkpoints, case):
    from lnstrain.checkpoint.layouts import load_consolidated_state_dict, read_saved_layout
    from lnstrain.checkpoint.reshard import needs_resharding

    step_dir = saved_checkpoints[case]
    config, state = load_consolidated_state_dict(step_dir.parent)  # the checkpoint directory's newest step
    known = perturbed_model(config.model).state_dict()
    assert sorted(state) == sorted(known)
    for name, tensor in known.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    layout = read_saved_layout(step_dir)
    assert (layout.tensor, layout.pipeline) == CASES[case][:2]
    assert needs_resharding(step_dir, (1, 1, 4)) and not needs_resharding(
        step_dir, (layout.tensor, layout.pipeline, layout.data))


@pytest.mark.multirank
def test_tools_consolidate_and_export_a_tp2_pp2_checkpoint(saved_checkpoints, tmp_path):
    from lnstrain.checkpoint.consolidated_file import load_consolidated
    from lnstrain.checkpoint.hf_io import read_hf_tensors

    run_dir = saved_checkpoints["tp2_pp2"].parents[1]  # <output>/<run name>/checkpoints/global_step1
    output = tmp_path / "model.safetensors"
    assert load_tool("consolidate_checkpoint").main(["--checkpoint", str(run_dir), "--output", str(output)]) == 0
    config, state = load_consolidated(output)
    assert config.parallel.tensor == 2 and config.model.num_layers == 4
    model = perturbed_model(config.model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())

    hf_dir = tmp_path / "hf"
    assert load_tool("convert_to_hf").main(["--checkpoint", str(run_dir), "--output", str(hf_dir), "--dtype", "fp32"]) == 0
    ids = tokens(config.model)
    with torch.no_grad():
        ours = model(ids)[..., :config.model.vocab_size]
        theirs = reference_llama_logits(read_hf_tensors(hf_dir), json.loads((hf_dir / "config.json").read_text()), ids)
    assert (theirs - ours).abs().max() <= 1e-4
    assert (hf_dir / "tokenizer.model").is_file()


def test_convert_to_hf_refuses_post_ln_checkpoint(tmp_path, capsys):
    from tests.checkpoint.test_manager import fake_checkpoint

    config = load_config(TINY_RUN_CONFIG, ["model.norm_scheme=post_ln"], validate=False)
    fake_checkpoint(tmp_path / "checkpoints", 5, config_yaml=config.to_yaml())
    assert load_tool("convert_to_hf").main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert "model.norm_scheme=post_ln cannot be exported as a Hugging Face LLaMA" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_unsafe_deepspeed_file_is_refused_without_allow_pickle(tmp_path):
    from lnstrain.checkpoint.safe_load import load_deepspeed_file

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "arguments": argparse.Namespace(lr=1.0)}, path)  # an object no allow-list admits
    refused = r"\(argparse.Namespace\), so loading it could run code stored in it.*--allow-pickle"
    with pytest.raises(ValueError, match=refused):
        load_deepspeed_file(path)
    assert "module" in load_deepspeed_file(path, allow_pickle=True)
