"""A sharded checkpoint consolidates to the single-process model's fp32 state dict, for every ZeRO stage
(other tensor/pipeline layouts: tests/checkpoint/test_layouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides

ZERO_STAGES = (0, 1, 3)  # ZeRO-2 saves the same files as ZeRO-1


def train_each_zero_stage(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict | None:
    """Train 1 step per ZeRO stage; return (rank 0) each run's consolidated and in-memory weights."""
    from lnstrain.checkpoint.layouts import load_consolidated_state_dict
    from lnstrain.training.trainer import Trainer

    results = {}
    for stage in ZERO_STAGES:
        overrides = tiny_run_overrides(corpus, root / f"zero{stage}") + [
            f"parallel.zero_stage={stage}", "train.steps=1", "train.eval_interval=0", "train.eval_batches=0"]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        trainer.train()
        trained = None
        if stage == 0:  # the parameters are whole on every rank only without ZeRO-3
            trained = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
        dist.barrier()
        if rank == 0:
            config, state = load_consolidated_state_dict(root / f"zero{stage}" / "tiny" / "checkpoints")
            results[stage] = {"config_layers": config.model.num_layers, "state": state, "trained": trained}
    return results if rank == 0 else None


@pytest.mark.multirank
def test_consolidated_state_dict_for_every_zero_stage(tiny_corpus, tmp_path):
    from lnstrain.model.transformer import Transformer
    from lnstrain.parallel.groups import ParallelGroups

    results = run_distributed(train_each_zero_stage, 2, tiny_corpus, tmp_path, timeout_s=300)[0]
    reference = results[0]["trained"]
    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), 2)
    for stage in ZERO_STAGES:
        state = results[stage]["state"]
        assert results[stage]["config_layers"] == 2
        model = Transformer(config.model, ParallelGroups.single_process())
        model.load_state_dict(state, strict=True)  # exactly the single-process model's names
        assert all(t.dtype == torch.float32 for t in state.values())
        for name, tensor in reference.items():
            # ZeRO-0 clips with lnstrain's hook, ZeRO 1-3 with DeepSpeed's: same maths, other rounding
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-5 if stage else 0, msg=name)

    # ZeRO-3 writes no mp_rank_00_model_states.pt; the tool goes through the same any-layout reader
    from lnstrain.checkpoint.consolidated_file import load_consolidated
    from tests.tool_scripts import load_tool

    output = tmp_path / "zero3.safetensors"
    assert load_tool("consolidate_checkpoint").main(["--checkpoint", str(tmp_path / "zero3" / "tiny"),
                                                     "--output", str(output)]) == 0
    tool_config, tool_state = load_consolidated(output)
    assert tool_config.parallel.zero_stage == 3
    assert sorted(tool_state) == sorted(results[3]["state"])
    for name, tensor in results[3]["state"].items():
        torch.testing.assert_close(tool_state[name], tensor, rtol=0, atol=0, msg=name)

