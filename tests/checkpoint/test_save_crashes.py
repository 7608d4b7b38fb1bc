"""A kill at any moment of a save leaves the previous checkpoint loadable, and resuming from what is
left reproduces the uninterrupted run.

Every moment: the save calls ``save_points.reached`` between all its file operations (and before and
after each file DeepSpeed writes). In process, an observer copies the checkpoint directory at each
point, which is exactly what a SIGKILL there would leave on disk (written bytes are in the page
cache; nothing is lost but the process), plus a copy with the file being written cut in half (a
kill in the middle of a write). Every copy must have a loadable ``latest``; a sample of them is
resumed to the end. Then a point with a real SIGKILL of ``launch/pretrain.py`` (the hook's
environment variable), each rerun with the same command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lnstrain.checkpoint.layouts import read_full_state
from lnstrain.checkpoint.manager import newest_checkpoint, read_latest
from lnstrain.checkpoint.metadata import is_complete, step_of
from lnstrain.checkpoint.save_points import KILL_AT_ENV
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.training.test_launch import launcher_command, launcher_env

RUN = ["train.steps=4", "checkpoint.interval_steps=2", "checkpoint.keep_last=1", "train.eval_interval=0",
       "model.hidden_dropout=0.1"]
TOLERANCE = 1e-6
MAX_RESUMED = 12  # snapshots resumed to the end (one per distinct left-over state, at most this many)


def check_leftovers(checkpoint_dir: Path) -> Path | None:
    """What a resume would use; asserts that ``latest``, when present, names a loadable checkpoint."""
    named = read_latest(checkpoint_dir)
    if named is not None:
        assert is_complete(named), f"{checkpoint_dir}/latest names incomplete {named.name}"
        assert read_full_state(named, with_optimizer=True).moments, named
    found = newest_checkpoint(checkpoint_dir)
    if named is not None:
        assert found == named, (found, named)
    elif found is not None:  # killed between the completion marker and the first ``latest``
        assert read_full_state(found, with_optimizer=True).moments, found
    return found


def _snapshot(source: Path, target: Path, half_file: Path | None = None) -> None:
    target.mkdir(parents=True)
    if source.is_dir():
        shutil.copytree(source, target / "checkpoints")
    if half_file is not None and half_file.is_file():
        copy = target / "checkpoints" / half_file.relative_to(source)
        copy.write_bytes(copy.read_bytes()[: copy.stat().st_size // 2])


def crash_at_every_save_point(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.checkpoint import save_points
    from lnstrain.training.trainer import pretrain

    def config(name: str):
        return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / name) + RUN, world_size)

    straight = pretrain(config("straight"))
    source = root / "observed" / "tiny" / "checkpoints"
    snapshots: list[tuple[str, Path]] = []

    def observe(label: str, path: Path | None) -> None:
        target = root / "snapshots" / f"{len(snapshots):03d}"
        _snapshot(source, target)
        snapshots.append((label, target))
        if label == "deepspeed file: written":  # the same file, killed halfway through writing it
            _snapshot(source, target.with_name(target.name + "_half"), half_file=path)
            snapshots.append((label + " (half)", target.with_name(target.name + "_half")))

    save_points.observer = observe
    try:
        observed = pretrain(config("observed"))
    finally:
        save_points.observer = None
    assert observed.losses == straight.losses

    resumed, seen_states = {}, set()
    for label, snapshot in snapshots:
        found = check_leftovers(snapshot / "checkpoints")
        directories = sorted((snapshot / "checkpoints").glob("global_step*"))
        state = (found.name if found else None, read_latest(snapshot / "checkpoints") is not None,
                 tuple(p.name for p in directories if not is_complete(p)), label.endswith("(half)"))
        if state in seen_states or len(resumed) >= MAX_RESUMED:
            continue
        seen_states.add(state)
        run = root / f"resume_{snapshot.name}"
        if (snapshot / "checkpoints").is_dir():
            shutil.copytree(snapshot / "checkpoints", run / "tiny" / "checkpoints")
        result = pretrain(config(run.name))
        resumed[snapshot.name] = (label, found.name if found else None, result.losses, result.eval_losses)
    point_labels = [label for label, _ in snapshots if not label.endswith("(half)")]
    return {"straight": straight, "labels": point_labels, "resumed": resumed}


@pytest.mark.slow
def test_kill_at_every_moment_of_a_save_leaves_a_resumable_checkpoint(tiny_corpus, tmp_path):
    [out] = run_distributed(crash_at_every_save_point, 1, tiny_corpus, tmp_path, timeout_s=300)
    straight, labels = out["straight"], out["labels"]
    first_save = labels.index("save started", 1)
    assert first_save >= 15 and len(labels) >= 2 * first_save, labels  # two saves, every moment seen
    for moment in ("deepspeed file: written", "temporary file fsynced", "every rank finished writing",
                   "renamed into place", "old checkpoint marked incomplete"):
        assert moment in labels, moment
    assert len(out["resumed"]) >= 4, out["resumed"]
    starts = set()
    for name, (label, found, losses, eval_losses) in out["resumed"].items():
        start = step_of(found) if found else 0
        starts.add(start)
        assert sorted(losses) == list(range(start + 1, 5)), (name, label, sorted(losses))
        for step, loss in losses.items():
            assert abs(loss - straight.losses[step]) <= TOLERANCE, (name, label, step, loss, straight.losses[step])
        assert abs(eval_losses[4] - straight.eval_losses[4]) <= TOLERANCE, (name, label)
    assert starts == {0, 2, 4}, starts  # kills before, during and after each save were resumed

    # A real SIGKILL in the second save, then the same command again.
    def launch(run_dir: Path, kill_at: int | None) -> subprocess.CompletedProcess:
        env = launcher_env() | ({KILL_AT_ENV: str(kill_at)} if kill_at else {})
        command = launcher_command(tiny_run_overrides(tiny_corpus, run_dir) + RUN)
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)

    # (two moments here: in the background write, after its first DeepSpeed file, and between the
    # completion marker and ``latest``; tests/training/test_crash_recovery.py kills a rank of a 2-rank
    # run in the middle of DeepSpeed's files)
    for offset in (labels.index("deepspeed file: written", first_save) - first_save,
                   labels.index("every rank finished writing", first_save) - first_save + 4):
        run_dir = tmp_path / f"killed_{offset}"
        killed = launch(run_dir, first_save + offset + 1)
        assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
        assert check_leftovers(run_dir / "tiny" / "checkpoints") is not None
        rerun = launch(run_dir, None)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        final = json.loads((run_dir / "tiny" / "final_metrics.json").read_text())
        assert final["step"] == 4 and abs(final["eval_loss"] - straight.eval_losses[4]) <= TOLERANCE, final
        assert os.path.exists(run_dir / "tiny" / "checkpoints" / "global_step4" / "lnstrain_complete")


def ctrl_c_twice_in_a_save_then_go_on(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    """A second Ctrl-C (KeyboardInterrupt) while the final save writes its first DeepSpeed file, then the
    same run started again to stop at step 3: what the start logged and what it left."""
    import logging

    from lnstrain.checkpoint import save_points
    from lnstrain.training.trainer import pretrain

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root) + RUN, world_size)
    saves = []

    def second_ctrl_c(label: str, path: Path | None) -> None:
        saves.append(label) if label == "save started" else None
        if len(saves) == 2 and label == "deepspeed file: written":
            raise KeyboardInterrupt

    save_points.observer = second_ctrl_c
    try:
        pretrain(config)
        raise AssertionError("the run was not interrupted")
    except KeyboardInterrupt:
        pass
    finally:
        save_points.observer = None
    checkpoints = root / "tiny" / "checkpoints"
    left = {p.name: is_complete(p) for p in checkpoints.glob("global_step*")}
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("lnstrain").addHandler(Keep(level=logging.WARNING))
    again = pretrain(config, stop_at_step=3)
    return {"left": left, "warnings": warnings, "resumed_from": again.resumed_from,
            "after": {p.name: is_complete(p) for p in checkpoints.glob("global_step*")}}


def test_a_save_cut_off_by_a_second_ctrl_c_is_removed_at_the_next_start_and_said_so(tiny_corpus, tmp_path):
    [out] = run_distributed(ctrl_c_twice_in_a_save_then_go_on, 1, tiny_corpus, tmp_path, timeout_s=300)
    assert out["left"] == {"global_step2": True, "global_step4": False}  # half-written, no marker
    [removed] = [m for m in out["warnings"] if m.startswith("removed ")]
    assert f"{tmp_path / 'tiny' / 'checkpoints' / 'global_step4'}: its save was cut off" in removed
    assert Path(out["resumed_from"]).name == "global_step2"
    assert out["after"] == {"global_step3": True}  # step 2 given up by keep_last=1, step 4 removed
