"""A save that cannot write (full disk, no permission) stops the run with one message naming the
checkpoint, the cause and the free space, no traceback; the previous checkpoint stays loadable and the
same command resumes from it.

The full disk is real: the first file DeepSpeed writes for step 4 is made a symbolic link to
``/dev/full``, where every write fails with ENOSPC, so torch raises what it raises on a full disk. Only
the free-space figure of the file system is faked (``write_errors.free_space``), to be that of a full one. The
permission error is raised where DeepSpeed opens that file (root, as tests often run, may write anywhere).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import os
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from lnstrain.checkpoint.layouts import read_full_state
from lnstrain.checkpoint.manager import newest_checkpoint
from lnstrain.checkpoint.metadata import is_complete
from lnstrain.checkpoint.write_errors import describe_write_failure, human_bytes, is_write_failure
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.training.test_launch import LAUNCHER

RUN = ["train.steps=4", "checkpoint.interval_steps=2", "train.eval_interval=0"]
FULL_DISK = namedtuple("usage", "total used free")(10 * 2**30, 10 * 2**30 - 4096, 4096)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_human(text: str) -> float:
    """'12.3 GiB free ...' -> bytes."""
    number, unit = text.split()[:2]
    return float(number) * UNITS[unit]


def _launcher_main():
    spec = importlib.util.spec_from_file_location("lnstrain_launch_pretrain", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def fail_at_step_4(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.checkpoint import save_points, write_errors
    from lnstrain.config.run_config import load_config
    from lnstrain.training.trainer import pretrain

    overrides = tiny_run_overrides(corpus, root) + RUN
    argv = ["--config", str(TINY_RUN_CONFIG)] + [part for o in overrides for part in ("--set", o)]
    main = _launcher_main()

    def launch(break_the_write) -> tuple[int, str]:
        def observe(label: str, path: Path | None) -> None:
            if label == "deepspeed file: before" and "global_step4" in str(path):
                save_points.observer = None  # the first file of step 4 only
                break_the_write(path)

        save_points.observer = observe
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                code = main(argv)
        finally:
            save_points.observer = None
        return code, stderr.getvalue()

    def full_disk(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to("/dev/full")
        write_errors.free_space = lambda _: (FULL_DISK.free, FULL_DISK.total)

    def no_permission(path: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    real_free_space = write_errors.free_space
    try:
        out = {"full": launch(full_disk)}
    finally:
        write_errors.free_space = real_free_space
    checkpoints = root / "tiny" / "checkpoints"
    out["after full"] = newest_checkpoint(checkpoints)
    read_full_state(out["after full"], with_optimizer=True)  # loadable, weights and optimizer
    out["permission"] = launch(no_permission)
    out["after permission"] = newest_checkpoint(checkpoints)
    resumed = pretrain(load_config(TINY_RUN_CONFIG, overrides, world_size))
    out["resumed steps"] = sorted(resumed.losses)
    out["step 4 complete"] = is_complete(checkpoints / "global_step4")
    return out


def test_a_full_disk_or_a_refused_write_names_the_path_and_free_space_and_keeps_the_last_checkpoint(
        tiny_corpus, tmp_path):
    [out] = run_distributed(fail_at_step_4, 1, tiny_corpus, tmp_path, timeout_s=300)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    code, message = out["full"]
    assert code == 1 and "Traceback" not in message, message
    assert message.startswith(f"lnstrain: cannot save checkpoint {checkpoints / 'global_step4'}: "), message
    assert f"The file system holding {checkpoints} has 4.0 KiB free of 10.0 GiB. It is full: free space" in message
    assert f"The previous checkpoint {checkpoints / 'global_step2'} is untouched: rerun the same command" in message
    assert out["after full"] == checkpoints / "global_step2"

    code, message = out["permission"]
    assert code == 1 and "Traceback" not in message, message
    assert (f"cannot save checkpoint {checkpoints / 'global_step4'}: Permission denied writing "
            f"{checkpoints / 'global_step4'}/") in message
    free, total = shutil.disk_usage(tmp_path)[2], shutil.disk_usage(tmp_path)[0]
    assert re.search(rf"The file system holding {re.escape(str(checkpoints))} has [0-9.]+ [KMGT]iB free of "
                     rf"[0-9.]+ [KMGT]iB\. Make", message), message
    assert human_bytes(total) in message and abs(free - parse_human(message.split(" has ")[1])) < 0.1 * total
    assert f"Make {checkpoints} writable for user id {os.getuid()}" in message
    assert out["after permission"] == checkpoints / "global_step2"

    assert out["resumed steps"] == [3, 4] and out["step 4 complete"]


def test_only_write_failures_are_explained_and_each_cause_gets_its_advice(tmp_path):
    assert is_write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert is_write_failure(RuntimeError("basic_ios::clear: iostream error"))
    assert not is_write_failure(RuntimeError("[../third_party/gloo/...] Connection closed by peer"))
    step_dir, previous = tmp_path / "global_step8", tmp_path / "global_step4"
    no_space = describe_write_failure(OSError(errno.ENOSPC, "No space left on device", str(step_dir / "m.pt")),
                                      step_dir, previous)
    assert no_space.startswith(f"cannot save checkpoint {step_dir}: No space left on device writing {step_dir}/m.pt.")
    assert "It is full" in no_space and f"The previous checkpoint {previous} is untouched" in no_space
    read_only = describe_write_failure(OSError(errno.EROFS, "Read-only file system"), step_dir, None)
    assert f"Make {tmp_path} writable" in read_only and "There is no earlier checkpoint of this run" in read_only
    after_publishing = describe_write_failure(OSError(errno.EIO, "Input/output error"), step_dir, step_dir)
    assert "global_step8 itself is complete and a rerun of the same command resumes from it" in after_publishing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: nothing to observe")
def test_a_real_read_only_directory_is_explained(tmp_path):
    """The errno of a real refused write (as a user; the full run above raises it for root)."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as error:
            (directory / "global_step2").mkdir()
        assert "Make" in describe_write_failure(error.value, directory / "global_step2", None)
    finally:
        directory.chmod(0o755)
