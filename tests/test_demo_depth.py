"""launch/demo_depth.sh with two seeds per scheme, two steps each: its console and report carry the
paper's claims with computed verdicts and the seeds' spread."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_depth_demo_prints_and_reports_the_claim_verdicts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env |= {"DEMO_WORKDIR": str(tmp_path / "work"), "DEPTH_SEEDS": "1 2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "launch" / "demo_depth.sh"), "--set", "train.steps=2",
                           "--set", "train.eval_batches=1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    compare = tmp_path / "work" / "depth_compare"
    runs = json.loads((compare / "depth_analysis.json").read_text())["runs"]
    assert [(r["name"], r["norm_scheme"]) for r in runs] == [("pre_ln_s1", "pre_ln"), ("pre_ln_s2", "pre_ln"),
                                                             ("lns_s1", "lns"), ("lns_s2", "lns")]
    claims = {c["id"]: c for c in json.loads((compare / "depth_analysis.json").read_text())["claims"]}
    matter_more = claims["lns_deep_layers_matter_more"]
    assert matter_more["seeds"] == 2 and len(matter_more["runs"]) == 4 and isinstance(matter_more["holds"], bool)
    assert f"{matter_more['verdict']}" in output.split("the paper's claims")[-1]
    report = (compare / "report.md").read_text()
    assert "## The paper's claims, checked" in report and "| `lns_deep_layers_matter_more` |" in report
    assert "2 seeds" in output and "report: " in output
    expect = " ".join(output.split("== what to expect at this size:")[-1].split())  # paper's claim, study's figure
    assert "makes the deep layers matter more" in expect and "matter LESS than Pre-LN's" in expect
    section = "Where the pruning claim turns: the depth study"
    assert section in expect and f"## {section}" in (REPO / "docs" / "depth_analysis.md").read_text()
    # the two seeds are different runs: different initial weights and data order
    assert runs[0]["baseline"]["loss"] != runs[1]["baseline"]["loss"]
