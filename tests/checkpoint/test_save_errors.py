"""A save that cannot write (full disk, no permission) stops the run with one message naming the
checkpoint, the cause and the free space, no traceback; the previous checkpoint stays loadable and the
same command resumes from it.

The full disk is real: the first file DeepSpeed writes for step 4 is opened on ``/dev/full`` instead
(where every write fails with ENOSPC), so torch raises what it raises on a full disk. Only
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
        from lnstrain.checkpoint import integrity

        real_create = integrity.create_exclusively  # a link planted there would be removed: open /dev/full instead

        def dev_full(target: Path, mode: int = 0o666) -> int:
            integrity.create_exclusively = real_create  # this file only
            return os.open("/dev/full", os.O_WRONLY)

        integrity.create_exclusively = dev_full
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



def fail_step_4_on_one_rank(rank: int, world_size: int, corpus: TinyCorpus, root: Path, scenario: str) -> dict:
    """The save of step 4 fails on one rank only (``scenario`` says where and how); then a rerun."""
    import torch.distributed
    from lnstrain.checkpoint import save_points, write_errors
    from lnstrain.checkpoint.metadata import COMPLETE_MARKER
    from lnstrain.config.run_config import load_config
    from lnstrain.training.trainer import pretrain

    overrides = tiny_run_overrides(corpus, root) + RUN
    argv = ["--config", str(TINY_RUN_CONFIG)] + [part for o in overrides for part in ("--set", o)]
    checkpoints = root / "tiny" / "checkpoints"

    def full_disk(path: Path) -> None:  # what torch raises for a real full disk is tested on one rank above
        write_errors.free_space = lambda _: (FULL_DISK.free, FULL_DISK.total)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def marker_cannot_be_written(step_dir: Path) -> None:
        (step_dir / COMPLETE_MARKER).mkdir()  # rank 0's marker write then fails (a directory is in the way)

    def serialization_bug(path: Path) -> None:
        raise RuntimeError(f"injected: cannot serialise {path.name}")

    failing_rank, label, fail = {
        "rank 1 disk full": (1, "deepspeed file: before", full_disk),
        "rank 0 marker": (0, "every rank finished writing", marker_cannot_be_written),
        "rank 1 bug": (1, "deepspeed file: before", serialization_bug)}[scenario]

    def observe(point: str, path: Path | None) -> None:
        if point == label and "global_step4" in str(path):
            save_points.observer = None
            if rank == failing_rank:
                fail(path)

    save_points.observer = observe
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            code = _launcher_main()(argv)
    except RuntimeError as error:  # not a write failure: the failing rank's own error, the others name it
        code = f"RuntimeError: {error}"
    finally:
        save_points.observer = None
    out = {"code": code, "stderr": stderr.getvalue(), "after": newest_checkpoint(checkpoints)}
    if scenario == "rank 0 marker" and rank == 0:
        (checkpoints / "global_step4" / COMPLETE_MARKER).rmdir()  # what was in the way; the rerun redoes step 4
    torch.distributed.barrier()
    resumed = pretrain(load_config(TINY_RUN_CONFIG, overrides, world_size))
    out["resumed steps"] = sorted(resumed.losses)
    out["step 4 complete"] = is_complete(checkpoints / "global_step4")
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["rank 1 disk full", "rank 0 marker", "rank 1 bug"])
def test_a_save_failing_on_one_rank_stops_every_rank_with_one_message(tiny_corpus, tmp_path, scenario):
    """No rank waits in a collective for a rank whose save failed (before, the others hung until the
    collective timeout): whichever rank fails, in whichever phase of the save, every rank stops, the
    message is printed once and names the rank, and the previous checkpoint is what a rerun resumes."""
    out0, out1 = run_distributed(fail_step_4_on_one_rank, 2, tiny_corpus, tmp_path, scenario, timeout_s=300)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    step4, step2 = checkpoints / "global_step4", checkpoints / "global_step2"
    if scenario == "rank 1 disk full":
        assert out0["code"] == out1["code"] == 1
        assert out0["stderr"].startswith(
            f"lnstrain: rank 1 of 2: cannot save checkpoint {step4}: No space left on device writing "
            f"{step4 / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}. "), out0["stderr"]
        assert "4.0 KiB free of 10.0 GiB. It is full" in out0["stderr"] and "Traceback" not in out0["stderr"]
        assert f"The previous checkpoint {step2} is untouched" in out0["stderr"]
    elif scenario == "rank 0 marker":
        assert out0["code"] == out1["code"] == 1
        assert out0["stderr"].startswith(f"lnstrain: rank 0 of 2: cannot save checkpoint {step4}: Is a directory"
                                         ), out0["stderr"]
    else:
        assert out1["code"] == "RuntimeError: injected: cannot serialise zero_pp_rank_1_mp_rank_00_optim_states.pt"
        assert out0["code"].startswith("RuntimeError: rank 1 failed while saving a checkpoint (RuntimeError: "
                                       "injected"), out0["code"]
    assert "lnstrain:" not in out1["stderr"], out1["stderr"]  # printed once, by rank 0
    for out in (out0, out1):
        assert out["after"] == step2
        assert out["resumed steps"] == [3, 4] and out["step 4 complete"]
