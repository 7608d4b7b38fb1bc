"""tools/evaluate.py as a user meets it: a Hub task without a network ends at once with one line (exit 2,
no traceback, no retries); the shipped local task works from any directory and a successful run prints
its results and lnstrain's lines only; a Hugging Face directory without a tokenizer is refused before
its weights are read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.evaluation.conftest import HAVE_LM_EVAL, NO_LM_EVAL, REPO, TASK, TASKS_DIR
from tests.tool_scripts import load_tool

pytestmark = pytest.mark.skipif(not HAVE_LM_EVAL, reason=NO_LM_EVAL)
EVALUATE = str(REPO / "tools" / "evaluate.py")
NOISE = ("Traceback", "%|", "it/s]", "WARNING", "lm_eval", "lm-eval", "fatal:", "[INFO]", "DeepSpeed", "Retrying")


def fresh_environment(tmp_path, **extra: str) -> dict[str, str]:
    """No Hugging Face cache and none of the offline switches: what a new user has."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_", "TQDM_")) and k not in ("PYTHONPATH",)}
    return env | {"HF_HOME": str(tmp_path / "hf_home"), "WANDB_MODE": "disabled"} | extra


@pytest.mark.slow
@pytest.mark.parametrize("offline", [{"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens on port 9
                                     {"HF_DATASETS_OFFLINE": "1"}], ids=["hub unreachable", "told offline"])
def test_a_hub_task_whose_data_is_not_cached_ends_at_once_with_one_line(tmp_path, tracked_run, offline):
    done = subprocess.run([sys.executable, EVALUATE, "--checkpoint", str(tracked_run.run_dir), "--tasks", "arc_easy",
                           "--output", str(tmp_path / "results.json")], cwd=tmp_path,
                          env=fresh_environment(tmp_path, **offline), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    [line] = done.stderr.splitlines()  # one line: no retries, no traceback, no model loaded first
    assert line.startswith("evaluate: nothing was evaluated: --tasks: the data of arc_easy cannot be loaded ("), line
    why = "127.0.0.1 cannot be reached from here (" if "HF_ENDPOINT" in offline else "HF_DATASETS_OFFLINE is set, "
    assert why in line and "so only the datasets cache" in line and "--include-path" in line, line


@pytest.mark.slow
def test_the_local_task_runs_from_another_directory_and_prints_only_its_results(tmp_path, tracked_run):
    offline = fresh_environment(tmp_path, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, EVALUATE, "--checkpoint", str(tracked_run.run_dir / "checkpoints" /
                                                                        "global_step2"),
                           "--tasks", TASK, "--include-path", str(REPO / TASKS_DIR), "--output", "results.json",
                           "--no-log"], cwd=elsewhere, env=offline, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith(f"{TASK}: acc ") and (elsewhere / "results.json").is_file()
    assert done.stdout.splitlines()[1:] == [f"results: {'results.json'}"]
    assert all(line.startswith("INFO lnstrain.") for line in done.stderr.splitlines()), done.stderr[-3000:]
    assert not any(noise in done.stdout + done.stderr for noise in NOISE), done.stderr[-3000:]


def test_a_hugging_face_directory_without_a_tokenizer_is_refused_before_its_weights_are_read(tmp_path, capsys):
    from lnstrain.testing.tiny_hf_models import save_tiny_model

    model = tmp_path / "model"
    save_tiny_model(model, "llama", ["a few words", "and a few more"])
    for name in os.listdir(model):
        if name.startswith(("tokenizer", "special_tokens")):
            (model / name).unlink()
    (model / "model.safetensors").write_bytes(b"not weights at all")  # reading them would fail otherwise
    capsys.readouterr()  # what saving the model printed
    assert load_tool("evaluate").main(["--hf", str(model), "--tasks", TASK, "--include-path", str(REPO / TASKS_DIR),
                                       "--output", str(tmp_path / "results.json")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"evaluate: nothing was evaluated: {model}: no tokenizer transformers can read")
    assert "tokenizer.save_pretrained" in error and "safetensors" not in error.lower() and "Traceback" not in error
