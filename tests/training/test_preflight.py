"""Bad input is refused before any process group exists: every problem of the config, the machine, the
token files and ``checkpoint.init_from`` in one list, exit 2, no traceback (launch/pretrain.py in
subprocesses, as users run it; the checks themselves in process)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.hf_llama import hf_config
from lnstrain.checkpoint.init_from_checks import init_from_problems
from lnstrain.config.run_config import config_from_dict, load_config
from lnstrain.data import DataConfig, DataSource, IndexedDatasetWriter
from lnstrain.data.file_checks import token_file_problems
from lnstrain.testing.distributed import free_port
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training import preflight
from tests.training.test_launch import LAUNCHER, REPO, launcher_command, launcher_env

STARTED = "starting torch.distributed"  # logged by launch/pretrain.py just before the process group


def run_launcher(command: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=launcher_env(), timeout=240)
    return done.returncode, done.stdout, done.stderr


def assert_refused(returncode: int, stdout: str, stderr: str, count: int) -> list[str]:
    """Exit 2, no traceback, nothing started, and a list of ``count`` problems; returns its lines."""
    assert returncode == 2, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stdout[-3000:] + stderr[-3000:]
    assert STARTED not in stdout
    assert f"{count} problem(s) in {TINY_RUN_CONFIG}; nothing was started:" in stderr, stderr
    return [line[4:] for line in stderr.splitlines() if line.startswith("  - ")]


# --- broken token files, one of each kind ------------------------------------------------------------
def write_tokens(prefix: Path, ids: list[int]) -> Path:
    with IndexedDatasetWriter(str(prefix), "uint16") as writer:
        writer.add_document(ids)
    return prefix


def broken_token_files(corpus: TinyCorpus, directory: Path) -> dict[str, tuple[Path, str]]:
    """kind -> (prefix, what the problem line must say) for a tokenizer of 200 pieces and a model of 256."""
    directory.mkdir(parents=True, exist_ok=True)
    good_bin, good_idx = Path(f"{corpus.prefix}.bin").read_bytes(), Path(f"{corpus.prefix}.idx").read_bytes()

    def pair(name: str, bin_bytes: bytes | None, idx_bytes: bytes) -> Path:
        prefix = directory / name
        if bin_bytes is not None:
            Path(f"{prefix}.bin").write_bytes(bin_bytes)
        Path(f"{prefix}.idx").write_bytes(idx_bytes)
        return prefix

    flipped = bytearray(good_idx)
    flipped[0] ^= 0x20  # one bit of the magic: b"mMIDIDX"
    truncated_bin = pair("truncated_bin", good_bin[:-100], good_idx)
    return {
        "missing .bin": (pair("missing_bin", None, good_idx), f"missing {directory / 'missing_bin'}.bin"),
        "truncated .bin": (truncated_bin, f"{truncated_bin}.bin: {len(good_bin) - 100} bytes, but "
                                          f"{truncated_bin}.idx describes {len(good_bin)} (truncated"),
        "truncated .idx": (pair("truncated_idx", good_bin, good_idx[:-8]),
                           f"{len(good_idx) - 8} bytes, but the header's counts"),
        "flipped header": (pair("flipped_header", good_bin, bytes(flipped)), "bad magic b'mMIDIDX"),
        "id >= model vocab": (write_tokens(directory / "big_ids", [5, 300, 7]),
                              "holds token id 300, outside model.vocab_size (256)"),
        "id >= tokenizer vocab": (write_tokens(directory / "other_tokenizer", [5, 230, 7]),
                                  "holds token id 230, but data.tokenizer has 200 pieces"),
    }


@pytest.fixture(scope="module")
def broken(tiny_corpus, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return broken_token_files(tiny_corpus, tmp_path_factory.mktemp("broken_tokens"))


@pytest.mark.parametrize("kind", ["missing .bin", "truncated .bin", "truncated .idx", "flipped header",
                                  "id >= model vocab", "id >= tokenizer vocab"])
def test_each_kind_of_broken_token_file_is_one_problem_naming_the_key_and_file(broken, tiny_corpus, kind):
    prefix, says = broken[kind]
    data = DataConfig(sources=[DataSource(str(tiny_corpus.prefix)), DataSource(str(prefix))],
                      tokenizer=str(tiny_corpus.tokenizer))
    [problem] = data.file_problems() + token_file_problems(data, model_vocab_size=256, tokenizer_vocab_size=200)
    assert problem.startswith("data.sources[1].prefix: ") and says in problem, problem


def test_every_broken_token_file_and_a_malformed_init_from_record_are_listed_together(broken, tiny_corpus, tmp_path):
    sources = ", ".join(f"{{prefix: '{prefix}'}}" for prefix, _ in broken.values())
    model = load_config(TINY_RUN_CONFIG, validate=False).model
    export = tmp_path / "hf_export"
    export.mkdir()
    record = hf_config(model, "fp32")
    record["lnstrain"]["layer_factors"] = record["lnstrain"]["layer_factors"][:1]  # one factor for two layers
    (export / "config.json").write_text(json.dumps(record))
    (export / "model.safetensors").write_bytes(b"")
    overrides = tiny_run_overrides(tiny_corpus, tmp_path / "runs") + [
        f"data.sources=[{sources}]", f"checkpoint.init_from='{export}'"]
    lines = assert_refused(*run_launcher(launcher_command(overrides)), count=len(broken) + 1)
    for (prefix, says), line in zip(broken.values(), lines):
        assert says in line, (says, line)
    assert lines[-1] == (f"checkpoint.init_from: {export}: config.json's lnstrain.layer_factors has 1 entries for "
                         "2 layers (model.num_layers); or load the weights as they are: "
                         "checkpoint.init_from_unfold_lns: false")


def test_a_misspelt_key_a_wrong_type_an_impossible_layout_and_fp16_on_cpu_are_listed_together(tiny_corpus, tmp_path):
    overrides = tiny_run_overrides(tiny_corpus, tmp_path) + [
        "optim.lrr=1e-3", "train.micro_batch_size=two", "parallel.pipeline=4", "precision.dtype=fp16",
        "precision.fp8=rowwise"]
    on_cpu = not torch.cuda.is_available()
    lines = assert_refused(*run_launcher(launcher_command(overrides)), count=5 + on_cpu)
    assert lines[:5] == [
        "train.micro_batch_size: expected an integer, got 'two'",
        "unknown key 'optim.lrr' (did you mean 'lr'?)",
        "precision.fp8 rowwise needs precision.dtype: bf16 (got fp16): its products return bf16, and fp16's loss "
        "scaling would meet scales of its own; set precision.dtype: bf16, or precision.fp8: none",
        "model.num_layers (2) is smaller than parallel.pipeline (4); every stage needs at least one layer",
        "world size 1 is not divisible by parallel.tensor × parallel.pipeline (1 × 4); launch a multiple of 4 ranks"]
    if on_cpu:
        assert lines[5].startswith("precision.dtype is fp16, which needs a CUDA GPU, and this machine has none")


@pytest.mark.multirank
def test_two_ranks_under_the_deepspeed_launcher_print_the_list_once_and_exit_2(broken, tiny_corpus, tmp_path):
    """Every rank finds the problems before any process group; rank 0 lists them, the launcher stops the rest."""
    prefix, says = broken["truncated .bin"]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               str(LAUNCHER), "--config", str(TINY_RUN_CONFIG)]
    for override in tiny_run_overrides(tiny_corpus, tmp_path) + [f"data.sources=[{{prefix: '{prefix}'}}]",
                                                                  "optim.warmup_stpes=1"]:
        command += ["--set", override]
    returncode, stdout, stderr = run_launcher(command)
    output = stdout + stderr
    assert returncode == 2, output[-3000:]
    assert "Traceback" not in output and STARTED not in output, output[-3000:]
    assert output.count("problem(s) in") == 1, output[-3000:]
    assert "unknown key 'optim.warmup_stpes' (did you mean 'warmup_steps'?)" in output and says in output


def test_a_tokenizer_larger_than_the_vocabulary_is_a_problem_and_a_smaller_one_a_note(tiny_corpus, tmp_path, caplog):
    """More pieces than embedding rows: refused, naming both numbers and the fix; fewer: one info line."""
    def problems(vocab_size: int) -> list[str]:
        overrides = tiny_run_overrides(tiny_corpus, tmp_path) + [f"model.vocab_size={vocab_size}"]
        return preflight.tokenizer_problems(load_config(TINY_RUN_CONFIG, overrides, validate=False))

    with caplog.at_level("INFO", logger="lnstrain.training.preflight"):
        assert problems(200) == [] and not caplog.records  # the tiny tokenizer's 200 pieces exactly
        assert problems(150) == [f"data.tokenizer {tiny_corpus.tokenizer} has 200 pieces but model.vocab_size is 150: "
                                 "the model has no embedding for ids 150..199; set model.vocab_size to 200 "
                                 "(--set model.vocab_size=200) or use a tokenizer of at most 150 pieces"]
        assert not caplog.records
        assert problems(256) == []
    (note,) = caplog.records
    assert note.levelname == "INFO" and note.getMessage().startswith(
        "data.tokenizer has 200 pieces and model.vocab_size is 256: 56 embedding rows will never be used")


def test_ids_of_the_tokenizer_beyond_the_model_vocabulary_name_the_vocabulary_not_another_tokenizer(tiny_corpus,
                                                                                                   tmp_path):
    """The token files hold ids the tokenizer made: the fix is model.vocab_size, and nothing is guessed."""
    from lnstrain.data.file_checks import token_file_problems

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), validate=False)
    [problem] = token_file_problems(config.data, 150, 200)
    assert "a piece of data.tokenizer (200 pieces) but outside model.vocab_size (150): set model.vocab_size to 200" \
        in problem, problem
    assert "another tokenizer" not in problem and "corrupt" not in problem
    [problem] = token_file_problems(config.data, 150, 160)  # beyond both: made by another tokenizer (or damaged)
    assert "outside model.vocab_size (150); the data was tokenized with another tokenizer" in problem


# --- checks that need another machine, in process ---------------------------------------------------
TINY = {"model": {"preset": "tiny"}, "data": {"seq_len": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 10}}


def test_fp16_is_refused_on_a_gpu_deepspeed_does_not_support_it_on_and_ranks_need_a_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla P40")
    monkeypatch.delenv("DS_ALLOW_DEPRECATED_FP16", raising=False)
    fp16 = config_from_dict({**TINY, "precision": {"dtype": "fp16"}})
    [problem] = preflight.device_problems(fp16, local_rank=1)
    assert "from compute capability 7.0, and Tesla P40 is 6.1" in problem and "DS_ALLOW_DEPRECATED_FP16=1" in problem
    monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", "1")
    assert preflight.device_problems(fp16, local_rank=1) == []
    [problem] = preflight.device_problems(config_from_dict(TINY), local_rank=2)
    assert "this is local rank 2 but the machine shows 2 GPU(s)" in problem


@pytest.mark.parametrize("capability,refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_is_refused_on_a_gpu_without_float8_tensor_cores(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    for mode in ("tensorwise", "rowwise"):
        problems = preflight.device_problems(config_from_dict({**TINY, "precision": {"fp8": mode}}), local_rank=0)
        if refused:
            assert problems == [f"precision.fp8 is {mode}, whose float8 matrix products need compute capability 8.9 "
                                f"or newer (Ada, Hopper, Blackwell), and NVIDIA A100-SXM4-80GB is "
                                f"{capability[0]}.{capability[1]}; set precision.fp8: none"]
        else:
            assert problems == []
    assert preflight.device_problems(config_from_dict(TINY), local_rank=0) == []


def test_fp8_runs_on_the_cpu_and_only_with_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert preflight.device_problems(config_from_dict({**TINY, "precision": {"fp8": "tensorwise"}}), 0) == []
    [problem] = config_from_dict({**TINY, "precision": {"dtype": "fp32", "fp8": "tensorwise"}}).precision.validate()
    assert problem.startswith("precision.fp8 tensorwise needs precision.dtype: bf16 (got fp32)")


def test_a_cuda_attention_kernel_is_refused_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("cudnn", "efficient"):
        config = config_from_dict({**TINY, "model": {"preset": "tiny", "attention_backend": backend}})
        [problem] = preflight.device_problems(config, local_rank=0)
        assert f"model.attention_backend is {backend}, a CUDA kernel" in problem and "auto, flash or math" in problem
    for backend in ("auto", "flash", "math"):
        config = config_from_dict({**TINY, "model": {"preset": "tiny", "attention_backend": backend}})
        assert preflight.device_problems(config, local_rank=0) == []


def test_deepspeed_refusals_of_the_derived_json_are_problems():
    from lnstrain.config.deepspeed_json import deepspeed_config_problems

    assert deepspeed_config_problems(config_from_dict(TINY), 2) == []
    typo = config_from_dict({**TINY, "deepspeed": {"zero_optimization": {"reduce_bucket_sise": 5}}})
    [problem] = deepspeed_config_problems(typo, 2)
    assert "deepspeed.zero_optimization.reduce_bucket_sise: Extra inputs are not permitted" in problem
    both = config_from_dict({**TINY, "deepspeed": {"fp16": {"enabled": True}}})  # bf16 is the default dtype
    assert "bfloat16 and fp16 modes cannot be simultaneously enabled" in deepspeed_config_problems(both, 2)[0]


def test_init_from_a_truncated_safetensors_file_or_other_shapes_is_a_problem(tmp_path):
    from safetensors.torch import save_file

    model = config_from_dict(TINY).model
    shaped = tmp_path / "other_shape.safetensors"
    save_file({"embedding.word_embeddings.weight": torch.zeros(3, 3)}, str(shaped))
    [problem] = init_from_problems(str(shaped), model, None)
    assert problem.startswith(f"checkpoint.init_from: ") and str(shaped) in problem and "missing" in problem
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(shaped.read_bytes()[:-10])
    [problem] = init_from_problems(str(truncated), model, None)
    assert f"{truncated} is not a readable safetensors file" in problem
    pickle = tmp_path / "weights.pt"
    pickle.write_bytes(b"\x80\x04K\x01.")  # a bare pickle: not what torch.save writes
    assert "is not a torch.save file" in init_from_problems(str(pickle), model, None)[0]
    shutil.rmtree(tmp_path)


def test_a_checkpoint_directory_without_room_for_one_checkpoint_is_a_problem(monkeypatch, tmp_path):
    from lnstrain.checkpoint import write_errors

    config = config_from_dict({**TINY, "run": {"output_dir": str(tmp_path)}})
    needed = preflight.checkpoint_bytes(config)
    assert needed == 14 * config.model.num_parameters(tensor_parallel=1)  # bf16: weights, master weights, moments
    monkeypatch.setattr(write_errors, "free_space", lambda path: (needed - 1, 100 * needed))
    [problem] = preflight.checkpoint_space_problems(config)
    assert problem.startswith(f"run.output_dir: one checkpoint of this model needs at least "
                              f"{write_errors.human_bytes(needed)}") and str(config.checkpoint_dir) in problem
    monkeypatch.setattr(write_errors, "free_space", lambda path: (needed, 100 * needed))
    assert preflight.checkpoint_space_problems(config) == []


def test_directories_placed_by_an_unreadable_key_are_not_created(tiny_corpus, tmp_path, monkeypatch):
    """run.output_dir: [1] would fall back to the default 'runs' in the working directory: nothing is made there."""
    from lnstrain.config.run_config import read_config

    monkeypatch.chdir(tmp_path)
    data = {**TINY, "data": {"seq_len": 16, "sources": [{"prefix": str(tiny_corpus.prefix)}],
                             "tokenizer": str(tiny_corpus.tokenizer)},
            "model": {"preset": "tiny", "vocab_size": 256}, "precision": {"dtype": "fp32"}, "run": {"output_dir": [1]}}
    assert preflight.run_problems(read_config(data), world_size=1) == ["run.output_dir: expected a string, got [1]"]
    assert list(tmp_path.iterdir()) == []


def test_a_fallback_to_a_checkpoint_of_another_model_is_refused_before_loading(tiny_corpus, tmp_path):
    """The pre-launch check compares the model with the checkpoint ``latest`` names; when that one fails
    verification, the older checkpoint the resume falls back to is compared too (not DeepSpeed's size
    mismatch traceback)."""
    import yaml

    from lnstrain.checkpoint.errors import CheckpointError
    from lnstrain.training.resume import restore_or_start
    from tests.checkpoint.test_manager import fake_checkpoint

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), 1)
    model, train = config.to_dict()["model"], {"steps": 1000, "global_batch_size": 8}
    older = fake_checkpoint(config.checkpoint_dir, 2, config_yaml=yaml.safe_dump(
        {"model": {**model, "hidden_size": 2 * model["hidden_size"]}, "train": train}))
    newer = fake_checkpoint(config.checkpoint_dir, 4, config_yaml=yaml.safe_dump({"model": model, "train": train}))
    assert preflight.resume_problems(config, compare_data=False) == []

    class FallingBack:
        def verified_checkpoint(self, step_dir, fall_back):
            assert step_dir == newer and fall_back
            return older, [f"{newer}/mp_rank_00_model_states.pt: truncated"]

    with pytest.raises(CheckpointError) as refused:
        restore_or_start(config, engine=None, checkpoints=FallingBack())
    assert (f"{newer} failed verification, and the newest older checkpoint that verifies was saved with another "
            f"model:\n  - model.hidden_size is {model['hidden_size']} but the checkpoint {older} has "
            f"{2 * model['hidden_size']}") in str(refused.value)


def test_a_checkpoint_older_than_a_model_key_resumes_and_a_kernel_choice_may_change(tiny_corpus, tmp_path):
    """A checkpoint saved before a model key existed ran with that key's default, so it resumes under
    the default and is refused under any other value; the attention kernel may change on resume."""
    import yaml

    from tests.checkpoint.test_manager import fake_checkpoint

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(tiny_corpus, tmp_path), 1)
    saved = {k: v for k, v in config.to_dict()["model"].items() if k not in ("ffn_multiple_of", "attention_backend")}
    step_dir = fake_checkpoint(config.checkpoint_dir, 2, config_yaml=yaml.safe_dump(
        {"model": saved, "train": {"steps": 1000, "global_batch_size": 8}}))
    assert preflight.model_mismatch_problems(config, step_dir) == []

    config.model.attention_backend = "math"
    assert preflight.model_mismatch_problems(config, step_dir) == []
    config.model.ffn_multiple_of = 64
    assert preflight.model_mismatch_problems(config, step_dir) == [
        f"model.ffn_multiple_of is 64 but the checkpoint {step_dir} has 1; resume with the checkpoint's model, or "
        "start a new run (another run.name, or checkpoint.resume: none)"]


def test_downstream_tasks_and_wandb_that_cannot_run_are_problems(monkeypatch, tmp_path):
    import importlib.util

    config = config_from_dict({**TINY, "run": {"output_dir": str(tmp_path)},
                               "checkpoint": {"interval_steps": 4, "save_at_end": False},
                               "train": {**TINY.get("train", {}), "eval_tasks": ["hellaswag"], "eval_tasks_interval": 6},
                               "logging": {"wandb": {"mode": "offline"}}})
    assert preflight.downstream_problems(config, rank=1) == [
        "train.eval_tasks_interval (6) must be a multiple of checkpoint.interval_steps (4): the tasks are evaluated "
        "on the checkpoints of those steps",
        "train.eval_tasks are evaluated on the final checkpoint: set checkpoint.save_at_end: true"]
    post_ln = config_from_dict({**TINY, "model": {**TINY["model"], "norm_scheme": "post_ln"},
                                "train": {**TINY.get("train", {}), "eval_tasks": ["hellaswag"]}})
    [refused] = preflight.downstream_problems(post_ln, rank=1)
    assert refused.startswith("train.eval_tasks go through the Hugging Face export, which refuses this model")
    finding = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else finding(name, *a))
    assert preflight.wandb_problems(config.logging.wandb) == [
        "logging.wandb.mode is offline but wandb is not installed: pip install wandb (or pip install "
        "'lnstrain[wandb]'), or set logging.wandb.mode: disabled"]


@pytest.mark.slow
def test_a_downstream_task_whose_data_cannot_be_had_offline_is_refused_at_launch(tiny_corpus, tmp_path):
    """Where the Hub does not answer, rank 0 stays offline and loads each task's data before training: a
    task whose data is not cached is one problem line at launch, not lm-eval's retries and a traceback
    at every evaluation, and nothing is created."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (pip install -e '.[test]')")
    env = {k: v for k, v in launcher_env().items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on port 9
    runs = tmp_path / "runs"
    command = launcher_command(tiny_run_overrides(tiny_corpus, runs) + ["train.eval_tasks=[arc_easy]"])
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    [problem] = assert_refused(done.returncode, done.stdout, done.stderr, 1)
    assert problem.startswith("train.eval_tasks: the data of arc_easy cannot be loaded ("), problem
    assert "127.0.0.1 cannot be reached from here (" in problem and "so only the datasets cache" in problem
    assert "Retrying" not in done.stdout + done.stderr and not runs.exists()
