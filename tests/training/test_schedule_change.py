"""Training longer than the checkpoint's schedule said (train.steps 6 -> 12 after a stop at step 3): each
optim.schedule_change gives the learning rates it promises, one warning says so, and a run that goes
on with its chosen schedule needs no second word and stays bit-exact across another stop."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.schedule import LrSchedule

OLD = LrSchedule(lr=1e-2, warmup_steps=1, total_steps=6)  # configs/tests/tiny.yaml
NEW = LrSchedule(lr=1e-2, warmup_steps=1, total_steps=12)


def train_longer(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training import trainer
    from lnstrain.training.metrics import MetricsLogger

    lrs: dict[int, float] = {}
    record_step = MetricsLogger.record_step

    def keep_lr(self, metrics, log_now):
        lrs[metrics.step] = metrics.lr
        return record_step(self, metrics, log_now)

    MetricsLogger.record_step = keep_lr
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "learning-rate schedule" in record.getMessage():
                warnings.append(record.getMessage())

    logging.getLogger("lnstrain").addHandler(Keep(level=logging.WARNING))

    def run(name: str, *extra: str, stop_at_step: int | None = None) -> dict:
        lrs.clear(), warnings.clear()
        config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / name) + list(extra), world_size)
        result = trainer.pretrain(config, stop_at_step=stop_at_step)
        return {"lrs": dict(lrs), "warnings": list(warnings), "losses": result.losses}

    out = {"stopped": run("base", stop_at_step=3)}
    for change in ("decay", "stretch", "keep"):
        shutil.copytree(root / "base", root / change)
        out[change] = run(change, "train.steps=12", f"optim.schedule_change={change}")
    shutil.copytree(root / "base", root / "twice")
    out["twice_first"] = run("twice", "train.steps=12", stop_at_step=8)  # decay (the default), stopped again
    out["twice_second"] = run("twice", "train.steps=12")  # the same command: the chosen decay goes on
    return out


@pytest.mark.slow  # five launches of the trainer in one forked rank
def test_each_schedule_change_gives_what_it_says_with_one_warning(tiny_corpus, tmp_path):
    [out] = run_distributed(train_longer, 1, tiny_corpus, tmp_path, timeout_s=400)
    assert sorted(out["stopped"]["lrs"]) == [1, 2, 3] and not out["stopped"]["warnings"]
    before = OLD.lr_at(3)  # what the checkpoint's schedule gives for step 4
    for change in ("decay", "stretch", "keep"):
        [line] = out[change]["warnings"]
        assert "(train.steps 6 -> 12)" in line and f"optim.schedule_change {change}" in line
        assert f"the checkpoint's schedule gave {before:.2e}" in line
        assert sorted(out[change]["lrs"]) == list(range(4, 13))
    decay = LrSchedule(**{**NEW.to_dict(), "resumed_at": 3, "resumed_lr": before})
    for step, lr in out["decay"]["lrs"].items():
        assert lr == pytest.approx(decay.lr_at(step - 1), rel=1e-12), step
    assert out["decay"]["lrs"][4] == pytest.approx(before, rel=1e-12)  # no jump
    for step, lr in out["stretch"]["lrs"].items():
        assert lr == pytest.approx(NEW.lr_at(step - 1), rel=1e-12), step
    assert out["stretch"]["lrs"][4] > 1.2 * before  # the jump it promises
    for step, lr in out["keep"]["lrs"].items():
        assert lr == pytest.approx(OLD.lr_at(step - 1), rel=1e-12), step
    assert out["keep"]["lrs"][12] == pytest.approx(1e-3)

    first, second = out["twice_first"], out["twice_second"]
    assert len(first["warnings"]) == 1 and second["warnings"] == []  # said once, when it changed
    assert first["lrs"] | second["lrs"] == out["decay"]["lrs"]  # bit for bit the run that did not stop
    assert first["losses"] | second["losses"] == out["decay"]["losses"]
