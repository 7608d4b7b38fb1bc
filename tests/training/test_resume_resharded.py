"""Resuming a run at another parallel layout goes through the trainer: saved at (tensor 2, pipeline 1,
data 1), resumed in the same run directory at (1, 1, 2), the losses continue as the uninterrupted
run's; a ZeRO-0 checkpoint (no Adam moments to reshard) is refused unless asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides

TOLERANCE = 2e-5  # as tests/checkpoint/test_reshard.py: other layouts round differently
TENSOR_2 = ["parallel.tensor=2"]
DATA_2 = ["parallel.tensor=1"]


def save_at_tp2_resume_at_dp2(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.preflight import resume_problems
    from lnstrain.training.trainer import pretrain

    def config(name: str, *extra: str):
        return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / name) + list(extra), world_size)

    straight = pretrain(config("straight", *TENSOR_2))
    interrupted = pretrain(config("resharded", *TENSOR_2), stop_at_step=3)
    resumed = pretrain(config("resharded", *DATA_2))

    pretrain(config("zero0", *TENSOR_2, "parallel.zero_stage=0"), stop_at_step=3)
    refused = resume_problems(config("zero0", *DATA_2, "parallel.zero_stage=0"), world_size=world_size)
    try:
        pretrain(config("zero0", *DATA_2, "parallel.zero_stage=0"))
        refused_by_trainer = ""
    except ValueError as error:
        refused_by_trainer = str(error)
    fresh = pretrain(config("zero0", *DATA_2, "parallel.zero_stage=0", "checkpoint.reshard_with_fresh_optimizer=true"))
    return {"straight": straight, "interrupted": interrupted, "resumed": resumed, "refused": refused,
            "refused_by_trainer": refused_by_trainer, "fresh": fresh}


@pytest.mark.multirank
def test_resume_at_another_layout_through_the_trainer(tiny_corpus, tmp_path):
    out = run_distributed(save_at_tp2_resume_at_dp2, 2, tiny_corpus, tmp_path, timeout_s=300)[0]
    straight, interrupted, resumed = out["straight"], out["interrupted"], out["resumed"]
    assert sorted(interrupted.losses) == [1, 2, 3]
    assert Path(resumed.resumed_from).name == "global_step3" and sorted(resumed.losses) == [4, 5, 6]
    for step in range(1, 7):
        loss = (interrupted.losses | resumed.losses)[step]
        assert abs(loss - straight.losses[step]) <= TOLERANCE, (step, loss, straight.losses[step])
    assert resumed.position.consumed_samples == straight.position.consumed_samples == 48

    [problem] = out["refused"]
    assert "ZeRO-0" in problem and "checkpoint.reshard_with_fresh_optimizer: true" in problem, problem
    assert problem in out["refused_by_trainer"]
    fresh = out["fresh"]
    assert Path(fresh.resumed_from).name == "global_step3" and sorted(fresh.losses) == [4, 5, 6]
