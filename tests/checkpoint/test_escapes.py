"""Nothing escapes the run directory (issue 41): hard links, legacy pickles, forged markers, positions and
caches an attacker rewrote, problems capped and names escaped. Each test plants one attack in its own
copy of the stopped run (``conftest.stopped_run``: checkpoints at steps 2 and 4, signed) and asserts
the defence. Three attacks are resumed for real (``resumed``, one rank); the others are checked where
the resume, the pre-launch check and the tools decide.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.metadata import COMPLETE_MARKER, CONFIG_FILE, METADATA_FILE
from lnstrain.checkpoint.signing import read_signing_key
from lnstrain.checkpoint.verifier import Trust, check_step_dir
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.checkpoint.tampering import (MODEL_FILE, OPTIMIZER_FILE, RUN, Payload, StoppedRun, checkpoints, copy_run,
                                        edit_metadata, plant, rerecord, run_config, step_dir)
from tests.checkpoint.test_tampering import assert_reproduces, choice, verify_tool
from tests.tool_scripts import TOOLS, load_tool

pytestmark = pytest.mark.slow  # the stopped run, and three resumes in one process (about 30 s in all)

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
ABSURD = 10 ** 12


def rewrite_position(run: Path, **values: int) -> None:
    """Step 4's position rewritten consistently, as an attacker without the key would: in the metadata
    and in the record DeepSpeed keeps of it, both rehashed."""
    edit_metadata(step_dir(run, 4), **values)
    model = step_dir(run, 4) / MODEL_FILE
    state = torch.load(model, map_location="cpu", weights_only=False)
    state["lnstrain_position"].update(values)
    torch.save(state, model)
    rerecord(step_dir(run, 4), MODEL_FILE)


def edit_step_config(run: Path, step: int, change) -> None:
    path = step_dir(run, step) / CONFIG_FILE
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))
    rerecord(step_dir(run, step), CONFIG_FILE)


def victim(directory: Path, name: str) -> Path:
    """A file outside the run that a planted hard link names: it must stay as it is."""
    path = directory / name
    path.write_text("someone else's file\n")
    path.chmod(0o644)
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == "someone else's file\n" and stat.S_IMODE(path.stat().st_mode) == 0o644


def resumes(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    """(1 rank) Resume three attacked copies to the end; what each did, or the refusal it raised."""
    from lnstrain.training.trainer import pretrain

    def resume(run: str):
        try:
            return pretrain(run_config(corpus, root / run, world_size=world_size))
        except CheckpointError as error:
            return str(error)

    return {name: resume(name) for name in ("linked", "beyond", "beyond_its_config")}


@pytest.fixture(scope="module")
def resumed(stopped_run: StoppedRun, tmp_path_factory) -> dict:
    root, outside = stopped_run.root, tmp_path_factory.mktemp("outside")
    linked = copy_run(root, "linked")  # DeepSpeed's helper scripts are hard links to files outside the run
    for script in RECOVERY_SCRIPTS:
        (checkpoints(linked) / script).unlink()
        os.link(victim(outside, script), checkpoints(linked) / script)
    rewrite_position(copy_run(root, "beyond"), consumed_samples=ABSURD)  # consistent, beyond its run
    beyond_its_config = copy_run(root, "beyond_its_config")  # and its step config rewritten to match
    rewrite_position(beyond_its_config, consumed_samples=ABSURD)
    edit_step_config(beyond_its_config, 4, lambda config: config["train"].update(steps=ABSURD))
    [results] = run_distributed(resumes, 1, stopped_run.corpus, root, timeout_s=300)
    return {"outside": outside, **results}


# --- item 1: nothing written through a link --------------------------------------------------------------
def test_deepspeeds_helper_scripts_replace_a_planted_hard_link(resumed, stopped_run):
    import deepspeed

    assert_reproduces(resumed["linked"], stopped_run.straight, step_dir(stopped_run.root / "linked", 4))
    for script in RECOVERY_SCRIPTS:
        assert_untouched(resumed["outside"] / script)  # not written through, not made executable
        written = checkpoints(stopped_run.root / "linked") / script
        status = written.lstat()
        assert status.st_nlink == 1 and status.st_mode & stat.S_IXUSR
        assert written.read_bytes() == (Path(deepspeed.__file__).parent / "utils" / script).read_bytes()


def test_a_run_lock_that_is_not_the_trainers_own_file_is_refused_untouched(stopped_run, tmp_path, monkeypatch):
    from lnstrain.checkpoint.locations import link_problems
    from lnstrain.training.run_lock import DirectoryLock

    run = stopped_run.copy("hard_linked_lock") / "tiny"
    lock = run / ".lnstrain.lock"
    lock.unlink()
    os.link(victim(tmp_path, "precious"), lock)
    message = DirectoryLock(run).acquire()
    assert message == (f"{lock} is a file with 2 names (a hard link), which lnstrain never makes: its other name may "
                       "be outside the run directory, and whoever can write that one changes this file too; copy the "
                       "file (cp without -l) if it is yours; lnstrain's lock file is a regular file of the trainer's "
                       "user with no other name: remove it")
    assert_untouched(tmp_path / "precious")
    assert [problem.split(" is ")[0] for problem in link_problems(run, run / "checkpoints")] == [str(lock)]

    lock.unlink()  # none: created new, and used again by the next trainer
    first = DirectoryLock(run)
    assert first.acquire() is None and lock.lstat().st_nlink == 1
    first.release()
    second = DirectoryLock(run)
    assert second.acquire() is None
    second.release()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    assert "belongs to another user" in DirectoryLock(run).acquire()


def test_a_hard_link_inside_a_checkpoint_is_never_read(stopped_run, tmp_path):
    run = stopped_run.copy("hard_linked_metadata")
    metadata = step_dir(run, 4) / METADATA_FILE
    os.link(metadata, tmp_path / "other_name")  # whoever writes the other name changes what the resume reads
    chosen, skipped = choice(stopped_run, run)
    assert chosen == step_dir(run, 2) and skipped == [f"{metadata}: a file with 2 names (a hard link), which lnstrain "
                                                      "never makes: its other name may be outside the run directory, "
                                                      "and whoever can write that one changes this file too; copy the "
                                                      "file (cp without -l) if it is yours"]


def test_exports_replace_planted_links(stopped_run, tmp_path):
    output = tmp_path / "hf"
    output.mkdir()
    for name in ("config.json", "model-00001-of-00001.safetensors", "tokenizer.model"):
        os.link(victim(tmp_path, name + ".victim"), output / name)
    convert = load_tool("convert_to_hf").main
    assert convert(["--checkpoint", str(stopped_run.root / "run" / "tiny"), "--output", str(output)]) == 0
    for name in ("config.json", "model-00001-of-00001.safetensors", "tokenizer.model"):
        assert_untouched(tmp_path / (name + ".victim"))
        assert (output / name).lstat().st_nlink == 1
    assert json.loads((output / "config.json").read_text())["model_type"] == "llama"


# --- item 2: every pickle is scanned --------------------------------------------------------------------
def legacy_with_payload_in_its_system_information(path: Path, marker: Path) -> None:
    """``path`` saved in torch's legacy format, its third pickle (system information, which every loader
    unpickles before the object) replaced by a payload."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    stream = io.BytesIO(data)
    for _ in range(2):
        pickle.load(stream)
    start = stream.tell()
    pickle.load(stream)
    path.write_bytes(data[:start] + pickle.dumps(Payload(marker), protocol=4) + data[stream.tell():])


def test_legacy_format_pickles_are_scanned_like_zip_ones(stopped_run, tmp_path, capsys):
    marker = tmp_path / "payload_ran"
    clean = stopped_run.copy("legacy_clean")  # what DeepSpeed's checkpoint.serialization: false writes
    state = torch.load(step_dir(clean, 4) / MODEL_FILE, map_location="cpu", weights_only=False)
    torch.save(state, step_dir(clean, 4) / MODEL_FILE, _use_new_zipfile_serialization=False)
    rerecord(step_dir(clean, 4), MODEL_FILE)
    assert check_step_dir(step_dir(clean, 4)).ok

    in_object = stopped_run.copy("legacy_payload")
    torch.save({**state, "extra": Payload(marker)}, step_dir(in_object, 4) / MODEL_FILE,
               _use_new_zipfile_serialization=False)
    rerecord(step_dir(in_object, 4), MODEL_FILE)
    in_system_information = stopped_run.copy("legacy_sys_info")
    legacy_with_payload_in_its_system_information(step_dir(in_system_information, 4) / MODEL_FILE, marker)
    rerecord(step_dir(in_system_information, 4), MODEL_FILE)
    for run, named in [(in_object, "__builtin__.eval"), (in_system_information, "builtins.eval")]:
        code, out = verify_tool(run, capsys=capsys)
        assert code == 2 and f"global_step4  UNSAFE      {step_dir(run, 4) / MODEL_FILE}: its pickle names {named}" in out
        with pytest.raises(CheckpointError, match="loading it could run code"):
            choice(stopped_run, run)
    assert not marker.exists()


def test_a_pickle_the_scan_cannot_follow_is_never_called_safe(stopped_run, tmp_path, capsys):
    """A class named by byte strings (which the unpickler decodes to the str STACK_GLOBAL takes): the
    scan does not follow them, so the file is unsafe, not clean."""
    run = stopped_run.copy("unscannable")
    model = step_dir(run, 4) / MODEL_FILE
    hidden = b"\x80\x04U\x08builtinsU\x04eval\x93U\x06'boom'\x85R."  # SHORT_BINSTRINGs, STACK_GLOBAL, REDUCE
    state = torch.load(model, map_location="cpu", weights_only=False)
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    model.write_bytes(hidden + data[len(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)):])  # as the magic number
    rerecord(step_dir(run, 4), MODEL_FILE)
    code, out = verify_tool(run, capsys=capsys)
    assert code == 2 and "UNSAFE" in out and "its pickles cannot be scanned (a class named by values the scan did " \
                                              "not see pushed (STACK_GLOBAL))" in out, out


# --- item 3: the signature first, sizes before hashes -----------------------------------------------------
@contextlib.contextmanager
def opened(path: Path):
    """The opens of ``path`` (any module, any call) while the body runs, through an audit hook."""
    seen: list[str] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)) \
                and os.fsdecode(args[0]) == str(path):
            seen.append(event)

    sys.addaudithook(hook)  # cannot be removed: it stops watching when the body ends
    try:
        yield seen
    finally:
        watching[0] = False


def test_a_forged_marker_listing_a_huge_file_costs_no_read(stopped_run, capsys):
    run = stopped_run.copy("huge_listed")
    huge = step_dir(run, 4) / "zero_pp_rank_0_mp_rank_00_optim_states_extra.pt"
    with open(huge, "wb") as handle:
        handle.truncate(64 << 30)  # 64 GiB, sparse: nothing is on the disk
    marker = step_dir(run, 4) / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    content["files"][huge.name] = {"size": 64 << 30, "sha256": "0" * 64, "rank": 0}
    marker.write_text(json.dumps(content))  # without the key: its signature no longer verifies
    keyed = Trust(key=read_signing_key(stopped_run.key))
    with opened(huge) as opens:
        verdict = check_step_dir(step_dir(run, 4), keyed)
        code, out = verify_tool(run, "--key", stopped_run.key, capsys=capsys)
    assert verdict.signature == "forged" and not verdict.read and opens == []
    assert code == 1 and "global_step4  UNTRUSTED   FORGED" in out

    content["files"][huge.name]["size"] = 1 << 20  # no key: the size listed is compared before any hash
    marker.write_text(json.dumps(content))
    with opened(huge) as opens:
        assert check_step_dir(step_dir(run, 4)).corrupt == [f"{huge}: {64 << 30} bytes, but its save wrote {1 << 20} "
                                                            "(truncated or overwritten)"]
    assert opens == []
    content["files"][huge.name]["size"] = 64 << 30  # its size right, another file's wrong: still nothing hashed
    marker.write_text(json.dumps(content))
    optimizer = step_dir(run, 4) / OPTIMIZER_FILE
    optimizer.write_bytes(optimizer.read_bytes()[:-1])
    with opened(huge) as opens:
        assert [line.split(":")[0] for line in check_step_dir(step_dir(run, 4)).corrupt] == [str(optimizer)]
    assert opens == []


# --- item 4: no traceback from what an attacker can change ---------------------------------------------------
def test_a_position_beyond_its_run_falls_back_or_stops_with_one_line(resumed, stopped_run, capsys):
    assert_reproduces(resumed["beyond"], stopped_run.straight, step_dir(stopped_run.root / "beyond", 2))
    beyond = stopped_run.copy("beyond_verified")  # the resume saved its step 4 again: the attack, afresh
    rewrite_position(beyond, consumed_samples=ABSURD)
    code, out = verify_tool(beyond, capsys=capsys)
    assert code == 1 and (f"global_step4  CORRUPT     {step_dir(beyond, 4) / METADATA_FILE}: consumed_samples {ABSURD} "
                          "is more than its run's 6 steps of 8 samples hold") in out
    refused = resumed["beyond_its_config"]
    assert isinstance(refused, str) and refused.startswith("cannot resume:\n  - "), refused
    assert (f"{step_dir(stopped_run.root / 'beyond_its_config', 4) / METADATA_FILE} says {ABSURD} samples were "
            f"consumed by step 4; the 2 steps left of 8 samples would read up to sample {ABSURD + 16}, but this run's "
            "data serves 48") in refused


def test_a_step_config_this_lnstrain_cannot_read_is_skipped_by_every_tool(stopped_run, tmp_path, capsys):
    run = stopped_run.copy("unknown_key")
    edit_step_config(run, 4, lambda config: config["train"].update(bogus_key=1))
    code, out = verify_tool(run, capsys=capsys)
    assert code == 1 and f"{step_dir(run, 4) / CONFIG_FILE}: unknown key 'train.bogus_key'" in out
    for tool in ("consolidate_checkpoint", "convert_to_hf"):
        main = load_tool(tool).main
        assert main(["--checkpoint", str(run / "tiny"), "--output", str(tmp_path / tool)]) == 0  # step 2 instead
        assert f"{step_dir(run, 2)}" in capsys.readouterr().out
        assert main(["--checkpoint", str(step_dir(run, 4)), "--output", str(tmp_path / f"{tool}4")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "unknown key 'train.bogus_key'" in err, err


def test_an_edited_sample_index_cache_is_rebuilt_never_trained_on(stopped_run, tmp_path, caplog):
    from lnstrain.data import IndexCache, IndexedDataset
    from lnstrain.data.packed_dataset import build_sample_dataset

    indexed = IndexedDataset(str(stopped_run.corpus.prefix))
    documents = np.arange(len(indexed.sizes))

    def dataset(builds: bool = True):
        cache = IndexCache(str(tmp_path), builds, timeout_s=0.3, poll_s=0.05)
        return build_sample_dataset(indexed, documents, mode="packed", seq_len=16, num_samples=200, seed=3,
                                    cache=cache)

    expected = [dataset().tokens(i) for i in range(200)]
    [shuffle] = tmp_path.glob("*shuffle_idx.npy")
    [sample_idx] = tmp_path.glob("*sample_idx.npy")
    for path, edit, why in [(shuffle, lambda a: np.full_like(a, a[0]), "shuffle_idx serves a sample more than once"),
                            (shuffle, lambda a: a + 10 ** 6, "shuffle_idx names samples that do not exist"),
                            (sample_idx, lambda a: a + 1, "sample_idx names"),
                            (shuffle, lambda a: "not an array", "an array cannot be read")]:
        original = np.load(path)
        edited = edit(original)
        if isinstance(edited, str):
            path.write_text(edited)
        else:
            np.save(path, edited)
        caplog.clear()
        with pytest.raises(TimeoutError):  # a rank that does not build waits for a good one, never uses this
            dataset(builds=False)
        rebuilt = dataset()
        assert f"not using the cached index {tmp_path}" in caplog.text and why in caplog.text, caplog.text
        assert all(np.array_equal(rebuilt.tokens(i), expected[i]) for i in range(200))
        assert np.array_equal(np.load(path), original)


# --- item 5: every launch problem at once, nothing created, lines capped and escaped ------------------------
def launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_launcher", TOOLS.parent / "launch" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused_launch(arguments: list[str]) -> str:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        launcher().main(arguments)
    assert exited.value.code == 2 and "Traceback" not in stderr.getvalue(), stderr.getvalue()
    return stderr.getvalue()


def test_a_config_that_cannot_be_read_hides_no_other_problem_and_nothing_is_created(stopped_run, tmp_path):
    runs = tmp_path / "runs"
    missing = tmp_path / "nowhere" / "tokens"
    overrides = ["noequals", "train.steps=-3", f"data.sources=[{{prefix: {missing}}}]", f"run.output_dir={runs}"]
    for name, text in [("latin1.yaml", TINY_RUN_CONFIG.read_bytes() + "# Grüße\n".encode("latin-1")),
                       ("broken.yaml", b"model: {hidden_size: [1\n")]:
        (tmp_path / name).write_bytes(text)
        err = refused_launch(["--config", str(tmp_path / name)] + [a for o in overrides for a in ("--set", o)])
        assert "4 problem(s)" in err and ("is not UTF-8 text" in err or "invalid YAML" in err), err
        assert "override 'noequals' must look like section.key=value" in err
        assert "train.steps must be >= 1 (got -3)" in err and f"data.sources[0].prefix: missing {missing}.bin" in err
    overrides = tiny_run_overrides(stopped_run.corpus, tmp_path) + RUN + [f"data.sources=[{{prefix: {missing}}}]"]
    err = refused_launch(["--config", str(TINY_RUN_CONFIG)] + [a for o in overrides for a in ("--set", o)])
    assert f"missing {missing}.bin" in err
    assert not (tmp_path / "tiny").exists() and not runs.exists()  # a refused launch leaves no run directory


def test_a_marker_listing_500000_files_is_a_few_lines(stopped_run, capsys):
    run = stopped_run.copy("many_listed")
    marker = step_dir(run, 4) / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    content["files"].update({f"planted/{number:06d}.pt": {"size": 1, "sha256": "0" * 64, "rank": 0}
                             for number in range(500_000)})
    marker.write_text(json.dumps(content))
    code, out = verify_tool(run, capsys=capsys)  # the lines a resume's fall-back logs (Verdict.skip_reasons)
    lines = out.splitlines()
    assert code == 1 and len(lines) == 8 and lines[-1].endswith("auto resumes from global_step2"), out
    assert lines[1] == f"global_step4  CORRUPT     {step_dir(run, 4)}/planted/000000.pt: missing (its save wrote it)"
    assert lines[6].endswith("  ... and 499,995 more files missing or of another size than their save wrote")


def test_names_from_a_run_directory_are_printed_escaped(stopped_run, capsys):
    import fcntl

    from lnstrain.training.run_lock import DirectoryLock

    run = stopped_run.copy("odd_names")
    forged_line = "\n12:00:00 [rank 0] INFO lnstrain.checkpoint: resumed from global_step4\x1b[2J"
    (step_dir(run, 4) / f"planted{forged_line}.pt").write_bytes(b"x")
    code, out = verify_tool(run, capsys=capsys)
    assert code == 1 and "\x1b" not in out and not any(line.startswith("12:00:00") for line in out.splitlines())
    assert "planted\\x0a12:00:00 [rank 0] INFO lnstrain.checkpoint: resumed from global_step4\\x1b[2J.pt: not " \
           "written by its save" in out
    lock = run / "tiny" / ".lnstrain.lock"
    lock.write_text(json.dumps({"pid": 1, "host": f"node{forged_line}", "started": "now"}))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another trainer holds it
        message = DirectoryLock(run / "tiny").acquire()
    assert "\x1b" not in message and "\n" not in message and "PID 1 on node\\x0a12:00:00" in message
