"""A checkpoint whose files differ from what its save wrote is never loaded: the resume says which file
and falls back to the newest older checkpoint that verifies, reproducing the uninterrupted run from
there; with none left it stops (exit 2 from the launcher). ``tools/verify_checkpoint.py`` finds the
same files (and exits 2 where a resume stops).

Three copies of the stopped run (``conftest.stopped_run``): 4 KiB overwritten in the middle of step
4's optimizer file; step 4's model-states file cut in half; both checkpoints' optimizer files
overwritten.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.verifier import check_step_dir
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TinyCorpus, tiny_run_overrides
from tests.checkpoint.tampering import (MODEL_FILE, OPTIMIZER_FILE, RUN, TOLERANCE, copy_run, overwrite_middle,
                                        run_config, step_dir, truncate)
from tests.tool_scripts import load_tool
from tests.training.test_launch import launcher_command, launcher_env

pytestmark = pytest.mark.slow  # with the stopped run it shares, about 20 s


def corrupt_and_resume(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import pretrain

    errors: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.getMessage()) if record.levelno >= logging.ERROR else None
    logging.getLogger("lnstrain.checkpoint").addHandler(handler)

    results = {}
    for copy in ("optimizer", "truncated"):
        errors.clear()
        results[copy] = pretrain(run_config(corpus, root / copy, world_size=world_size))
        results[f"{copy}_errors"] = list(errors)
    try:
        pretrain(run_config(corpus, root / "all", world_size=world_size))
        results["all_error"] = None
    except CheckpointError as error:
        results["all_error"] = str(error)
    return results


@pytest.fixture(scope="module")
def corrupted(stopped_run) -> tuple[Path, dict]:
    root = stopped_run.root
    for copy in ("optimizer", "truncated", "all"):
        copy_run(root, copy)
    overwrite_middle(step_dir(root / "optimizer", 4) / OPTIMIZER_FILE)
    truncate(step_dir(root / "truncated", 4) / MODEL_FILE)
    for step in (2, 4):
        overwrite_middle(step_dir(root / "all", step) / OPTIMIZER_FILE)
    [results] = run_distributed(corrupt_and_resume, 1, stopped_run.corpus, root, timeout_s=300)
    return root, results | {"straight": stopped_run.straight}


def test_an_overwritten_optimizer_file_falls_back_and_reproduces_the_run(corrupted):
    root, results = corrupted
    straight, resumed = results["straight"], results["optimizer"]
    assert Path(resumed.resumed_from) == step_dir(root / "optimizer", 2)
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    for step in resumed.losses:
        assert abs(resumed.losses[step] - straight[step]) <= TOLERANCE, (step, resumed.losses, straight)
    assert any(f"{step_dir(root / 'optimizer', 4) / OPTIMIZER_FILE}: its bytes differ" in line
               for line in results["optimizer_errors"]), results["optimizer_errors"]
    assert check_step_dir(step_dir(root / "optimizer", 4)).ok  # saved again over the corrupt one


def test_a_truncated_model_states_file_falls_back_and_is_named(corrupted):
    root, results = corrupted
    assert Path(results["truncated"].resumed_from) == step_dir(root / "truncated", 2)
    path = step_dir(root / "truncated", 4) / MODEL_FILE
    assert any(f"{path}: " in line and "bytes, but its save wrote" in line for line in results["truncated_errors"]), \
        results["truncated_errors"]
    assert results["truncated"].position.step == 6


def test_no_checkpoint_that_verifies_stops_with_exit_2(corrupted, tiny_corpus, capsys):
    root, results = corrupted
    bad = [step_dir(root / "all", step) / OPTIMIZER_FILE for step in (4, 2)]
    message = results["all_error"]
    assert message is not None and all(f"{path}: its bytes differ" in message for path in bad), message

    assert load_tool("verify_checkpoint").main([str(root / "all" / "tiny")]) == 2  # a resume stops
    out = capsys.readouterr().out
    assert "global_step2  CORRUPT" in out and "global_step4  CORRUPT" in out
    assert out.splitlines()[-1].endswith("checkpoint.resume: auto stops: no checkpoint verifies")

    done = subprocess.run(launcher_command(tiny_run_overrides(tiny_corpus, root / "all") + RUN),
                          capture_output=True, text=True, env=launcher_env(), timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert all(f"{path}: its bytes differ" in done.stderr for path in bad), done.stderr
    assert f"cannot resume: no checkpoint in {bad[0].parent.parent} can be used" in done.stderr
