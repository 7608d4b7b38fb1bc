"""File records in the completion marker, checking files against them, the fallback to an older
checkpoint and ``tools/verify_checkpoint.py`` (on small hand-made checkpoints; no training)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.integrity import ChecksumWriter, file_record, marker_text, read_marker
from lnstrain.checkpoint.manager import CheckpointManager
from lnstrain.checkpoint.metadata import COMPLETE_MARKER, CONFIG_FILE, METADATA_FILE
from lnstrain.checkpoint.verifier import Trust, check_step_dir
from lnstrain.config.run_config import load_config
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG
from tests.checkpoint.tampering import Payload, overwrite_middle, plant, rerecord, truncate
from tests.checkpoint.test_manager import fake_checkpoint
from tests.tool_scripts import load_tool

STATE = {"weight": torch.arange(40_000, dtype=torch.float32), "large": torch.ones(3 << 20), "step": 3}


@pytest.mark.parametrize("zip_format", [True, False])
def test_hash_while_writing_equals_the_file_on_disk(tmp_path, zip_format):
    path = tmp_path / "state.pt"
    with open(path, "wb") as raw:
        writer = ChecksumWriter(raw)
        torch.save(STATE, writer, _use_new_zipfile_serialization=zip_format)
        writer.close()
    assert writer.record(rank=3) == file_record(path, rank=3)
    assert torch.equal(torch.load(path, weights_only=True)["weight"], STATE["weight"])


def recorded_checkpoint(directory: Path, step: int, ranks: int = 2) -> Path:
    """A complete step directory whose marker records its files: a shard per rank, metadata, config."""
    step_dir = fake_checkpoint(directory, step, data_parallel=ranks, world_size=ranks)
    records = {}
    for rank in range(ranks):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({**STATE, "rank": rank}, step_dir / name)
        records[name] = file_record(step_dir / name, rank)
    records[METADATA_FILE] = file_record(step_dir / METADATA_FILE, 0)
    records[CONFIG_FILE] = file_record(step_dir / CONFIG_FILE, 0)
    (step_dir / COMPLETE_MARKER).write_text(marker_text(step_dir.name, records))
    return step_dir


def test_check_names_each_changed_file(tmp_path):
    step_dir = recorded_checkpoint(tmp_path, 2)
    shard0, shard1 = (step_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    verdict = check_step_dir(step_dir)
    assert verdict.ok and verdict.recorded and verdict.files == 4
    assert verdict.bytes == sum(p.stat().st_size for p in (shard0, shard1, step_dir / METADATA_FILE,
                                                            step_dir / CONFIG_FILE))

    overwrite_middle(shard0)
    assert check_step_dir(step_dir).corrupt == [
        f"{shard0}: its bytes differ from what its save wrote (sha256 {file_record(shard0, 0).sha256[:16]}…, "
        f"recorded {read_marker(step_dir).files[shard0.name].sha256[:16]}…)"]
    truncate(shard1)  # a size that differs is found by listing the directory, before any file is hashed
    size = read_marker(step_dir).files[shard1.name].size
    assert check_step_dir(step_dir).corrupt == [f"{shard1}: {size // 2} bytes, but its save wrote {size} "
                                                "(truncated or overwritten)"]
    shard1.unlink()
    assert check_step_dir(step_dir).corrupt == [f"{shard1}: missing (its save wrote it)"]
    (step_dir / COMPLETE_MARKER).write_text('{"files": {"x": {"size": "many"}}}')
    assert check_step_dir(step_dir).corrupt == [f"{step_dir / COMPLETE_MARKER}: damaged: format None with checksum None "
                                                "is not one this lnstrain reads (formats (2, 3), sha256); nothing it "
                                                "records can be trusted"]


def test_without_checksums_only_sizes_and_pickles_are_checked(tmp_path):
    """checkpoint.verify_checksums: false skips the extra read, and says what it gives up: same-size damage."""
    step_dir = recorded_checkpoint(tmp_path, 2)
    shard0, shard1 = (step_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    overwrite_middle(shard0)
    assert check_step_dir(step_dir, Trust(checksums=False)).ok
    assert [line.split(":")[0] for line in check_step_dir(step_dir).corrupt] == [str(shard0)]
    truncate(shard1)
    assert [line.split(":")[0] for line in check_step_dir(step_dir, Trust(checksums=False)).corrupt] == [str(shard1)]
    torch.save({**STATE, "rank": 1}, shard1)
    plant(shard1, Payload(tmp_path / "payload_ran"))
    rerecord(step_dir, shard1.name)
    assert [line.split(":")[0] for line in check_step_dir(step_dir, Trust(checksums=False)).unsafe] == [str(shard1)]
    assert not (tmp_path / "payload_ran").exists()


def test_each_file_is_checked_once_by_the_rank_that_wrote_it(tmp_path):
    step_dir = recorded_checkpoint(tmp_path, 2)
    for rank in range(2):
        overwrite_middle(step_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    shares = [check_step_dir(step_dir, share=(rank, 2)) for rank in range(2)]
    assert [s.files for s in shares] == [3, 1]  # rank 0 also wrote the metadata and config
    assert [len(s.corrupt) for s in shares] == [1, 1]  # each hashes the files it wrote
    assert "zero_pp_rank_1_" in shares[1].corrupt[0]
    one_rank = check_step_dir(step_dir, share=(0, 1))  # resumed on fewer ranks: rank 0 checks everything
    assert one_rank.files == 4 and len(one_rank.corrupt) == 2
    truncate(step_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shares = [check_step_dir(step_dir, share=(rank, 2)) for rank in range(2)]
    assert [len(s.corrupt) for s in shares] == [1, 1]  # sizes: every rank compares them all, before any hash
    assert "zero_pp_rank_1_" in shares[0].corrupt[0]


def test_a_marker_without_records_is_unverified_but_its_pickles_are_checked(tmp_path):
    step_dir = fake_checkpoint(tmp_path, 2)
    (step_dir / COMPLETE_MARKER).write_text("1712345678.25\n")  # what an lnstrain before checksums wrote
    torch.save(STATE, step_dir / "mp_rank_00_model_states.pt")
    verdict = check_step_dir(step_dir)
    assert verdict.ok and not verdict.recorded and verdict.files == 3
    plant(step_dir / "mp_rank_00_model_states.pt", argparse.Namespace(lr=1.0))
    assert check_step_dir(step_dir).unsafe == [f"{step_dir / 'mp_rank_00_model_states.pt'}: its pickle names "
                                               "argparse.Namespace"]


def manager(tmp_path, *overrides: str) -> CheckpointManager:
    config = load_config(TINY_RUN_CONFIG, [f"checkpoint.dir={tmp_path}", *overrides], validate=False)
    return CheckpointManager(config, (1, 1, 1), "data", "tok")


def test_fallback_to_the_newest_checkpoint_that_verifies(tmp_path):
    step2, step4, step6 = (recorded_checkpoint(tmp_path, s) for s in (2, 4, 6))
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for step_dir in (step4, step6):
        overwrite_middle(step_dir / shard)
    chosen, skipped = manager(tmp_path).verified_checkpoint(step6, fall_back=True)
    assert chosen == step2
    assert [line.split(":")[0] for line in skipped] == [str(step6 / shard), str(step4 / shard)]
    assert manager(tmp_path).verified_checkpoint(step6, fall_back=False) == (None, skipped[:1])
    overwrite_middle(step2 / shard)
    assert manager(tmp_path).verified_checkpoint(step6, fall_back=True)[0] is None


def test_a_file_that_would_run_code_stops_the_resume_and_never_runs(tmp_path):
    step2, step4 = (recorded_checkpoint(tmp_path, s) for s in (2, 4))
    marker = tmp_path / "payload_ran"
    shard = step4 / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plant(shard, Payload(marker))
    chosen, skipped = manager(tmp_path).verified_checkpoint(step4, fall_back=True)
    assert chosen == step2 and "but its save wrote" in skipped[0]  # not its record's size: never read at all
    rerecord(step4, shard.name)  # the attacker also rewrote the file's record
    with pytest.raises(CheckpointError) as refused:
        manager(tmp_path).verified_checkpoint(step4, fall_back=True)  # no silent fallback to step 2
    message = str(refused.value)
    assert f"{shard}: its pickle names builtins.eval" in message and "--allow-pickle" in message
    assert not marker.exists()
    chosen, _ = manager(tmp_path, "checkpoint.allow_pickle=true").verified_checkpoint(step4, fall_back=True)
    assert chosen == step4 and not marker.exists()  # trusted: accepted (the loader unpickles it later)


def run_tool(*argv: str, capsys) -> tuple[int, str]:
    code = load_tool("verify_checkpoint").main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_verify_checkpoint_tool(tmp_path, capsys):
    run_dir = tmp_path / "run"
    step2, step4 = (recorded_checkpoint(run_dir / "checkpoints", s) for s in (2, 4))
    fake_checkpoint(run_dir / "checkpoints", 6, complete=False, latest=False)
    code, out = run_tool(str(run_dir), capsys=capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["global_step2", "OK"] and lines[1].split()[:2] == ["global_step4", "OK"]
    assert lines[2].split()[:2] == ["global_step6", "INCOMPLETE"]
    assert lines[-1] == "latest names global_step4; checkpoint.resume: auto resumes from global_step4"

    overwrite_middle(step4 / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    code, out = run_tool(str(run_dir / "checkpoints"), capsys=capsys)
    assert code == 1
    assert f"global_step4  CORRUPT     {step4 / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'}: its bytes differ" in out
    assert out.splitlines()[-1] == "latest names global_step4; checkpoint.resume: auto resumes from global_step2"

    plant(step2 / "zero_pp_rank_1_mp_rank_00_optim_states.pt", argparse.Namespace(lr=1.0))
    rerecord(step2, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code, out = run_tool(str(step2), capsys=capsys)  # a resume from it stops: exit 2
    assert code == 2 and out.startswith("global_step2  UNSAFE ") and "argparse.Namespace" in out

    code, out = run_tool(str(tmp_path / "elsewhere"), capsys=capsys)
    assert code == 2 and "holds no global_step<N> directories" in out

