"""Every attack on a run directory is contained (issue 28). Each test plants one fault, as the issue
describes it, in its own copy of the stopped run (``conftest.stopped_run``: checkpoints at steps 2
and 4, signed) and asserts the outcome: the run continues from its own newest checkpoint that
verifies, with the uninterrupted run's losses from there, or stops with exit 2 and a message naming
the file; nothing outside the run is read as a checkpoint or written.

Four faults are resumed for real (``attacked``, one rank); the others are checked where the resume
decides (``CheckpointManager.verified_checkpoint``, the pre-launch check, the tools), which is the
same code the resume runs, and the fall-back to step 2 is then the one ``attacked`` trains from.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.manager import CheckpointManager
from lnstrain.checkpoint.metadata import COMPLETE_MARKER, CONFIG_FILE, METADATA_FILE
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TinyCorpus
from tests.checkpoint.tampering import (MODEL_FILE, OPTIMIZER_FILE, TOLERANCE, Payload, StoppedRun, checkpoints,
                                        copy_run, edit_metadata, flip_bit, make_key, overwrite_middle, plant,
                                        rerecord, run_config, step_dir)
from tests.tool_scripts import load_tool

pytestmark = pytest.mark.slow  # one training fixture (with the stopped run it shares, about 20 s)


def attacked_resumes(rank: int, world_size: int, corpus: TinyCorpus, root: Path, key: Path) -> dict:
    """(1 rank) Resume four damaged copies to the end; what each did, or the refusal it raised."""
    from lnstrain.training.trainer import pretrain

    def resume(run: str, *extra: str):
        try:
            return pretrain(run_config(corpus, root / run, *extra, world_size=world_size))
        except CheckpointError as error:
            return str(error)

    return {"flipped": resume("flipped"), "escape": resume("escape", "checkpoint.allow_pickle=true"),
            "forged": resume("forged", f"checkpoint.signing_key_file={key}"), "moved": resume("moved")}


@pytest.fixture(scope="module")
def attacked(stopped_run: StoppedRun) -> dict:
    root = stopped_run.root
    flipped = copy_run(root, "flipped")  # fault 1, with damage a marker taken for the old format would load
    flip_bit(step_dir(flipped, 4) / COMPLETE_MARKER)
    overwrite_middle(step_dir(flipped, 4) / OPTIMIZER_FILE)

    outside = copy_run(root, "outside")  # another run, holding a payload its marker records
    plant(step_dir(outside, 4) / MODEL_FILE, Payload(root / "payload_ran"))
    rerecord(step_dir(outside, 4), MODEL_FILE)
    escape = copy_run(root, "escape")  # faults 2 and 3: latest and a step directory lead there
    (checkpoints(escape) / "latest").write_text(f"{step_dir(outside, 4)}\n")
    os.symlink(step_dir(outside, 4), step_dir(escape, 6))

    forged = copy_run(root, "forged")  # item 3: a file changed and its record rewritten, without the key
    overwrite_middle(step_dir(forged, 4) / OPTIMIZER_FILE)
    rerecord(step_dir(forged, 4), OPTIMIZER_FILE)

    edit_metadata(step_dir(copy_run(root, "moved"), 4), consumed_samples=24)  # fault 8, rehashed (a position its
    # run could have reached: one beyond it is the verifier's, test_escapes.py)
    [results] = run_distributed(attacked_resumes, 1, stopped_run.corpus, root, stopped_run.key, timeout_s=300)
    return results


def assert_reproduces(result, straight: dict[int, float], resumed_from: Path) -> None:
    assert not isinstance(result, str), result
    assert Path(result.resumed_from) == resumed_from
    first = int(resumed_from.name.removeprefix("global_step")) + 1
    assert sorted(result.losses) == list(range(first, 7))
    for step, loss in result.losses.items():
        assert abs(loss - straight[step]) <= TOLERANCE, (step, result.losses, straight)


def verify_tool(run: Path, *argv: str, capsys) -> tuple[int, str]:
    """``tools/verify_checkpoint.py`` on the run directory of the copy ``run``."""
    code = load_tool("verify_checkpoint").main([str(run / "tiny"), *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def manager(stopped_run: StoppedRun, run: Path, *extra: str) -> CheckpointManager:
    return CheckpointManager(run_config(stopped_run.corpus, run, *extra), (1, 1, 1), "data", "tok")


def choice(stopped_run: StoppedRun, run: Path, *extra: str) -> tuple[Path | None, list[str]]:
    """What the resume of ``run`` chooses (``verified_checkpoint`` from what ``latest`` names)."""
    return manager(stopped_run, run, *extra).verified_checkpoint(step_dir(run, 4), fall_back=True)


# --- fault 1: a damaged marker is CORRUPT; the old format only with an opt-in ---------------------------
def test_one_flipped_bit_in_the_marker_makes_it_corrupt_and_the_run_falls_back(attacked, stopped_run, capsys):
    assert_reproduces(attacked["flipped"], stopped_run.straight, step_dir(stopped_run.root / "flipped", 2))
    run = stopped_run.copy("flipped_again")
    flip_bit(step_dir(run, 4) / COMPLETE_MARKER)
    code, out = verify_tool(run, capsys=capsys)
    assert code == 1, out
    assert f"global_step4  CORRUPT     {step_dir(run, 4) / COMPLETE_MARKER}: damaged: it is not the JSON" in out
    assert out.splitlines()[-1] == "latest names global_step4; checkpoint.resume: auto resumes from global_step2"
    (step_dir(run, 4) / COMPLETE_MARKER).write_text("")
    assert "damaged: it is empty" in choice(stopped_run, run)[1][0]


def test_a_pre_checksum_checkpoint_resumes_only_with_the_opt_in(stopped_run, capsys):
    run = stopped_run.copy("legacy")
    for step in (2, 4):
        (step_dir(run, step) / COMPLETE_MARKER).write_text("1712345678.25\n")  # what lnstrain wrote before checksums
    chosen, skipped = choice(stopped_run, run)
    assert chosen is None and len(skipped) == 2
    assert all("written by an lnstrain before checksums" in line and "--allow-unverified" in line for line in skipped)
    assert choice(stopped_run, run, "checkpoint.allow_unverified=true")[0] == step_dir(run, 4)
    code, out = verify_tool(run, capsys=capsys)
    assert code == 2 and "global_step4  UNVERIFIED" in out and out.endswith("auto stops: no checkpoint verifies\n")
    assert verify_tool(run, "--allow-unverified", capsys=capsys)[0] == 0


# --- faults 2 and 3: nothing outside the run is read or written ------------------------------------------
def test_latest_and_links_never_lead_outside_the_run(attacked, stopped_run):
    root = stopped_run.root
    escape, outside = root / "escape", root / "outside"
    assert_reproduces(attacked["escape"], stopped_run.straight, step_dir(escape, 4))
    assert not (root / "payload_ran").exists()  # with allow_pickle, had the other run's file been loaded
    assert (step_dir(outside, 4) / COMPLETE_MARKER).is_file()  # the save of step 6 replaced the link, not its target
    assert not step_dir(escape, 6).is_symlink() and (step_dir(escape, 6) / COMPLETE_MARKER).is_file()
    assert (checkpoints(escape) / "latest").read_text() == "global_step6\n"


@pytest.mark.parametrize("latest", ["absolute", "../../other/tiny/checkpoints/global_step4", "bytes", "link"])
def test_a_latest_that_is_not_a_step_name_of_its_own_directory_is_ignored(stopped_run, latest, capsys):
    from lnstrain.checkpoint.locations import resolve_resume

    run = stopped_run.copy(f"latest_{latest.replace('/', '_').replace('.', '')}")
    path = checkpoints(run) / "latest"
    other = step_dir(stopped_run.root / "run", 2)
    if latest == "absolute":
        path.write_text(f"{other}\n")
    elif latest == "bytes":
        path.write_bytes(os.urandom(40))
    elif latest == "link":
        path.unlink()
        path.symlink_to(other / CONFIG_FILE)
    else:
        path.write_text(latest + "\n")
    assert resolve_resume("auto", checkpoints(run)) == (step_dir(run, 4), [])  # the newest complete one, its own
    code, out = verify_tool(run, capsys=capsys)
    assert code == 0 and out.splitlines()[-1].startswith("latest is damaged (")
    assert out.splitlines()[-1].endswith("checkpoint.resume: auto resumes from global_step4"), out


def test_links_in_a_run_directory_stop_the_launch_and_are_never_written_through(stopped_run, tmp_path):
    from lnstrain.checkpoint.locations import link_problems
    from lnstrain.training.run_lock import DirectoryLock

    run = stopped_run.copy("links") / "tiny"
    precious = tmp_path / "precious"
    precious.write_text("someone else's file\n")
    (run / ".lnstrain.lock").unlink()
    (run / ".lnstrain.lock").symlink_to(precious)
    (run / "checkpoints" / "global_step6").symlink_to(step_dir(stopped_run.root / "run", 4))
    problems = link_problems(run, run / "checkpoints")
    assert [p.split(" is a symbolic link")[0] for p in problems] == [
        str(run / ".lnstrain.lock"), str(run / "checkpoints" / "global_step6")]
    message = DirectoryLock(run).acquire()  # the trainer's own lock, had the pre-launch check been skipped
    assert message.startswith(f"{run / '.lnstrain.lock'} is a symbolic link")
    assert precious.read_text() == "someone else's file\n"


# --- fault 4: metadata and config are verified before they are parsed -------------------------------------
@pytest.mark.parametrize("damaged", [METADATA_FILE, CONFIG_FILE])
def test_damaged_metadata_or_config_falls_back_like_any_other_file(stopped_run, damaged, capsys):
    from lnstrain.training.preflight import resume_problems

    run = stopped_run.copy(f"damaged_{damaged}")
    path = step_dir(run, 4) / damaged
    path.write_bytes(b"\xff\xfe" + os.urandom(path.stat().st_size - 2))  # not UTF-8, not JSON, same size
    chosen, skipped = choice(stopped_run, run)
    assert chosen == step_dir(run, 2) and skipped[0].startswith(f"{path}: its bytes differ")
    config = run_config(stopped_run.corpus, run)
    assert resume_problems(config) == []  # the pre-launch check falls back the same way: no traceback
    code, out = verify_tool(run, capsys=capsys)
    assert code == 1 and out.splitlines()[-1].endswith("auto resumes from global_step2")


# --- fault 5: the export tools verify, refuse with exit 2, take the same opt-ins --------------------------
def test_export_tools_verify_what_they_read(stopped_run, tmp_path, capsys, caplog):
    import torch

    run = stopped_run.copy("exported")
    optimizer = step_dir(run, 4) / OPTIMIZER_FILE
    state = torch.load(optimizer, weights_only=False)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1.0  # one fp32 master value
    torch.save(state, optimizer)
    consolidate = load_tool("consolidate_checkpoint").main
    assert consolidate(["--checkpoint", str(step_dir(run, 4)), "--output", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{step_dir(run, 4)} cannot be used" in err and f"{optimizer}: " in err
    assert not (tmp_path / "a.safetensors").exists()
    assert consolidate(["--checkpoint", str(run / "tiny"), "--output", str(tmp_path / "b.safetensors")]) == 0
    assert f"of {step_dir(run, 2)} to" in capsys.readouterr().out  # the checkpoint a resume would choose

    marker = tmp_path / "payload_ran"
    payload = stopped_run.copy("exported_payload")
    plant(step_dir(payload, 4) / MODEL_FILE, Payload(marker))
    rerecord(step_dir(payload, 4), MODEL_FILE)
    rng_only = stopped_run.copy("exported_rng")  # a file the exports never read
    plant(step_dir(rng_only, 4) / "rng" / "rank_00000.pt", Payload(marker))
    rerecord(step_dir(rng_only, 4), "rng/rank_00000.pt")
    convert = load_tool("convert_to_hf").main
    for tool, source, needs in [(consolidate, payload, "--allow-pickle"), (convert, payload, "--allow-pickle"),
                                (convert, rng_only, "altered")]:
        assert tool(["--checkpoint", str(source / "tiny"), "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "its pickle names builtins.eval" in err and needs in err, err
    analyze = load_tool("analyze_depth").main
    assert analyze(["--checkpoint", str(payload / "tiny"), "--output", str(tmp_path / "depth"), "--no-plots"]) == 2
    assert "pass --allow-pickle" in capsys.readouterr().err
    assert analyze(["--checkpoint", str(payload / "tiny"), "--allow-pickle", "--allow-unverified", "--key",
                    str(stopped_run.key), "--data", str(stopped_run.corpus.prefix), "--num-samples", "8",
                    "--output", str(tmp_path / "depth"), "--no-plots"]) == 0  # the same opt-ins as every tool
    assert f"using {step_dir(payload, 2)}, the newest checkpoint that verifies" in caplog.text  # the key saw the rewrite
    assert "FORGED" in caplog.text
    assert not marker.exists() and not (tmp_path / "out").exists()


# --- fault 6: files the marker does not list are refused before DeepSpeed can find them --------------------
def test_files_not_written_by_the_save_are_refused(stopped_run, capsys):
    run = stopped_run.copy("unlisted")
    extra = step_dir(run, 4) / "mp_rank_01_model_states.pt"
    extra.write_bytes((step_dir(run, 4) / MODEL_FILE).read_bytes())
    chosen, skipped = choice(stopped_run, run)
    assert chosen == step_dir(run, 2)
    assert skipped == [f"{extra}: not written by its save (not in {COMPLETE_MARKER}); DeepSpeed would load it by "
                       "its name"]
    code, out = verify_tool(run, capsys=capsys)
    assert code == 1 and f"global_step4  CORRUPT     {extra}: not written by its save" in out
    rerecord(step_dir(run, 4), extra.name)  # listed too: it still does not fit the saved layout
    assert choice(stopped_run, run)[1] == [
        f"{step_dir(run, 4)}: mp_rank_01_model_states.pt: a model-parallel rank the saved layout (tensor 1 x "
        f"pipeline 1) does not have (according to {METADATA_FILE})"]


def test_layer_files_must_fit_the_saved_layout():
    from lnstrain.checkpoint.deepspeed_files import layout_problems

    pipeline_2 = ["layer_00-model_00-model_states.pt", "layer_03-model_00-model_states.pt", "rng/rank_00000.pt",
                  "rng/rank_00001.pt", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert layout_problems(pipeline_2, 1, 2, 1) == []
    assert layout_problems(pipeline_2 + ["layer_03-model_01-model_states.pt"], 1, 2, 1) == [
        "layer_03-model_01-model_states.pt: a tensor rank the saved layout (tensor 1) does not have",
        "pipeline entry 3 has shards of tensor ranks [0, 1], but the saved layout has tensor ranks 0..0"]


# --- fault 7: token files are checked in full, and again as batches are read -------------------------------
def test_in_place_damage_to_a_token_file_is_caught_before_training(tmp_path):
    from lnstrain.data import IndexedDataset, IndexedDatasetWriter, file_fingerprint, iterate_micro_batches
    from lnstrain.data.file_checks import token_file_problems
    from lnstrain.data.config import DataConfig, DataSource
    from lnstrain.data.token_check import TokenIdError

    prefix = str(tmp_path / "tokens")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for document in np.arange(1 << 18, dtype=np.uint16).reshape(256, -1) % 200:  # 512 KiB
            writer.add_document(document)
    config = DataConfig(sources=[DataSource(prefix)], seq_len=16)
    assert token_file_problems(config, 256, None) == []  # scanned, and cached
    fingerprint, bin_path = file_fingerprint(prefix), prefix + ".bin"
    before = os.stat(bin_path)
    with open(bin_path, "r+b") as handle:  # outside the fingerprint's three sampled 64 KiB regions
        handle.seek(os.path.getsize(bin_path) // 4)
        handle.write(np.array([60000], np.uint16).tobytes())
    os.utime(bin_path, ns=(before.st_atime_ns, before.st_mtime_ns))  # even with its time put back
    assert file_fingerprint(prefix) == fingerprint  # what the pre-launch check used to rely on
    [problem] = token_file_problems(config, 256, None)
    assert problem.startswith(f"data.sources[0].prefix: {bin_path} holds token id 60000, outside model.vocab_size")

    class Samples:  # what reaches the model if the file changes after the launch check
        prefixes = [prefix]
        tokens = IndexedDataset(prefix).token_array()

        def __len__(self):
            return len(self.tokens) // 17

        def __getitem__(self, i):
            return {"tokens": self.tokens[i * 17:i * 17 + 17].astype(np.int64), "loss_mask": np.ones(16, np.float32)}

    with pytest.raises(TokenIdError, match=f"hold token id 60000, outside the model's vocabulary .*{bin_path}"):
        list(iterate_micro_batches(Samples(), 0, 64, 8, 0, 1, vocab_size=256))  # the damage is in sample 3855


# --- fault 8: a config that is not UTF-8, a malformed --set, rehashed metadata -----------------------------
def test_a_config_that_is_not_utf8_and_a_malformed_override_are_problems_not_tracebacks(stopped_run, tmp_path):
    from lnstrain.config.run_config import read_config_file
    from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG
    from tests.tool_scripts import TOOLS

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(TINY_RUN_CONFIG.read_bytes() + "# Grüße\n".encode("latin-1"))
    spec = __import__("importlib.util").util.spec_from_file_location("pretrain_launcher",
                                                                   TOOLS.parent / "launch" / "pretrain.py")
    launcher = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        launcher.main(["--config", str(bad)])
    assert exited.value.code == 2 and f"{bad} is not UTF-8 text (byte" in stderr.getvalue(), stderr.getvalue()
    typed = read_config_file(TINY_RUN_CONFIG, ["noequals", "train.steps=-3", "optim.lr=[1"])
    assert typed.problems[0] == "--set: override 'noequals' must look like section.key=value"
    assert "optim.lr=[1" in typed.problems[1] and typed.value is not None
    assert any("train.steps" in problem for problem in typed.value.validate(1))  # still checked, and reported


def test_rehashed_metadata_that_disagrees_with_the_checkpoint_is_never_used(attacked, stopped_run):
    moved = attacked["moved"]
    assert isinstance(moved, str) and moved.startswith("cannot resume:")
    assert (f"{step_dir(stopped_run.root / 'moved', 4) / METADATA_FILE} says consumed_samples 24, but the "
            "position the same save gave DeepSpeed says 32") in moved
    for name, values, expected in [("data_parallel", {"data_parallel": 2, "world_size": 2},
                                    "optimizer partitions of mp rank 0 cover data ranks [0]"),
                                   ("step", {"step": 2}, "says step 2, but its directory is global_step4"),
                                   ("types", {"consumed_samples": "many"}, "consumed_samples is 'many'")]:
        run = stopped_run.copy(f"metadata_{name}")
        edit_metadata(step_dir(run, 4), **values)
        chosen, skipped = choice(stopped_run, run)
        assert chosen == step_dir(run, 2) and expected in skipped[0], skipped


@pytest.mark.multirank
def test_a_refusal_on_two_ranks_is_printed_once(stopped_run):
    run = stopped_run.copy("two_ranks")
    for step in (2, 4):  # the pre-launch check (sizes) passes; the ranks' verification (hashes) does not
        overwrite_middle(step_dir(run, step) / OPTIMIZER_FILE)
    outputs = run_distributed(launch_main, 2, stopped_run.corpus, run, timeout_s=240)
    assert [code for code, _ in outputs] == [2, 2]
    assert outputs[0][1].count("lnstrain: cannot resume: no checkpoint in") == 1, outputs[0][1]
    assert "cannot resume" not in outputs[1][1] and "Traceback" not in outputs[0][1] + outputs[1][1]


def launch_main(rank: int, world_size: int, corpus: TinyCorpus, run: Path) -> tuple[int, str]:
    """``launch/pretrain.py``'s ``main`` on this rank: (exit status, what it printed to stderr)."""
    import importlib.util

    from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
    from tests.checkpoint.tampering import RUN
    from tests.tool_scripts import TOOLS

    spec = importlib.util.spec_from_file_location("pretrain_launcher", TOOLS.parent / "launch" / "pretrain.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    stderr = io.StringIO()
    arguments = ["--config", str(TINY_RUN_CONFIG)] + [a for o in tiny_run_overrides(corpus, run) + RUN for a in ("--set", o)]
    with contextlib.redirect_stderr(stderr):
        try:
            code = launcher.main(arguments)
        except SystemExit as exited:
            code = exited.code
    return code, stderr.getvalue()


# --- item 3: a signed marker -------------------------------------------------------------------------------
def test_a_forged_checkpoint_is_skipped_by_a_run_holding_the_key(attacked, stopped_run, capsys):
    forged = stopped_run.root / "forged"
    assert_reproduces(attacked["forged"], stopped_run.straight, step_dir(forged, 2))
    run = stopped_run.copy("forged_again")
    overwrite_middle(step_dir(run, 4) / OPTIMIZER_FILE)
    rerecord(step_dir(run, 4), OPTIMIZER_FILE)
    assert choice(stopped_run, run)[0] == step_dir(run, 4)  # checksums alone cannot tell: the record matches
    code, out = verify_tool(run, "--key", stopped_run.key, capsys=capsys)
    assert code == 1
    assert "global_step2  OK          SIGNED    5 files" in out
    assert "global_step4  UNTRUSTED   FORGED    its marker's signature does not vouch for it" in out  # nothing read
    assert "the marker was changed after it was signed" in out
    assert out.splitlines()[-1].endswith("auto resumes from global_step2")


def test_unsigned_or_foreign_checkpoints_are_refused_with_a_key(stopped_run, tmp_path, capsys):
    run = stopped_run.copy("unsigned")
    for step in (2, 4):
        marker = step_dir(run, step) / COMPLETE_MARKER
        marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "signature"}))
    keyed = f"checkpoint.signing_key_file={stopped_run.key}"
    chosen, skipped = choice(stopped_run, run, keyed)
    assert chosen is None and all("UNSIGNED" in line and "--allow-unverified" in line for line in skipped)
    assert choice(stopped_run, run, keyed, "checkpoint.allow_unverified=true")[0] == step_dir(run, 4)
    assert choice(stopped_run, run)[0] == step_dir(run, 4)  # no key: checksums only, as before
    code, out = verify_tool(run, "--key", stopped_run.key, capsys=capsys)
    assert code == 2 and "global_step4  UNTRUSTED   UNSIGNED  " in out

    other_key = make_key(tmp_path / "other.key")
    code, out = verify_tool(stopped_run.root / "run", "--key", other_key, capsys=capsys)  # the stopped run itself
    assert code == 2 and "FORGED" in out and "signed with another key, or forged" in out


def test_a_key_must_be_the_owners_and_kept_outside_the_run(stopped_run, tmp_path):
    from lnstrain.training.preflight import signing_key_problems

    run = stopped_run.copy("key_inside")
    inside = make_key(run / "tiny" / "run.key")
    config = run_config(stopped_run.corpus, run, f"checkpoint.signing_key_file={inside}")
    assert "lies inside" in signing_key_problems(config)[0]
    shared = make_key(tmp_path / "shared.key")
    shared.chmod(0o644)
    config = run_config(stopped_run.corpus, run, f"checkpoint.signing_key_file={shared}")
    assert signing_key_problems(config) == [
        f"checkpoint.signing_key_file {shared} can be read or written by others (mode 644); anyone who reads it "
        f"can forge checkpoints: chmod 600 {shared}"]
    with pytest.raises(CheckpointError, match="fewer than 32"):
        short = tmp_path / "short.key"
        short.write_text("secret")
        short.chmod(0o600)
        manager(stopped_run, run, f"checkpoint.signing_key_file={short}")


def test_a_study_analyses_each_checkpoint_under_its_runs_own_key(stopped_run):
    """A study's depth analysis reads a checkpoint as the run's resume would: with the run's signing
    key a forged checkpoint is refused, which checksums alone cannot tell."""
    from lnstrain.study.depth import analyse_checkpoint, run_trust
    from lnstrain.study.spec import DepthCollection

    run = stopped_run.copy("study_forged")
    overwrite_middle(step_dir(run, 4) / MODEL_FILE)
    rerecord(step_dir(run, 4), MODEL_FILE)
    keyed = run_config(stopped_run.corpus, run, f"checkpoint.signing_key_file={stopped_run.key}")
    depth = DepthCollection(data=str(stopped_run.corpus.prefix), num_samples=4, batch_size=2)
    with pytest.raises(CheckpointError, match="FORGED"):
        analyse_checkpoint(step_dir(run, 4), depth, "lns", run_trust(keyed))
    signed = analyse_checkpoint(step_dir(run, 2), depth, "lns", run_trust(keyed))
    assert signed.num_layers == keyed.model.num_layers and np.isfinite(signed.baseline.loss)
    unkeyed = analyse_checkpoint(step_dir(run, 4), depth, "lns", run_trust(run_config(stopped_run.corpus, run)))
    assert unkeyed.num_layers == signed.num_layers  # without the key, the forged weights are measured
