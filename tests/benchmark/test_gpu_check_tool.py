"""tools/gpu_check.py and launch/gpu_check.sh on the CPU: unknown items refused, calls merged, items
whose seconds do not fit recorded as not started, the engine items skipped when the engine step fails,
and the dry run end to end (the core GPU tests in their CPU mode and every first-call benchmark on the
tiny shape) into one JSON and one Markdown table."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lnstrain.benchmark.gpu_plan import call_items
from lnstrain.benchmark.gpu_summary import SCHEMA
from tests.benchmark.test_gpu_summary import full_document
from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_item_is_refused_before_anything_runs(tmp_path, capsys):
    assert load_tool("gpu_check").main(["--only", "core_tests,bench", "--out", str(tmp_path)]) == 2
    assert "unknown item(s) ['bench']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_summarize_merges_the_documents_of_several_calls(tmp_path, capsys):
    first, second = full_document(mfu=0.40), full_document(mfu=0.55)
    del first["items"]["1b_lns_vs_pre_ln"]
    paths = []
    for index, doc in enumerate((first, second)):
        paths.append(tmp_path / f"call{index}.json")
        paths[-1].write_text(json.dumps(doc))
    assert load_tool("gpu_check").main(["--summarize", *map(str, paths), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "gpu_check.json").read_text())
    assert merged["items"]["1b_eager"]["report"]["runners"][0]["throughput"]["mfu"] == 0.55
    assert any(row["source"] == "1b_lns_vs_pre_ln" and row["status"] == "met" for row in merged["summary"])
    assert (tmp_path / "merged" / "gpu_check.md").read_text() in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert load_tool("gpu_check").main(["--summarize", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2


def test_items_whose_seconds_do_not_fit_are_not_started(tmp_path):
    load_tool("gpu_check").main(["--only", "7b_width_2_layers,7b_width_4_layers", "--time-limit-s", "30",
                                 "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("7b_width_2_layers", "7b_width_4_layers"):
        assert doc["items"][name]["status"] == "not started" and "s needed" in doc["items"][name]["note"]
        assert f"--only {name}" in doc["items"][name]["note"]
    assert "Items not done" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_dry_run_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    # The time limit is the subprocess's, not the default 540 s: a loaded machine must not leave items unstarted.
    env = {**os.environ, "LNSTRAIN_WHEEL_INSTALL": "installed", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", "--out", str(out), "--time-limit-s", "880"],
                               cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["schema"] == SCHEMA and doc["dry_run"] is True and doc["calls"] == [1]
    assert list(doc["items"]) == [item.name for item in call_items(1)]  # in the plan's order
    assert all(item["status"] == "done" for item in doc["items"].values()), {n: i["status"] for n, i in doc["items"].items()}
    assert doc["items"]["environment"]["engine_step"]["device_type"] == "cpu"
    tests = doc["items"]["core_tests"]["tests"]
    assert tests["counts"]["passed"] >= 3 and tests["counts"]["failed"] == tests["counts"]["skipped"] == 0
    assert doc["items"]["1b_eager"]["report"]["profile"]["rows"]
    assert doc["items"]["1b_compiled"]["report"]["shape"]["compile"] is True
    statuses = {row["source"]: row["status"] for row in doc["summary"]}
    assert "not measured" not in statuses.values(), doc["summary"]  # every figure was computed
    markdown = (out / "gpu_check.md").read_text()
    assert "DRY RUN" in markdown and markdown in completed.stdout
