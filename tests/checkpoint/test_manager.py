"""Finding, refusing and pruning checkpoints; RNG files; the data-mismatch check (no DeepSpeed needed)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lnstrain.checkpoint.integrity import file_record, marker_text
from lnstrain.checkpoint.locations import newest_checkpoint, resolve_resume
from lnstrain.checkpoint.manager import apply_retention
from lnstrain.checkpoint.metadata import (COMPLETE_MARKER, CONFIG_FILE, METADATA_FILE, CheckpointMetadata,
                                          load_rng_state, restore_rng_state, save_rng_state)
from lnstrain.config.run_config import load_config
from lnstrain.run_files import LATEST_FILE
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides


SAVED_CONFIG = "model: {}\ntrain: {steps: 1000, global_batch_size: 8}\n"
"""The least a saved config holds: a model (defaults) and the run's length (the verifier checks the position)."""


def fake_checkpoint(directory: Path, step: int, complete: bool = True, latest: bool = True,
                    fingerprint: str | None = "data", tokenizer: str | None = "tok", config_yaml: str = SAVED_CONFIG,
                    **layout) -> Path:
    """A step directory with lnstrain's metadata and config, recorded in its marker (and no model files):
    enough for everything but loading."""
    step_dir = directory / f"global_step{step}"
    step_dir.mkdir(parents=True)
    metadata = dict(step=step, consumed_samples=8 * step, tokens_seen=128 * step, data_fingerprint=fingerprint,
                    tokenizer_checksum=tokenizer, lnstrain_version="0", world_size=1, tensor_parallel=1,
                    pipeline_parallel=1, data_parallel=1, zero_stage=1, precision="fp32") | layout
    (step_dir / METADATA_FILE).write_text(CheckpointMetadata(**metadata).to_json())
    (step_dir / CONFIG_FILE).write_text(config_yaml)
    if complete:
        records = {name: file_record(step_dir / name, 0) for name in (METADATA_FILE, CONFIG_FILE)}
        (step_dir / COMPLETE_MARKER).write_text(marker_text(step_dir.name, records))
    if latest:
        (directory / LATEST_FILE).write_text(step_dir.name + "\n")
    return step_dir


def test_auto_resume_uses_latest_and_skips_a_directory_without_the_marker(tmp_path):
    fake_checkpoint(tmp_path, 2)
    step4 = fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, complete=False, latest=False)  # killed while saving
    assert resolve_resume("auto", tmp_path) == (step4, [])
    (tmp_path / LATEST_FILE).unlink()  # killed between the marker and latest: newest complete one
    assert resolve_resume("auto", tmp_path) == (step4, [])
    (tmp_path / LATEST_FILE).write_text("global_step6\n")  # latest naming a broken directory
    assert newest_checkpoint(tmp_path) == step4


def test_auto_resume_of_a_new_run_starts_fresh(tmp_path):
    assert resolve_resume("auto", tmp_path / "does-not-exist-yet") == (None, [])


def test_explicit_resume_paths(tmp_path):
    step2 = fake_checkpoint(tmp_path / "old", 2)
    broken = fake_checkpoint(tmp_path / "old", 3, complete=False, latest=False)
    assert resolve_resume(str(tmp_path / "old"), tmp_path / "new") == (step2, [])
    assert resolve_resume(str(step2), tmp_path / "new") == (step2, [])
    _, problems = resolve_resume(str(broken), tmp_path / "new")
    assert problems == [f"checkpoint.resume: {broken} is not a complete checkpoint (no {COMPLETE_MARKER}: its "
                        "save was interrupted); pick an older global_step<N> or the checkpoint directory"]
    _, problems = resolve_resume(str(tmp_path / "nowhere"), tmp_path / "new")
    assert problems[0].startswith(f"checkpoint.resume: {tmp_path / 'nowhere'} does not exist")


def test_resume_none_refuses_to_overwrite_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 2)
    _, problems = resolve_resume("none", tmp_path)
    assert problems and "checkpoint.resume is 'none' but" in problems[0] and "global_step2" in problems[0]


def test_retention_never_deletes_latest_newer_or_incomplete_checkpoints(tmp_path):
    incomplete = fake_checkpoint(tmp_path, 1, complete=False, latest=False)
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step, latest=False)
    (tmp_path / LATEST_FILE).write_text("global_step4\n")  # e.g. resumed from 4 explicitly
    assert [p.name for p in apply_retention(tmp_path, keep_last=1)] == ["global_step2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step1", "global_step4", "global_step6"]
    (tmp_path / LATEST_FILE).write_text("global_step6\n")
    assert [p.name for p in apply_retention(tmp_path, keep_last=1)] == ["global_step4"]
    assert incomplete.is_dir() and (tmp_path / "global_step6").is_dir()
    assert apply_retention(tmp_path, keep_last=None) == []


def test_rng_states_round_trip_through_weights_only_files(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_rng_state(tmp_path, rank=5)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(load_rng_state(tmp_path, rank=5))  # load_rng_state uses weights_only=True
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])
    assert load_rng_state(tmp_path, rank=6) is None


def test_data_mismatch_is_an_error_naming_both_fingerprints(tiny_corpus, tmp_path):
    from lnstrain.data import data_fingerprint
    from lnstrain.training.preflight import resume_problems, tokenizer_checksum

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), 1)
    ours, our_tokenizer = data_fingerprint(config.data), tokenizer_checksum(config)
    fake_checkpoint(config.checkpoint_dir, 2, fingerprint="f" * 64, tokenizer=our_tokenizer,
                    config_yaml=config.to_yaml())
    [problem] = resume_problems(config)
    assert f"the checkpoint's data fingerprint is {'f' * 64}, this run's is {ours}" in problem
    assert "set checkpoint.allow_data_mismatch: true to resume anyway" in problem
    config.checkpoint.allow_data_mismatch = True
    assert resume_problems(config) == []


def test_matching_data_resumes(tiny_corpus, tmp_path):
    from lnstrain.data import data_fingerprint
    from lnstrain.training.preflight import resume_problems, tokenizer_checksum

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), 1)
    step_dir = fake_checkpoint(config.checkpoint_dir, 2, fingerprint=data_fingerprint(config.data),
                               tokenizer=tokenizer_checksum(config), config_yaml=config.to_yaml())
    assert resume_problems(config) == []
    config.model.hidden_size = 64  # another model shape
    assert resume_problems(config) == [
        f"model.hidden_size is 64 but the checkpoint {step_dir} has 32; resume with the checkpoint's model, "
        "or start a new run (another run.name, or checkpoint.resume: none)"]
    config.checkpoint.resume = "none"
    assert "already holds checkpoints" in resume_problems(config)[0]


@pytest.mark.parametrize("field", ["step", "consumed_samples"])
def test_metadata_without_a_field_is_refused(tmp_path, field):
    step_dir = fake_checkpoint(tmp_path, 2)
    text = (step_dir / METADATA_FILE).read_text().replace(f'"{field}"', '"renamed"')
    with pytest.raises(ValueError, match=f"missing {field}"):
        CheckpointMetadata.from_json(text, "x")


def test_fsync_tree_skips_files_renamed_away_by_another_rank(tmp_path, monkeypatch):
    from lnstrain.checkpoint import metadata

    (tmp_path / "kept.pt").write_bytes(b"x")
    listing = [(str(tmp_path), [], ["kept.pt", ".lnstrain_metadata.json.tmp-123"])]  # renamed meanwhile
    monkeypatch.setattr(metadata.os, "walk", lambda directory: iter(listing))
    synced = []
    fsync_file = metadata.fsync_file

    def recording_fsync_file(path):
        fsync_file(path)  # raises for the file renamed away: not recorded
        synced.append(Path(path))

    monkeypatch.setattr(metadata, "fsync_file", recording_fsync_file)
    metadata.fsync_tree(tmp_path)
    assert synced == [tmp_path / "kept.pt", tmp_path]  # the file that is there, then its directory
