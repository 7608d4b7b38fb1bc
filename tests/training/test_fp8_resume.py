"""FP8 is a compute choice: a checkpoint saved with ``precision.fp8`` resumes without it, and the other way
round, exactly as if the run had switched there without stopping.

Uninterrupted: one bf16 engine (ZeRO 1, DeepSpeed's BF16_Optimizer) trains two steps in one mode, saves a
checkpoint, and trains two more after ``set_fp8_mode`` switched its blocks in place. Resumed: a new engine
configured with the second mode loads that checkpoint and trains the last two. The losses and gradient norms of steps 3 and 4 must be equal bit for bit, and a model built with
float8 has the same parameters and state-dict keys as one without (nothing of float8 is stored).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lnstrain.testing.distributed import run_distributed
from tests.parallel.layouts import Layout, rank_micro_batches

MODES = [("tensorwise", "none"), ("none", "rowwise")]


def _config(fp8: str):
    return Layout("resume", zero_stage=1, dtype="bf16", fp8=fp8).config(steps=4)


def _switch_and_resume(rank: int, world_size: int, root: Path, modes: list[tuple[str, str]]) -> dict:
    from lnstrain.model.build import build_groups, set_fp8_mode
    from lnstrain.training.engine import build_engine

    def steps(engine, numbers):
        results = [engine.train_step(rank_micro_batches(step, 0, 1)) for step in numbers]
        return [(r.loss, r.grad_norm) for r in results]

    results = {}
    for first, then in modes:
        groups = build_groups(_config(first))
        straight = build_engine(_config(first), groups)
        steps(straight, [0, 1])
        step_dir = root / f"{first}_to_{then}" / "global_step2"
        straight.save_checkpoint(step_dir)
        set_fp8_mode(straight.module, then)
        after = steps(straight, [2, 3])

        resumed = build_engine(_config(then), groups)
        resumed.load_checkpoint(step_dir)
        results[(first, then)] = {"straight": after, "resumed": steps(resumed, [2, 3]),
                                  "keys": sorted(resumed.module.state_dict()) == sorted(straight.module.state_dict())}
    return results


@pytest.mark.slow
def test_a_checkpoint_resumes_with_or_without_fp8_as_an_uninterrupted_switch(tmp_path):
    [results] = run_distributed(_switch_and_resume, 1, tmp_path, MODES, timeout_s=300)
    for modes, result in results.items():
        assert result["resumed"] == result["straight"], modes
        assert result["keys"], modes
    (tensorwise_to_none, none_to_rowwise) = (results[modes]["straight"] for modes in MODES)
    assert tensorwise_to_none != none_to_rowwise  # the modes computed differently


@pytest.mark.parametrize("saved,now", [("tensorwise", "none"), ("none", "rowwise")])
def test_the_pre_launch_check_accepts_a_checkpoint_of_the_other_fp8_mode(tmp_path, saved, now):
    from lnstrain.checkpoint.metadata import CONFIG_FILE
    from lnstrain.training.preflight import model_mismatch_problems

    config = _config(saved)
    step_dir = tmp_path / "global_step2"
    config.save(step_dir / CONFIG_FILE)
    current = dataclasses.replace(config, precision=dataclasses.replace(config.precision, fp8=now))
    assert model_mismatch_problems(current, step_dir) == []
    other_model = dataclasses.replace(current, model=dataclasses.replace(current.model, hidden_size=64))
    assert model_mismatch_problems(other_model, step_dir)  # what it does refuse: another model
