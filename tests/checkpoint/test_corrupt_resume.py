"""A checkpoint whose files differ from what its save wrote is never loaded: the resume says which file
and falls back to the newest older checkpoint that verifies, reproducing the uninterrupted run from
there; with none left it stops (exit 2 from the launcher). ``tools/verify_checkpoint.py`` finds the
same files.

One run saves at steps 2 and 4 and is copied three times: 4 KiB overwritten in the middle of step
4's optimizer file; step 4's model-states file cut in half; both checkpoints' optimizer files
overwritten.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.integrity import check_step_dir
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.checkpoint.tampering import overwrite_middle, truncate
from tests.tool_scripts import load_tool
from tests.training.test_launch import launcher_command, launcher_env

RUN = ["train.steps=6", "checkpoint.interval_steps=2", "train.eval_interval=0", "model.hidden_dropout=0.1"]
TOLERANCE = 1e-6
pytestmark = pytest.mark.slow  # one training fixture of about 25 s
OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"


def step_dir(root: Path, run: str, step: int) -> Path:
    return root / run / "tiny" / "checkpoints" / f"global_step{step}"


def corrupt_and_resume(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import pretrain

    def train(run: str, stop_at_step: int | None = None):
        return pretrain(load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / run) + RUN, world_size),
                        stop_at_step)

    errors: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.getMessage()) if record.levelno >= logging.ERROR else None
    logging.getLogger("lnstrain.checkpoint").addHandler(handler)

    straight = train("straight")
    train("run", stop_at_step=4)
    for copy in ("optimizer", "truncated", "all"):
        shutil.copytree(root / "run", root / copy)
    overwrite_middle(step_dir(root, "optimizer", 4) / OPTIMIZER_FILE)
    truncate(step_dir(root, "truncated", 4) / MODEL_FILE)
    for step in (2, 4):
        overwrite_middle(step_dir(root, "all", step) / OPTIMIZER_FILE)

    results = {"straight": straight}
    for copy in ("optimizer", "truncated"):
        errors.clear()
        results[copy] = train(copy)
        results[f"{copy}_errors"] = list(errors)
    try:
        train("all")
        results["all_error"] = None
    except CheckpointError as error:
        results["all_error"] = str(error)
    return results


@pytest.fixture(scope="module")
def corrupted(tiny_corpus, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("corrupted")
    [results] = run_distributed(corrupt_and_resume, 1, tiny_corpus, root, timeout_s=300)
    return root, results


def test_an_overwritten_optimizer_file_falls_back_and_reproduces_the_run(corrupted):
    root, results = corrupted
    straight, resumed = results["straight"], results["optimizer"]
    assert Path(resumed.resumed_from) == step_dir(root, "optimizer", 2)
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    for step in resumed.losses:
        assert abs(resumed.losses[step] - straight.losses[step]) <= TOLERANCE, (step, resumed.losses, straight.losses)
    assert any(f"{step_dir(root, 'optimizer', 4) / OPTIMIZER_FILE}: its bytes differ" in line
               for line in results["optimizer_errors"]), results["optimizer_errors"]
    assert check_step_dir(step_dir(root, "optimizer", 4)).ok  # saved again over the corrupt one


def test_a_truncated_model_states_file_falls_back_and_is_named(corrupted):
    root, results = corrupted
    assert Path(results["truncated"].resumed_from) == step_dir(root, "truncated", 2)
    path = step_dir(root, "truncated", 4) / MODEL_FILE
    assert any(f"{path}: " in line and "bytes, but its save wrote" in line for line in results["truncated_errors"]), \
        results["truncated_errors"]
    assert results["truncated"].position.step == 6


def test_no_checkpoint_that_verifies_stops_with_exit_2(corrupted, tiny_corpus, capsys):
    root, results = corrupted
    bad = [step_dir(root, "all", step) / OPTIMIZER_FILE for step in (4, 2)]
    message = results["all_error"]
    assert message is not None and all(f"{path}: its bytes differ" in message for path in bad), message

    assert load_tool("verify_checkpoint").main([str(root / "all" / "tiny")]) == 1
    out = capsys.readouterr().out
    assert "global_step2  CORRUPT" in out and "global_step4  CORRUPT" in out
    assert out.splitlines()[-1].endswith("checkpoint.resume: auto stops: no checkpoint verifies")

    done = subprocess.run(launcher_command(tiny_run_overrides(tiny_corpus, root / "all") + RUN),
                          capture_output=True, text=True, env=launcher_env(), timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert all(f"{path}: its bytes differ" in done.stderr for path in bad), done.stderr
    assert f"cannot resume: no checkpoint in {bad[0].parent.parent} holds what its save wrote" in done.stderr

