"""Checkpoints written in the background (``checkpoint.async_save``) keep every guarantee of a
synchronous save.

The background write is held at one of its save points (``save_points.observer``, called on the
writer thread) until training has moved past the snapshot, so every test below sees a write that
really overlaps training: the files must still hold the state of the step saved, bit for bit what a
synchronous save writes; a kill there (the directory copied at that moment: what SIGKILL leaves)
must leave ``latest`` at the previous checkpoint, from which a resume reproduces the uninterrupted
run; the next save, a Ctrl-C's stop (which then prints the resume command) and the end of the run
wait for the write; a write that fails stops every rank with a synchronous save's message.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.async_save import HostSnapshot, SnapshotBuffers
from lnstrain.checkpoint.integrity import read_marker
from lnstrain.checkpoint.locations import newest_checkpoint, read_latest
from lnstrain.checkpoint.metadata import CONFIG_FILE, is_complete, step_of
from lnstrain.checkpoint.signing import read_signing_key
from lnstrain.checkpoint.verifier import Trust, check_step_dir
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED
from tests.checkpoint.tampering import make_key

RUN = ["train.steps=5", "checkpoint.interval_steps=2", "train.eval_interval=0", "model.hidden_dropout=0.1"]
HOLD_TIMEOUT_S = 120.0


def sha256s(step_dir: Path) -> dict[str, str]:
    """Every recorded file's SHA-256 but the config (it names the run directory and async_save)."""
    return {name: record.sha256 for name, record in read_marker(step_dir).files.items() if name != CONFIG_FILE}


@contextlib.contextmanager
def background_write_held(step_name: str, at_hold=None, at_first_file_written=None):
    """Inside the block, the writer thread stops before the first file of ``step_name`` (after calling
    ``at_hold()``) until the main thread waits for that save; ``at_first_file_written()`` is called
    once that file is written. Yields what it saw: the writer thread's name."""
    from lnstrain.checkpoint import save_points
    from lnstrain.checkpoint.async_save import BackgroundWrite

    seen: dict = {}
    waiting = threading.Event()
    wait = BackgroundWrite.wait

    def observe(label: str, path: Path | None) -> None:
        if step_name not in str(path):
            return
        if label == "deepspeed file: before" and "thread" not in seen:
            seen["thread"] = threading.current_thread().name
            if at_hold is not None:
                at_hold()
            waiting.wait(HOLD_TIMEOUT_S)
        elif label == "deepspeed file: written" and "written" not in seen:
            seen["written"] = True
            if at_first_file_written is not None:
                at_first_file_written()

    def wait_releasing_the_hold(self: BackgroundWrite) -> float:
        if self.step_dir.name == step_name:  # not an earlier save's wait (the next save may wait for it)
            waiting.set()
        return wait(self)

    BackgroundWrite.wait = wait_releasing_the_hold
    save_points.observer = observe
    try:
        yield seen
    finally:
        save_points.observer = None
        BackgroundWrite.wait = wait


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def killed_while_training_goes_on(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.estimate.memory import memory_estimate
    from lnstrain.training.trainer import Trainer, pretrain

    signed = f"checkpoint.signing_key_file={root / 'keys' / 'signing.key'}"  # both runs sign their markers

    def config(name: str, *extra: str):
        overrides = tiny_run_overrides(corpus, root / name) + RUN + [signed, *extra]
        return load_config(TINY_RUN_CONFIG, overrides, world_size)

    synchronous = pretrain(config("synchronous", "checkpoint.async_save=false"))
    trainer = Trainer(config("background", "train.eval_tasks=[probe]", "train.eval_tasks_interval=2"))
    checkpoints = root / "background" / "tiny" / "checkpoints"
    at_the_kill: dict = {}
    evaluated: list[dict] = []

    def evaluate(step_dir: str, step: int, tokens: int) -> None:  # what train.eval_tasks would read, and when
        verdict = check_step_dir(Path(step_dir), trainer.checkpoints.trust)
        evaluated.append({"step": step, "verified": verdict.ok and verdict.signature == "signed",
                          "published": step_of(read_latest(checkpoints)) >= step,
                          "steps trained": trainer.engine.global_step})

    trainer.downstream.evaluate = evaluate

    def leave_what_a_kill_leaves() -> None:  # the snapshot was of step 4; training has moved on
        at_the_kill["steps trained"] = trainer.engine.global_step
        shutil.copytree(checkpoints, root / "killed" / "tiny" / "checkpoints")

    messages = Messages()
    logging.getLogger("lnstrain").addHandler(messages)
    logging.getLogger("lnstrain").setLevel(logging.INFO)
    try:  # held until the run has trained step 5 and waits for the write at its last save
        with background_write_held("global_step4", at_first_file_written=leave_what_a_kill_leaves) as seen:
            background = trainer.train()
    finally:
        logging.getLogger("lnstrain").removeHandler(messages)
    killed = root / "killed" / "tiny" / "checkpoints"
    at_the_kill.update(latest=read_latest(killed), resumable=newest_checkpoint(killed),
                       step_4_complete=is_complete(killed / "global_step4"))
    resumed = pretrain(config("killed"))
    estimate = memory_estimate(config("background"), world_size, device="cpu").snapshot
    return {"synchronous": synchronous, "background": background, "resumed": resumed, "at the kill": at_the_kill,
            "writer thread": seen["thread"], "messages": messages.lines, "evaluated": evaluated, "snapshot bytes": (
                trainer.checkpoints.snapshot_host_bytes, estimate)}


def test_a_background_save_writes_what_a_synchronous_one_does_and_a_kill_during_it_loses_nothing(
        tiny_corpus, tmp_path):
    trust = Trust(key=read_signing_key(make_key(tmp_path / "keys" / "signing.key")))
    [out] = run_distributed(killed_while_training_goes_on, 1, tiny_corpus, tmp_path, timeout_s=300)
    synchronous, background, resumed = out["synchronous"], out["background"], out["resumed"]
    assert out["writer thread"] == "lnstrain-save-global_step4"
    assert out["at the kill"]["steps trained"] >= 5  # the snapshot was of step 4; training went on

    # the same losses, and the same bytes in every file of every checkpoint
    assert background.losses == synchronous.losses
    for step in (2, 4, 5):
        written = tmp_path / "background" / "tiny" / "checkpoints" / f"global_step{step}"
        expected = tmp_path / "synchronous" / "tiny" / "checkpoints" / f"global_step{step}"
        assert sha256s(written) == sha256s(expected), step
        verdict = check_step_dir(written, trust)  # the one verifier, as tools/verify_checkpoint.py --key runs it
        assert verdict.ok and verdict.recorded and verdict.signature == "signed", (step, verdict)
    assert any("waited" in line and "global_step4: the run is finished" in line
               for line in out["messages"]), out["messages"]

    # killed while writing step 4: latest still names step 2, and the resume is the uninterrupted run
    killed = tmp_path / "killed" / "tiny" / "checkpoints"
    at_the_kill = out["at the kill"]
    assert at_the_kill["latest"] == at_the_kill["resumable"] == killed / "global_step2"
    assert not at_the_kill["step_4_complete"]
    assert Path(resumed.resumed_from).name == "global_step2" and sorted(resumed.losses) == [3, 4, 5]
    for step, loss in resumed.losses.items():
        assert loss == synchronous.losses[step], step

    # train.eval_tasks (every 2 steps, and the end) read each checkpoint only once it was published:
    # step 4's write was held until the final save waited for it, after step 5 had trained
    assert [(e["step"], e["verified"], e["published"]) for e in out["evaluated"]] == [
        (2, True, True), (4, True, True), (5, True, True)], out["evaluated"]
    assert out["evaluated"][1]["steps trained"] == 5

    held, estimated = out["snapshot bytes"]  # the host memory the dry run states
    assert abs(held - estimated) <= 0.05 * estimated, (held, estimated)


def stopped_by_ctrl_c_during_a_write(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from tests.checkpoint.test_save_errors import _launcher_main

    argv = ["--config", str(TINY_RUN_CONFIG)] + [part for o in tiny_run_overrides(corpus, root) + RUN
                                                 for part in ("--set", o)]
    stdout, stderr = io.StringIO(), io.StringIO()
    # Ctrl-C while step 2's files are being written; the write goes on until the stop waits for it
    with background_write_held("global_step2", at_hold=lambda: os.kill(os.getpid(), signal.SIGINT)), \
            contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):  # the launcher logs to stdout
        code = _launcher_main()(argv)
    return {"code": code, "log": stdout.getvalue(), "stderr": stderr.getvalue()}


def test_ctrl_c_during_a_background_write_waits_for_it_saves_the_stop_and_says_how_to_resume(tiny_corpus, tmp_path):
    """(SIGTERM and SIGUSR1 take the same path: ``StopController``, then a stop that waits.)"""
    [out] = run_distributed(stopped_by_ctrl_c_during_a_write, 1, tiny_corpus, tmp_path, timeout_s=300)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    assert out["code"] == EXIT_STOPPED, out["stderr"][-3000:]
    [line] = [line for line in out["stderr"].splitlines() if line.startswith("lnstrain: stopped to be resumed")]
    stopped_at = int(line.split("after step ")[1].split()[0])
    assert stopped_at >= 3 and "(received SIGINT)" in line and "; to continue, rerun: " in line, line
    assert f"checkpoint {checkpoints / f'global_step{stopped_at}'}" in line, line
    waited = f"for the background write of {checkpoints / 'global_step2'}: the run stops"
    assert waited in out["log"], out["log"][-3000:]
    assert out["log"].index(waited) < out["log"].index(f"saved checkpoint {checkpoints / f'global_step{stopped_at}'}")
    assert is_complete(checkpoints / "global_step2") and is_complete(checkpoints / f"global_step{stopped_at}")
    assert read_latest(checkpoints) == checkpoints / f"global_step{stopped_at}"


def background_write_fails_on_rank_1(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.checkpoint import save_points
    from tests.checkpoint.test_save_errors import _launcher_main

    argv = ["--config", str(TINY_RUN_CONFIG)] + [part for o in tiny_run_overrides(corpus, root) + RUN
                                                 for part in ("--set", o)]
    seen = {}

    def observe(label: str, path: Path | None) -> None:
        if label == "deepspeed file: before" and "global_step2" in str(path) and rank == 1 and not seen:
            seen["thread"] = threading.current_thread().name
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    save_points.observer = observe
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            code = _launcher_main()(argv)
    finally:
        save_points.observer = None
    return {"code": code, "stderr": stderr.getvalue(), "thread": seen.get("thread")}


@pytest.mark.multirank
def test_a_failed_background_write_stops_every_rank_with_the_synchronous_message(tiny_corpus, tmp_path):
    out0, out1 = run_distributed(background_write_fails_on_rank_1, 2, tiny_corpus, tmp_path, timeout_s=300)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    step2 = checkpoints / "global_step2"
    assert out1["thread"] == "lnstrain-save-global_step2"
    assert out0["code"] == out1["code"] == 1
    assert out0["stderr"].startswith(
        f"lnstrain: rank 1 of 2: cannot save checkpoint {step2}: No space left on device writing "
        f"{step2 / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}. "), out0["stderr"]
    assert "There is no earlier checkpoint of this run" in out0["stderr"] and "Traceback" not in out0["stderr"]
    assert "lnstrain:" not in out1["stderr"]  # printed once, by rank 0
    # at a step boundary before the next save (which would wait for the write): step 4 was never begun
    assert not (checkpoints / "global_step4").exists() and read_latest(checkpoints) is None


LAYOUTS = {
    "zero3_data2": ["parallel.zero_stage=3"],
    "pipeline2_bf16": ["parallel.pipeline=2", "precision.dtype=bf16"],
    "tensor2_zero2": ["parallel.tensor=2", "parallel.zero_stage=2"],
}


def saved(rank: int, world_size: int, corpus: TinyCorpus, root: Path, layout: list[str], in_background: bool) -> dict:
    from lnstrain.training.trainer import pretrain

    def config(name: str, *extra: str):
        overrides = tiny_run_overrides(corpus, root / name) + layout + list(extra)
        return load_config(TINY_RUN_CONFIG, overrides + ["train.steps=2", "checkpoint.interval_steps=1",
                                                         "train.eval_interval=0"], world_size)

    name = "background" if in_background else "synchronous"
    out = {"losses": pretrain(config(name, f"checkpoint.async_save={str(in_background).lower()}")).losses}
    if in_background:
        resume = f"checkpoint.resume={root / name / 'tiny' / 'checkpoints' / 'global_step1'}"
        out["resumed"] = pretrain(config("resumed", resume)).losses
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_background_saves_are_bit_identical_and_resume_at_every_layout(tiny_corpus, tmp_path, layout):
    """Each run in processes of its own: DeepSpeed numbers ZeRO 3's partitions (``ds_id``, pickled
    with them) by a counter over every engine a process builds."""
    synchronous = run_distributed(saved, 2, tiny_corpus, tmp_path, LAYOUTS[layout], False, timeout_s=300)
    background = run_distributed(saved, 2, tiny_corpus, tmp_path, LAYOUTS[layout], True, timeout_s=300)
    for step in (1, 2):
        name = f"global_step{step}"
        written = sha256s(tmp_path / "background" / "tiny" / "checkpoints" / name)
        assert written == sha256s(tmp_path / "synchronous" / "tiny" / "checkpoints" / name), (layout, step)
    for expected, out in zip(synchronous, background):
        assert out["losses"] == expected["losses"]
        assert sorted(out["resumed"]) == [2] and out["resumed"][2] == expected["losses"][2], (layout, out, expected)


# --- the snapshot itself (no training) -------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "left right")


class LossScale:
    """A mutable record, as DeepSpeed pickles its loss scaler."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


def digest(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_host_snapshot_is_saved_as_the_original_and_does_not_change_with_it():
    flat = torch.arange(12, dtype=torch.float32)
    module = collections.OrderedDict(a=flat[:6].view(2, 3), b=flat[6:])  # views of one storage
    module._metadata = {"": {"version": 1}}
    shared = torch.ones(3)
    state = {"module": module, "same": [shared, shared], "pair": Pair(shared, 2), "scale": LossScale(8.0),
             "param": torch.nn.Parameter(torch.zeros(2)), "step": 3, "shape": torch.Size([2, 3])}
    buffers = SnapshotBuffers()
    copied = HostSnapshot(buffers).copy(state)
    assert digest(copied) == digest(state)  # the same bytes: storages, views, sharing, attributes
    assert copied["module"]["a"].untyped_storage().data_ptr() == copied["module"]["b"].untyped_storage().data_ptr()
    assert copied["same"][0] is copied["same"][1] is copied["pair"].left
    expected = digest(state)
    flat.add_(1), shared.mul_(5), state["param"].data.add_(2)
    state["scale"].scale = 1.0
    state["module"]["c"] = torch.zeros(1)
    assert digest(copied) == expected  # training changes the originals, not the snapshot
    assert buffers.held_bytes == 12 * 4 + 3 * 4 + 2 * 4

    buffers.give_back()  # written: the next snapshot of the same sizes reuses the buffers
    assert HostSnapshot(buffers).new_bytes({"x": torch.zeros(12), "y": torch.zeros(5)}) == 5 * 4


def test_a_state_dict_whose_snapshot_does_not_fit_is_written_at_once(tmp_path, monkeypatch):
    from lnstrain.checkpoint import async_save
    from lnstrain.checkpoint.save_agreement import HeldFailure

    written = []
    background = async_save.BackgroundWrite(tmp_path, HeldFailure(), SnapshotBuffers())
    write = lambda state_dict, path: written.append((path, state_dict["w"].clone()))  # noqa: E731
    small, large = {"w": torch.ones(4)}, {"w": torch.ones(1000)}
    monkeypatch.setattr(async_save, "host_memory", lambda: (2000 + 100, 2000))  # 2000 bytes once 5% kept free
    background.stage(small, "small.pt", write)
    background.stage(large, "large.pt", write)  # 4000 bytes: written now, on this thread
    assert [path for path, _ in written] == ["large.pt"] and background.foreground_files[0].startswith("large.pt")
    small["w"].fill_(7)  # training goes on
    background.start({}, lambda: None, blocking_seconds=0.0)
    background.wait()
    assert [path for path, _ in written] == ["large.pt", "small.pt"] and torch.equal(written[1][1], torch.ones(4))


def test_async_save_true_is_refused_before_launch_where_it_cannot_be(tiny_corpus, tmp_path, monkeypatch, caplog):
    from lnstrain.estimate import snapshot_memory
    from lnstrain.estimate.memory import memory_estimate
    from lnstrain.estimate.report import dry_run_summary
    from lnstrain.training.preflight import async_save_problems

    def config(*extra: str):
        return load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path) + list(extra), 1)

    assert async_save_problems(config("checkpoint.async_save=true"), 1, 1) == []
    other_engine = config("checkpoint.async_save=true", "deepspeed.checkpoint={writer: {type: python}}")
    [problem] = async_save_problems(other_engine, 1, 1)
    assert problem.startswith("checkpoint.async_save is true but the deepspeed: section selects another DeepSpeed "
                              "checkpoint engine (checkpoint.writer)")
    assert "set checkpoint.async_save: false" in problem

    snapshot = memory_estimate(config(), 1, device="cpu").snapshot
    monkeypatch.setattr(snapshot_memory, "host_memory", lambda: (int(snapshot), 100 * 2**30))  # 5 GiB kept free
    [problem] = async_save_problems(config("checkpoint.async_save=true"), 8, 4)
    assert "the checkpoint snapshots of the 4 rank(s) on this machine need about" in problem, problem
    with caplog.at_level(logging.WARNING):
        assert async_save_problems(config(), 8, 4) == []  # unset: the run goes on, saying saves will block
    assert "checkpoints will block training while they are written" in caplog.text
    assert async_save_problems(config("checkpoint.async_save=false"), 8, 4) == []

    memory = dry_run_summary(config(), 1)["memory_per_rank"]
    assert memory["checkpoint_snapshot_host_bytes"] == memory_estimate(config(), 1).snapshot > 0
    assert memory["checkpoint_async_save"] == "on"
    assert json.dumps(memory)  # the dry run's JSON
