"""Resuming never runs code stored in a checkpoint: every file lnstrain or DeepSpeed reads goes through
``weights_only``, a planted payload never runs and the error names the file and the opt-in, and with
the opt-in (``--allow-pickle``) a trusted checkpoint that needs more than the allow-list resumes.

The payload (``tests.checkpoint.tampering.Payload``) creates a marker file when unpickled. It is
planted with its file's record rewritten in the completion marker (an attacker who knows the
format), so that the pickle check, not the checksum, is what stops it, and then loaded through the
manager's loader directly, so that DeepSpeed's own reads are shown to be safe as well.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.checkpoint.tampering import RUN as STOPPED_RUN
from tests.checkpoint.tampering import Payload, plant, rerecord
from tests.training.test_crash_recovery import tensorboard_losses
from tests.training.test_launch import launcher_command, launcher_env

RUN = ["train.eval_interval=0", "checkpoint.interval_steps=2"]
TOLERANCE = 1e-6


def torch_loads_during(action) -> list[tuple[str, object]]:
    """(file name, weights_only) of every ``torch.load`` while ``action()`` runs."""
    calls = []
    original = torch.load

    def recording(f, *args, **kwargs):
        calls.append((Path(str(f)).name, kwargs.get("weights_only")))
        return original(f, *args, **kwargs)

    torch.load = recording
    try:
        action()
    finally:
        torch.load = original
    return calls


def refusal(action) -> str:
    """The ``CheckpointError`` message ``action()`` raises (it must raise one)."""
    try:
        action()
    except CheckpointError as error:
        return str(error)
    raise AssertionError("no CheckpointError")


def tampered_copy(step_dir: Path, target: Path, name: str, value: object) -> Path:
    """A copy of ``step_dir`` under ``target`` with ``value`` planted in file ``name`` (its record rewritten)."""
    copy = target / step_dir.name
    shutil.copytree(step_dir, copy)
    plant(copy / name, value)
    rerecord(copy, name)
    return copy


def every_file_kind(rank: int, world_size: int, corpus: TinyCorpus, root: Path, zero_stage: int) -> dict:
    """Save at step 2, resume recording torch.load calls, then plant a payload in each kind of file."""
    from lnstrain.training.trainer import Trainer, pretrain

    def config(*extra: str):
        overrides = tiny_run_overrides(corpus, root / "run") + RUN + [f"parallel.zero_stage={zero_stage}", *extra]
        return load_config(TINY_RUN_CONFIG, overrides, world_size)

    pretrain(config("train.steps=2"))
    trainer = Trainer(config("train.steps=3"))
    loads = torch_loads_during(trainer.resume)
    step_dir = root / "run" / "tiny" / "checkpoints" / "global_step2"
    marker = root / "payload_ran"
    refusals, copies = {}, {}
    for index, path in enumerate(sorted(p for p in step_dir.rglob("*.pt"))):
        name = path.relative_to(step_dir).as_posix()
        copies[name] = copy = tampered_copy(step_dir, root / f"tampered_{index}", name, Payload(marker))
        verified = refusal(lambda: trainer.checkpoints.verified_checkpoint(copy, fall_back=True))
        loaded = refusal(lambda: trainer.checkpoints.load(trainer.engine, copy))
        refusals[name] = (str(copy / name), verified, loaded)
    if zero_stage == 3:  # the resharding path reads ZeRO-3 files through DeepSpeed's zero_to_fp32
        from lnstrain.checkpoint.layouts import read_full_state

        copy = copies["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        path = copy / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        refusals["zero_to_fp32"] = (str(path), refusal(lambda: read_full_state(copy)), "")
    return {"loads": loads, "refusals": refusals, "payload_ran": marker.exists()}


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_a_payload_in_any_file_never_runs(tiny_corpus, tmp_path, zero_stage):
    [result] = run_distributed(every_file_kind, 1, tiny_corpus, tmp_path, zero_stage, timeout_s=240)
    names = {name for name, _ in result["loads"]}
    expected = ({"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} if zero_stage == 1 else
                {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"})
    assert names == expected | {"rank_00000.pt"}, result["loads"]
    assert all(weights_only is True for _, weights_only in result["loads"]), result["loads"]
    assert set(result["refusals"]) >= {"rng/rank_00000.pt"} | expected
    for name, (path, verified, loaded) in result["refusals"].items():
        if name == "zero_to_fp32":
            assert "builtins.eval" in verified and path in verified, verified
            continue
        assert f"{path}: its pickle names builtins.eval" in verified, verified
        assert path in loaded, loaded
        if name.startswith("rng/"):  # lnstrain's own files are refused whatever the opt-in: none is offered
            assert "the file was altered after its save, and no opt-in loads it" in verified, verified
            assert "--allow-pickle" not in verified + loaded, (verified, loaded)
        else:
            assert "--allow-pickle" in verified and "--allow-pickle" in loaded, (verified, loaded)
    assert not result["payload_ran"]


def pipeline_resume(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import pretrain

    def config(run: str, *extra: str):
        overrides = tiny_run_overrides(corpus, root / run) + RUN + ["parallel.pipeline=2", *extra]
        return load_config(TINY_RUN_CONFIG, overrides, world_size)

    pretrain(config("run", "train.steps=2"))
    loads = torch_loads_during(lambda: pretrain(config("run", "train.steps=3")))
    if rank == 0:  # the stage-2 layer file, which only rank 1 reads
        step_dir = root / "run" / "tiny" / "checkpoints" / "global_step2"
        tampered_copy(step_dir, root / "tampered" / "tiny" / "checkpoints", "layer_02-model_00-model_states.pt",
                      Payload(root / "payload_ran"))
        (root / "tampered" / "tiny" / "checkpoints" / "latest").write_text("global_step2\n")
    torch.distributed.barrier()
    message = refusal(lambda: pretrain(config("tampered", "train.steps=3")))
    return {"loads": loads, "message": message, "payload_ran": (root / "payload_ran").exists()}


@pytest.mark.multirank
def test_pipeline_files_load_safely_on_every_stage(tiny_corpus, tmp_path):
    results = run_distributed(pipeline_resume, 2, tiny_corpus, tmp_path, timeout_s=300)
    layer_files = set()
    for result in results:
        assert result["loads"] and all(weights_only is True for _, weights_only in result["loads"]), result["loads"]
        layer_files |= {name for name, _ in result["loads"] if name.startswith("layer_")}
    assert layer_files == {f"layer_0{i}-model_00-model_states.pt" for i in range(4)}
    tampered = tmp_path / "tampered" / "tiny" / "checkpoints" / "global_step2" / "layer_02-model_00-model_states.pt"
    for result in results:  # both ranks refuse, though only rank 1 would read the file
        assert f"{tampered}: its pickle names builtins.eval" in result["message"], result["message"]
        assert not result["payload_ran"]


@pytest.mark.slow  # two launches of launch/pretrain.py
def test_allow_pickle_resumes_a_trusted_checkpoint_and_nothing_else_does(stopped_run):
    trusted = stopped_run.copy("trusted")
    step_dir = trusted / "tiny" / "checkpoints" / "global_step4"
    plant(step_dir / "mp_rank_00_model_states.pt", argparse.Namespace(note="saved by another DeepSpeed"))
    rerecord(step_dir, "mp_rank_00_model_states.pt")  # a checkpoint written that way, not tampered with

    command = launcher_command(tiny_run_overrides(stopped_run.corpus, trusted) + STOPPED_RUN
                               + ["logging.tensorboard=true"])
    refused = subprocess.run(command, capture_output=True, text=True, env=launcher_env(), timeout=240)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert (f"{step_dir / 'mp_rank_00_model_states.pt'}: its pickle names argparse.Namespace" in refused.stderr
            and "pass --allow-pickle (config: checkpoint.allow_pickle: true)" in refused.stderr), refused.stderr

    resumed = subprocess.run(command + ["--allow-pickle"], capture_output=True, text=True, env=launcher_env(),
                             timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses = tensorboard_losses(trusted / "tiny" / "tensorboard")
    assert sorted(losses) == [5, 6]
    for step in (5, 6):
        assert abs(losses[step] - stopped_run.straight[step]) <= TOLERANCE, (step, losses[step], stopped_run.straight)
