"""A miniature study end to end on CPU: two tiny sizes × Pre-LN/LNS, a few steps each: plan, run, collect."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lnstrain.testing.tiny_corpus import build_tiny_corpus

REPO = Path(__file__).resolve().parents[2]
TINY_SHAPES = {
    "tiny_a": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 64},
    "tiny_b": {"hidden_size": 48, "num_layers": 3, "num_heads": 4, "ffn_hidden_size": 96},
}


def study_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/scaling_study.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_plan_run_collect_end_to_end(tmp_path):
    corpus = build_tiny_corpus(tmp_path / "corpus", vocab_size=200)
    recipe = {"data": {"seq_len": 16, "valid_fraction": 0.1},
              "train": {"global_batch_size": 4, "micro_batch_size": 2, "steps": 3, "eval_interval": 0,
                        "eval_batches": 1},
              "optim": {"name": "adam", "lr": 1e-2, "warmup_steps": 1}, "precision": {"dtype": "fp32"},
              "checkpoint": {"interval_steps": 0}, "logging": {"interval": 1, "tensorboard": True}}
    (tmp_path / "sizes").mkdir()
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    for size, shape in TINY_SHAPES.items():
        model = {**shape, "vocab_size": 200, "max_seq_len": 16, "make_vocab_size_divisible_by": 8}
        (tmp_path / "sizes" / f"{size}.yaml").write_text(yaml.safe_dump({"model": model}))
    study = {"name": "mini", "sizes": list(TINY_SHAPES), "schemes": ["pre_ln", "lns"], "seeds": [7],
             "recipe": "recipe.yaml", "sizes_dir": "sizes", "schemes_dir": str(REPO / "configs/schemes"),
             "data_prefix": str(corpus.prefix), "tokenizer": str(corpus.tokenizer),
             "output_dir": str(tmp_path / "runs"), "cluster": str(REPO / "configs/clusters/local_cpu.yaml"),
             "gpus_per_run": {"default": 1}, "depth": {"data": str(corpus.prefix), "num_samples": 4}}
    study_path = tmp_path / "study.yaml"
    study_path.write_text(yaml.safe_dump(study))

    plan = study_cli("plan", str(study_path))
    assert plan.returncode == 0, plan.stderr
    for run in ("tiny_a_pre_ln_s7", "tiny_a_lns_s7", "tiny_b_pre_ln_s7", "tiny_b_lns_s7"):
        assert f"| {run} |" in plan.stdout and f"{run}: new" in plan.stdout

    launched = study_cli("run", str(study_path))
    assert launched.returncode == 0, launched.stdout + launched.stderr + "".join(
        p.read_text()[-3000:] for p in (tmp_path / "runs").glob("*/launch.log"))
    assert launched.stdout.count(" completed ") == 4
    resolved = yaml.safe_load((tmp_path / "runs/tiny_b_lns_s7/study_config.yaml").read_text())
    assert resolved["model"]["norm_scheme"] == "lns" and resolved["model"]["num_layers"] == 3
    assert resolved["train"]["seed"] == 7 and resolved["model"]["init_seed"] == 7

    again = study_cli("run", str(study_path))  # finished runs are skipped, nothing is retrained
    assert again.returncode == 0 and again.stdout.count(" finished ") == 4

    collected = study_cli("collect", str(study_path))
    assert collected.returncode == 0, collected.stderr
    with open(tmp_path / "runs/_study/results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 and all(r["status"] == "done" for r in rows)
    assert all(0 < float(r["eval_loss"]) < 10 for r in rows)
    assert "| tiny_a |" in (tmp_path / "runs/_study/results.md").read_text()
    # the depth section: each run's final checkpoint analysed, Pre-LN and LNS compared per size
    with open(tmp_path / "runs/_study/depth/claims.csv") as handle:
        claims = list(csv.DictReader(handle))
    assert {(c["size"], c["step"]) for c in claims} == {("tiny_a", "3"), ("tiny_b", "3")}
    assert {c["claim"] for c in claims} >= {"pre_ln_variance_grows", "lns_curbs_variance_growth", "lns_lowers_loss",
                                            "lns_deep_layers_matter_more"}
    assert all(c["holds"] in ("True", "False") for c in claims)
    report = (tmp_path / "runs/_study/depth/compare/tiny_b/step3/report.md").read_text()
    assert "## The paper's claims, checked" in report and "lns_s7" in report and "pre_ln_s7" in report
    assert "`lns_deep_layers_matter_more` | lns |" in collected.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib not installed: the PNG is not checked")
    assert (tmp_path / "runs/_study/scaling.png").stat().st_size > 1000
