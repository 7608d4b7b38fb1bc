"""Downstream evaluation through lm-evaluation-harness: its accuracy on the repository's local task,
checked against the same scoring written out with transformers alone, for a checkpoint and for its
Hugging Face export; and tools/evaluate.py's results in a JSON, the run's TensorBoard and its W&B run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lnstrain.run_files import TENSORBOARD_DIR, WANDB_DIR, WANDB_RUN_FILE, downstream_file
from tests.evaluation.conftest import HAVE_LM_EVAL, HAVE_WANDB, NO_LM_EVAL, REPO, TASK, TASKS_DIR
from tests.tool_scripts import load_tool

pytestmark = pytest.mark.skipif(not HAVE_LM_EVAL, reason=NO_LM_EVAL)
LOGLIKELIHOOD_TOLERANCE = 1e-4


def task_items() -> list[dict]:
    path = REPO / TASKS_DIR / f"{TASK}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@torch.no_grad()
def reference_scores(hf_dir: Path) -> tuple[float, float, list[list[float]]]:
    """(acc, acc_norm, log-likelihood of each choice of each item), computed with transformers alone.

    A choice is scored as the continuation of its question after one space: its tokens are those the
    tokenizer gives "question choice" beyond the question's own (the question with the tokenizer's own
    leading BOS); its log-likelihood is the sum of the model's log-probabilities of those tokens. acc:
    the highest sum is the answer; acc_norm: the highest sum per character of the choice is.
    """
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, local_files_only=True).float().eval()
    correct, correct_norm, all_scores = 0, 0, []
    for item in task_items():
        context = tokenizer(item["question"])["input_ids"]
        scores = []
        for choice in item["choices"]:
            whole = tokenizer(f"{item['question']} {choice}")["input_ids"]
            assert whole[:len(context)] == context and len(whole) <= model.config.max_position_embeddings
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
            scores.append(sum(float(logprobs[position - 1, whole[position]]) for position in range(len(context), len(whole))))
        all_scores.append(scores)
        correct += max(range(len(scores)), key=lambda i: (scores[i], -i)) == item["answer"]
        per_character = [score / len(choice) for score, choice in zip(scores, item["choices"])]
        correct_norm += max(range(len(scores)), key=lambda i: (per_character[i], -i)) == item["answer"]
    return correct / len(all_scores), correct_norm / len(all_scores), all_scores


def lm_eval_scores(results: dict) -> list[list[float]]:
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [[float(response[0][0]) for response in sample["resps"]] for sample in samples]


def test_accuracy_on_a_checkpoint_and_its_export_matches_transformers(tracked_run, tmp_path, one_thread):
    from lnstrain.evaluation.downstream import DownstreamTasks, evaluate_downstream
    from lnstrain.evaluation.hf_model import load_checkpoint_model, load_hf_directory_model

    step_dir = tracked_run.run_dir / "checkpoints" / "global_step2"
    hf_dir = tmp_path / "hf"
    assert load_tool("convert_to_hf").main(["--checkpoint", str(step_dir), "--output", str(hf_dir), "--dtype", "fp32"]) == 0
    acc, acc_norm, reference = reference_scores(hf_dir)
    assert len({round(score, 2) for scores in reference for score in scores}) > 20  # a wrong token would show
    tasks = DownstreamTasks([TASK], [TASKS_DIR])
    for model in (load_checkpoint_model(step_dir), load_hf_directory_model(hf_dir)):
        results = evaluate_downstream(model, tasks, log_samples=True)
        assert results["metrics"][TASK]["acc"] == acc and results["metrics"][TASK]["acc_norm"] == acc_norm
        for ours, theirs in zip(lm_eval_scores(results), reference, strict=True):
            assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_TOLERANCE)
    assert results["model"]["norm_scheme"] == "lns"  # the export records LNS, folded into the norm gains
    # train.eval_tasks scored the same checkpoint the same way during training
    during_training = json.loads(downstream_file(tracked_run.run_dir, 2).read_text())
    assert during_training["metrics"][TASK] == results["metrics"][TASK]
    assert during_training["model"]["step"] == 2 and during_training["model"]["tokens"] == 2 * 8 * 16


def test_evaluate_tool_writes_json_tensorboard_and_the_runs_wandb_run(tracked_run, tmp_path, one_thread):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    shutil.copytree(tracked_run.run_dir, run_dir)  # the shared run's W&B files stay as training left them
    before = {p.name for p in (run_dir / TENSORBOARD_DIR).iterdir()}
    assert load_tool("evaluate").main(["--checkpoint", str(run_dir / "checkpoints" / "global_step2"),
                                       "--tasks", TASK, "--include-path", TASKS_DIR]) == 0
    results = json.loads(downstream_file(run_dir, 2).read_text())
    assert results["model"]["step"] == 2 and results["tasks"] == [TASK]
    during_training = json.loads(downstream_file(tracked_run.run_dir, 2).read_text())
    assert results["metrics"] == during_training["metrics"]
    [new_events] = [p for p in (run_dir / TENSORBOARD_DIR).iterdir() if p.name not in before]
    events = EventAccumulator(str(new_events)).Reload()
    assert [(e.step, e.value) for e in events.Scalars(f"downstream/{TASK}/acc")] == [
        (2, pytest.approx(results["metrics"][TASK]["acc"]))]
    assert [e.step for e in events.Scalars(f"by_tokens/downstream/{TASK}/acc")] == [2 * 8 * 16]
    if HAVE_WANDB:
        from tests.evaluation.wandb_records import read_offline_runs

        record = json.loads((run_dir / WANDB_RUN_FILE).read_text())
        wandb = read_offline_runs(run_dir / WANDB_DIR, rows=record["next_row"])
        assert wandb.ids == {record["id"]}
        last = wandb.rows[-1]  # a third piece of the same W&B run, at the checkpoint's step
        assert last["step"] == 2 and last[f"downstream/{TASK}/acc_norm"] == results["metrics"][TASK]["acc_norm"]


def test_evaluate_tool_refuses_bad_input_before_loading_anything(tracked_run, tmp_path, capsys, monkeypatch):
    from lm_eval.tasks import TaskManager

    from lnstrain.evaluation import downstream

    local = TaskManager(include_path=[TASKS_DIR], include_defaults=False)  # lm-eval's own index takes seconds
    monkeypatch.setattr(downstream, "task_manager", lambda tasks: local)
    evaluate = load_tool("evaluate").main
    checkpoint = str(tracked_run.run_dir)
    assert evaluate(["--checkpoint", checkpoint, "--tasks", "lnstrain_tiny_gramar", "--include-path", TASKS_DIR]) == 2
    assert f"did you mean {TASK}?" in capsys.readouterr().err
    assert evaluate(["--checkpoint", checkpoint, "--tasks", TASK, "--include-path", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert evaluate(["--hf", str(tmp_path), "--tasks", TASK, "--include-path", TASKS_DIR]) == 2
    assert "--output" in capsys.readouterr().err
    assert evaluate(["--checkpoint", str(tmp_path), "--tasks", TASK, "--include-path", TASKS_DIR]) == 2
    error = capsys.readouterr().err
    assert "evaluate:" in error and "Traceback" not in error
