"""tools/gpu_check.py and launch/gpu_check.sh on the CPU: unknown items refused, calls merged, items
whose seconds do not fit recorded as not started, the engine items skipped when the engine step fails,
an item killed at its allowance measured when it had written its whole report and failed when not,
and the dry run end to end (the core GPU tests in their CPU mode and every first-call benchmark on the
tiny shape) into one JSON and one Markdown table."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lnstrain.benchmark.gpu_plan import ITEMS, call_items
from lnstrain.benchmark.gpu_summary import SCHEMA, summary_rows, to_markdown
from lnstrain.benchmark.report import REQUIRED_FIELDS, is_complete
from tests.benchmark.test_gpu_summary import ENGINE, full_document, report, runner
from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_item_is_refused_before_anything_runs(tmp_path, capsys):
    assert load_tool("gpu_check").main(["--only", "core_tests,bench", "--output", str(tmp_path)]) == 2
    assert "unknown item(s) ['bench']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_summarize_merges_the_documents_of_several_calls(tmp_path, capsys):
    first, second = full_document(mfu=0.40), full_document(mfu=0.55)
    del first["items"]["1b_lns_vs_pre_ln"]
    paths = []
    for index, doc in enumerate((first, second)):
        paths.append(tmp_path / f"call{index}.json")
        paths[-1].write_text(json.dumps(doc))
    assert load_tool("gpu_check").main(["--summarize", *map(str, paths), "--output", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "gpu_check.json").read_text())
    assert merged["items"]["1b_eager"]["report"]["runners"][0]["throughput"]["mfu"] == 0.55
    assert any(row["source"] == "1b_lns_vs_pre_ln" and row["status"] == "met" for row in merged["summary"])
    assert (tmp_path / "merged" / "gpu_check.md").read_text() in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert load_tool("gpu_check").main(["--summarize", str(tmp_path / "bad.json"), "--output", str(tmp_path)]) == 2


def test_items_whose_seconds_do_not_fit_are_not_started(tmp_path):
    load_tool("gpu_check").main(["--only", "7b_width_2_layers,7b_width_4_layers", "--time-limit-s", "30",
                                 "--output", str(tmp_path)])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("7b_width_2_layers", "7b_width_4_layers"):
        assert doc["items"][name]["status"] == "not started" and "s needed" in doc["items"][name]["note"]
        assert f"--only {name}" in doc["items"][name]["note"]
    assert "Items not done" in (tmp_path / "gpu_check.md").read_text()


def whole_report(mfu: float) -> dict:
    """A benchmark report with every field ``is_complete`` asks for."""
    doc = report([runner(ENGINE, "engine", "lns", 1.35, mfu)])
    doc["runners"][0].update(cpu_time_s=None, breakdown_s=None, last_loss=10.4)
    doc.update(command="python tools/benchmark.py ...", environment={"device_type": "cuda"},
               protocol={"timed_steps": 5, "requested_steps": 8})
    return doc


def stalled_benchmark(path: Path, report_text: str | None) -> str:
    """A stand-in for tools/benchmark.py: it writes ``report_text`` to its --json path (nothing if None),
    prints its table, and never exits, as a process stuck in its teardown."""
    write = "" if report_text is None else f"Path(sys.argv[sys.argv.index('--json') + 1]).write_text({report_text!r})"
    path.write_text("import sys, time\nfrom pathlib import Path\n" + write + "\n"
                    "print('lnstrain-engine[lns] 1.3475 s/step', flush=True)\ntime.sleep(3600)\n")
    return str(path)


def run_stalled_item(tmp_path: Path, report_text: str | None) -> tuple[dict, dict]:
    """Run the compiled 1B item, with a short allowance, on a benchmark that stalls after its report; (item, document)."""
    tool = load_tool("gpu_check")
    tool.BENCHMARK_TOOL = stalled_benchmark(tmp_path / "stalled_benchmark.py", report_text)
    check = tool.Check(tmp_path / "out", dry_run=False, deadline=time.time() + 120, calls=[1])
    try:
        check.run_item(dataclasses.replace(ITEMS["1b_compiled"], seconds=4), time.time())
    finally:
        check.log.close()
        shutil.rmtree(check.scratch, ignore_errors=True)
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    return doc["items"]["1b_compiled"], doc


@pytest.mark.parametrize("left_share, started", [(0.86, {"1b_compiled"}), (0.84, set())])
def test_a_benchmark_starts_with_85_percent_of_its_seconds_left_and_the_tests_need_all_theirs(tmp_path, left_share,
                                                                                             started):
    """On 2026-11-28 an earlier item's overrun of 6 s kept the last item from starting: a benchmark now
    starts with 85 % of its seconds left (it times fewer steps); a pytest item cut short loses its results."""
    tool = load_tool("gpu_check")
    ran: set[str] = set()
    check = tool.Check(tmp_path / "out", dry_run=False, deadline=time.time() + 3600, calls=[1])
    check.run_benchmark = lambda item, record: ran.add(item.name)
    check.run_tests = lambda item, record: ran.add(item.name)
    try:
        for name in ("1b_compiled", "core_tests"):
            item = ITEMS[name]
            check.deadline = time.time() + item.seconds * left_share
            check.run_item(item, time.time())
    finally:
        check.log.close()
        shutil.rmtree(check.scratch, ignore_errors=True)
    assert ran == started
    assert ITEMS["1b_compiled"].least_seconds == 128 and ITEMS["core_tests"].least_seconds == ITEMS["core_tests"].seconds
    note = check.doc["items"]["core_tests"]["note"]
    assert note.startswith(f"{ITEMS['core_tests'].seconds} s needed, ") and "--only core_tests" in note


def test_an_item_killed_after_writing_its_whole_report_is_measured(tmp_path):
    item, doc = run_stalled_item(tmp_path, json.dumps(whole_report(mfu=0.443)))
    assert item["exit_code"] == 124 and item["status"] == "done"
    assert item["report"] == whole_report(mfu=0.443)
    assert "killed at its allowance (4 s) after writing its whole report" in item["note"]
    assert "during teardown" in item["note"]
    row = next(row for row in summary_rows(doc) if row.source == "1b_compiled")
    assert row.status == "missed" and "MFU 44.3%" in row.measured
    markdown = to_markdown(doc)
    assert "Items not done" not in markdown
    assert f"Items done, with a remark:\n- 1b_compiled: {item['note']}" in markdown


@pytest.mark.slow
@pytest.mark.parametrize("written", ["nothing", "half a report", "a report without its runners"])
def test_an_item_killed_without_a_whole_report_stays_failed(tmp_path, written):
    text = json.dumps(whole_report(mfu=0.443))
    report_text = {"nothing": None, "half a report": text[: len(text) // 2],
                   "a report without its runners": json.dumps({**whole_report(mfu=0.443), "runners": None})}[written]
    item, doc = run_stalled_item(tmp_path, report_text)
    assert item["exit_code"] == 124 and item["status"] == "failed" and item["report"] is None
    assert item["note"] == "" and item["output_tail"].endswith("killed after 4 s (its allowance)")
    row = next(row for row in summary_rows(doc) if row.source == "1b_compiled")
    assert row.status == "not measured" and row.measured == "failed (exit 124): killed after 4 s (its allowance)"
    assert "- 1b_compiled: failed" in to_markdown(doc)


def test_a_report_is_whole_with_every_field_and_every_runners_fields():
    doc = whole_report(mfu=0.5)
    assert is_complete(doc)
    assert not any(is_complete({key: value for key, value in doc.items() if key != field}) for field in REQUIRED_FIELDS)
    assert not is_complete({**doc, "schema": "lnstrain.benchmark/0"})
    assert not is_complete({**doc, "runners": [{"name": ENGINE}]})
    assert not is_complete([doc]) and not is_complete(None)


@pytest.mark.slow
def test_dry_run_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    # The time limit is the subprocess's, not the default 540 s: a loaded machine must not leave items unstarted.
    env = {**os.environ, "LNSTRAIN_WHEEL_INSTALL": "installed", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
    completed = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", "--output", str(out), "--time-limit-s", "880"],
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
    eager, compiled = doc["items"]["1b_eager"], doc["items"]["1b_compiled"]
    assert eager["report"]["profile"]["rows"] and eager["profile"] == eager["report"]["profile"]  # kept on its own too
    assert compiled["report"]["shape"]["compile"] is True and compiled["profile"]["rows"]
    # each item's one engine, as built and with each change left out that the CPU has (LNS's factor; the
    # kernels and the bf16 accumulation are skipped there, with the reason)
    assert [run["norm_scheme"] for run in eager["report"]["runners"]] == ["lns", "pre_ln"]
    assert any("without rotary_kernel skipped" in note for note in eager["report"]["notes"])
    statuses = {row["source"]: row["status"] for row in doc["summary"] if row["source"] in doc["items"]}
    assert "not measured" not in statuses.values(), doc["summary"]  # every figure of the call's items was computed
    assert statuses.keys() >= {"1b_eager", "1b_compiled", "1b_fp8_compiled"}
    markdown = (out / "gpu_check.md").read_text()
    assert "DRY RUN" in markdown and markdown in completed.stdout
