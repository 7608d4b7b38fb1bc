"""The --dry-run report: contents, the data-file exemption, and every shipped config."""

import json
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.config.loader import ConfigError
from lnstrain.config.run_config import load_config
from lnstrain.estimate.report import dry_run_report, dry_run_summary

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
#: a realistic GPU count per shipped config: one 8-GPU node, 2 nodes for 7B (tensor 2 × pipeline 2, and
#: tensor 2 × context 2 at 32k tokens), 4 nodes for 7B at 128k tokens (tensor 2 × context 8, two replicas)
#: (the depth demo runs one CPU rank: its micro batch is the whole global batch); the first prefix that matches
WORLD_SIZE = {"7b_lns_128k": 32, "7b": 16, "demo_depth": 1, "demo": 2}


def world_size_for(path: Path) -> int:
    return next((size for prefix, size in WORLD_SIZE.items() if path.stem.startswith(prefix)), 8)


def test_7b_report_mentions_every_item():
    config = load_config(CONFIGS / "7b_lns.yaml", validate=False)
    text = dry_run_report(config, world_size=16)
    for item in ("6,738,415,616", "non-embedding", "meta model", "FLOPs per token", "6·N + 12·L·h·s",
                 "6·N + 6·L·h·s", "tokens per step: 131,072", "total steps:     20,000", "total tokens",
                 "held between steps:", "weights ", "optimizer ", "pipeline buffers", "by phase: forward",
                 "<- peak", "ZeRO stage 1", "checkpointing none",
                 "checkpointing full", "Korthikanti", "tensor 2 × pipeline 2 × data 4",
                 '"train_batch_size": 512', '"gradient_accumulation_steps": 32'):
        assert item in text, item
    [selective] = [line for line in text.splitlines() if "checkpointing selective" in line]
    [none] = [line for line in text.splitlines() if "checkpointing none " in line]
    assert none.split("peak")[0].split("activations")[1] == selective.split("peak")[0].split("activations")[1]
    # the same figures as "none" at this precision, and the row says why: nothing but the core's log-sum-exp
    assert "(saves 1.0 MiB: it recomputes only the attention core" in selective and "never stored" in selective


def test_fp8_keeps_the_flops_and_says_mfu_stays_against_the_bf16_peak():
    plain = load_config(CONFIGS / "bench" / "1b_seq2048.yaml", validate=False)
    fp8 = load_config(CONFIGS / "bench" / "1b_seq2048.yaml", ["precision.fp8=rowwise"], validate=False)
    plain_text, fp8_text = dry_run_report(plain, world_size=1), dry_run_report(fp8, world_size=1)
    assert "precision.fp8 rowwise: the same FLOPs in float8 linears; MFU against the dense bf16 peak" in fp8_text
    assert "precision.fp8" not in plain_text
    assert "non-causal (MFU convention): 9,000,529,920" in plain_text and "9,000,529,920" in fp8_text


def test_missing_data_is_a_note_but_config_problems_fail():
    config = load_config(CONFIGS / "130m_lns.yaml", validate=False)
    summary = dry_run_summary(config, 8)
    assert any("data/c4_train_text_document.bin" in note for note in summary["notes"])
    json.dumps(summary)  # JSON-able for other tools
    bad = load_config(CONFIGS / "7b_lns.yaml", ["parallel.tensor=3"], validate=False)
    with pytest.raises(ConfigError) as error:
        dry_run_summary(bad, 16)
    assert "model.num_heads (32) must be divisible by parallel.tensor (3)" in str(error.value)
    assert "world size 16 is not divisible by parallel.tensor × parallel.pipeline (3 × 2)" in str(error.value)


def test_data_file_wording_still_matches_the_data_config():
    """Missing files are problems for a launch and notes (not problems) for a dry run."""
    config = load_config(CONFIGS / "130m_lns.yaml", ["data.tokenizer=absent.model"], validate=False)
    problems = config.validate(8)
    assert any(p.startswith("data.sources[0].prefix: missing ") for p in problems)
    assert any(p.startswith("data.tokenizer: file not found") for p in problems)
    notes = dry_run_summary(config, 8)["notes"]
    assert len([note for note in notes if note.endswith("(ignored by the dry run; needed by the real run)")]) == 2


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_passes_the_dry_run(path):
    config = load_config(path, validate=False)
    assert config.run.name == path.stem
    summary = dry_run_summary(config, world_size_for(path))
    assert summary["memory_per_rank"]["total_bytes"] < 70 * 2**30  # fits an 80 GB GPU with a margin


def test_recipe_composition():
    lns, pre_ln = (load_config(CONFIGS / f"130m_{s}.yaml", validate=False) for s in ("lns", "pre_ln"))
    assert lns.model.norm_scheme.value == "lns" and pre_ln.model.norm_scheme.value == "pre_ln"
    assert lns.replace(model=pre_ln.model, run=pre_ln.run) == pre_ln  # the scheme is the only difference
    assert (lns.data.seq_len, lns.train.global_batch_size, lns.optim.name) == (256, 512, "adam")
    assert (lns.total_steps, lns.warmup_steps, lns.optim.lr, lns.optim.min_lr_ratio) == (20000, 2000, 1e-3, 0.1)
    one_b = load_config(CONFIGS / "1b_lns.yaml", validate=False)
    assert (one_b.total_steps, one_b.warmup_steps, one_b.optim.lr) == (100000, 1000, 5e-4)
    assert not lns.model.scaled_init


@pytest.mark.skipif(not (REPO / "launch" / "pretrain.py").is_file(), reason="launch/pretrain.py not written yet")
def test_pretrain_dry_run_command():
    result = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/7b_lns.yaml", "--dry-run"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "WORLD_SIZE": "16"})
    assert result.returncode == 0, result.stderr
    assert "Memory per rank" in result.stdout and "FLOPs per token" in result.stdout


def test_a_dry_run_stops_on_a_missing_base_file_as_the_docs_say(tmp_path, capsys, monkeypatch):
    """Missing data files are notes (above); a config that cannot be read is not estimated: exit 2."""
    spec = importlib.util.spec_from_file_location("dry_run_pretrain", REPO / "launch" / "pretrain.py")
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    config = tmp_path / "run.yaml"
    config.write_text("base: [missing.yaml]\nmodel: {preset: tiny}\n")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        pretrain.main(["--config", str(config), "--dry-run"])
    assert stopped.value.code == 2
    assert f"config file not found: {tmp_path / 'missing.yaml'}" in capsys.readouterr().err
    documented = " ".join((REPO / "docs" / "training.md").read_text().split())
    assert ("missing data files are noted in the estimate, any other problem with the config (a missing `base:` "
            "file, a bad value) is listed and stops it with exit 2") in documented
