"""The GPU check's summary on synthetic benchmark reports: every goal read from the right place,
met and missed, the per-layer projection by hand, failures and merges of several calls."""

from __future__ import annotations

import copy

import pytest

from lnstrain.benchmark.gpu_summary import (SCHEMA, layer_projection, lns_ratio, merge_documents, summary_rows,
                                            to_markdown)

PEAK = 989.0


def runner(name: str, kind: str, scheme: str, median_s: float, mfu: float | None = None, tokens: int = 8192,
           flops_per_token: float = 8.8e9) -> dict:
    tflops = flops_per_token * tokens / median_s / 1e12
    return {"name": name, "kind": kind, "norm_scheme": scheme, "step_time_s": {"median": median_s},
            "throughput": {"tokens_per_s": tokens / median_s, "tflops_per_device": tflops,
                           "mfu": tflops / PEAK if mfu is None else mfu}}


def report(runners: list[dict], comparisons: list[dict] | None = None, memory: dict | None = None, num_layers: int = 24,
           tokens: int = 8192, flops_per_token: float = 8.8e9, notes: list[str] | None = None) -> dict:
    return {"schema": "lnstrain.benchmark/1", "runners": runners, "comparisons": comparisons or [],
            "memory": memory, "notes": notes or [], "peak": {"tflops": PEAK},
            "flops": {"per_token_noncausal": flops_per_token},
            "shape": {"tokens_per_step": tokens, "model": {"num_layers": num_layers}}}


def comparison(runner_name: str, reference: str, median: float, low: float, high: float, pairs: int = 30) -> dict:
    return {"runner": runner_name, "reference": reference, "median_ratio": median, "ci95": [low, high], "pairs": pairs}


def bench(report_doc: dict | None, exit_code: int = 0, output_tail: str = "") -> dict:
    return {"command": "python tools/benchmark.py ...", "exit_code": exit_code, "duration_s": 30.0, "allowed_s": 95,
            "report": report_doc, "output_tail": output_tail, "status": "done" if report_doc is not None else "failed"}


def memory(ratio: float, measured: int = 30 * 2**30) -> dict:
    return {"estimated_bytes": int(ratio * measured), "peak_allocated_bytes": measured,
            "peak_reserved_bytes": int(1.08 * measured), "estimate_over_measured": ratio}


ENGINE = "lnstrain-engine[lns]"


def full_document(mfu: float = 0.57, hf_speedup: float = 1.3, lns_ci=(0.996, 1.004), memory_ratio: float = 0.97,
                  fp8_step_s: float = 0.115) -> dict:
    pre_ln = "lnstrain-engine[pre_ln]"
    benchmarks = {
        "1b_eager": bench(report([runner(ENGINE, "engine", "lns", 0.15, mfu)], memory=memory(memory_ratio))),
        "1b_compiled": bench(report([runner(ENGINE, "engine", "lns", 0.14, mfu + 0.03)], memory=memory(0.95))),
        # float8: tokens/s against the compiled bf16 item's (0.14 s a step), MFU against the bf16 peak
        "1b_fp8_compiled": bench(report([runner(ENGINE, "engine", "lns", fp8_step_s)], memory=memory(0.96))),
        "1b_vs_hf_model": bench(report([runner("lnstrain-model[lns]", "model", "lns", 0.15), runner("hf-llama", "hf", "pre_ln", 0.2)],
                                       [comparison("hf-llama", "lnstrain-model[lns]", hf_speedup, hf_speedup - 0.05, hf_speedup + 0.05)])),
        # LNS first: the comparison is Pre-LN / LNS
        "1b_lns_vs_pre_ln": bench(report([runner(ENGINE, "engine", "lns", 0.15), runner(pre_ln, "engine", "pre_ln", 0.15)],
                                         [comparison(pre_ln, ENGINE, 1.0, 1 / lns_ci[1], 1 / lns_ci[0], 60)])),
        "7b_width_2_layers": bench(report([runner(ENGINE, "engine", "lns", 0.10)], num_layers=2, flops_per_token=2.0e9)),
        "7b_width_4_layers": bench(report([runner(ENGINE, "engine", "lns", 0.16)], num_layers=4, flops_per_token=3.0e9)),
        "1b_memory_full": bench(report([runner(ENGINE, "engine", "lns", 0.2)], memory=memory(1.05))),
    }
    tests = {"command": "python -m pytest -m 'gpu and gpu_core' tests/gpu", "exit_code": 0, "duration_s": 95.0,
             "status": "done", "tests": {"counts": {"passed": 7, "failed": 0, "errors": 0, "skipped": 0}, "failures": []}}
    environment = {"status": "done", "duration_s": 41.0, "exit_code": 0, "install": {"status": "installed", "seconds": 12.0},
                   "engine_step": {"device": "NVIDIA H100 80GB HBM3", "seconds": 20.0, "loss": 5.55}}
    return {"schema": SCHEMA, "dry_run": False, "calls": [1], "limit_s": 540,
            "environment": {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0",
                            "deepspeed": "0.19.8"},
            "items": {"environment": environment, "core_tests": tests, **benchmarks}}


def rows_by_source(doc: dict) -> dict[str, list]:
    rows: dict[str, list] = {}
    for row in summary_rows(doc):
        rows.setdefault(row.source, []).append(row)
    return rows


def test_every_goal_met_reads_met():
    rows = rows_by_source(full_document())
    assert [r.status for r in rows["core_tests"]] == ["met"] and [r.status for r in rows["environment"]] == ["met"]
    assert "install installed in 12 s; engine step on NVIDIA H100 80GB HBM3: loss 5.550" in rows["environment"][0].measured
    assert rows["1b_eager"][0].status == "met" and "MFU 57.0%" in rows["1b_eager"][0].measured
    assert [r.status for r in rows["1b_compiled"]] == ["met", "met", "met"]  # MFU, memory, compiled / eager
    fp8 = rows["1b_fp8_compiled"]
    assert [r.figure[:3] for r in fp8] == ["(b)", "(g)", "(c)"] and [r.status for r in fp8] == ["met"] * 3
    assert fp8[0].goal == "MFU >= 55% (against the bf16 peak)"
    assert fp8[1].measured == f"{0.14 / 0.115:.3f}x ({8192 / 0.115:,.0f} against {8192 / 0.14:,.0f} tok/s)"
    assert rows["1b_vs_hf_model"][0].status == "met" and rows["1b_vs_hf_model"][0].measured.startswith("1.300x")
    assert rows["1b_lns_vs_pre_ln"][0].status == "met" and "0.9960-1.0040" in rows["1b_lns_vs_pre_ln"][0].measured
    assert [r.status for r in rows["1b_eager"][1:]] == ["met"]  # memory, checkpointing none
    assert rows["1b_memory_full"][0].status == "met"
    assert rows["7b_width_2_layers, 7b_width_4_layers"][0].status == "info"
    assert "1b_memory_selective" not in rows and "1b_vs_hf_engine" not in rows  # optional, not run: no row
    assert "1b_paper_shape" not in rows and "full_tests" not in rows
    assert "reserved 32.40 GiB" in rows["1b_eager"][1].measured


def test_the_triton_kernels_a_run_used_are_read():
    doc = full_document()
    doc["items"]["1b_eager"]["report"]["triton_kernels"] = {"rotary": True, "swiglu": False}
    measured = rows_by_source(doc)["1b_eager"][0].measured
    assert measured.endswith("; Triton kernels rotary used, swiglu NOT used")
    assert "Triton" not in rows_by_source(full_document())["1b_eager"][0].measured  # older reports: no such key
    doc["items"]["environment"]["engine_step"]["triton_kernels"] = {"rotary": True, "swiglu": True}
    assert "loss 5.550; Triton kernels rotary used, swiglu used;" in rows_by_source(doc)["environment"][0].measured


@pytest.mark.parametrize("change, source, index", [
    (dict(mfu=0.53), "1b_eager", 0),
    (dict(fp8_step_s=0.125), "1b_fp8_compiled", 1),  # 1.12x: short of 1.15x
    (dict(hf_speedup=1.1), "1b_vs_hf_model", 0),
    (dict(lns_ci=(0.985, 1.004)), "1b_lns_vs_pre_ln", 0),
    (dict(lns_ci=(0.995, 1.012)), "1b_lns_vs_pre_ln", 0),
    (dict(memory_ratio=0.85), "1b_eager", 1),
    (dict(memory_ratio=1.15), "1b_eager", 1),
])
def test_each_goal_can_be_missed(change, source, index):
    assert rows_by_source(full_document(**change))[source][index].status == "missed"


def test_lns_ratio_is_read_in_either_order():
    lns_first = report([runner(ENGINE, "engine", "lns", 0.15), runner("p", "engine", "pre_ln", 0.15)],
                       [comparison("p", ENGINE, 1.25, 1.0, 2.0)])
    median, ci, pairs = lns_ratio(lns_first)
    assert median == pytest.approx(0.8) and ci == pytest.approx((0.5, 1.0)) and pairs == 30
    pre_ln_first = report([runner("p", "engine", "pre_ln", 0.15), runner(ENGINE, "engine", "lns", 0.15)],
                          [comparison(ENGINE, "p", 1.002, 0.999, 1.005)])
    assert lns_ratio(pre_ln_first) == (1.002, (0.999, 1.005), 30)
    assert lns_ratio(report([runner(ENGINE, "engine", "lns", 0.1)])) is None


def test_layer_projection_by_hand():
    doc = full_document()
    shallow, deep = (doc["items"][name]["report"] for name in ("7b_width_2_layers", "7b_width_4_layers"))
    projection = layer_projection(shallow, deep)
    # two more layers cost 0.06 s and 1e9 FLOPs per token: 0.03 s and 0.5e9 per layer
    assert projection.layer_seconds == pytest.approx(0.03)
    assert projection.layer_tflops == pytest.approx(0.5e9 * 8192 / 0.03 / 1e12)
    assert projection.layer_mfu == pytest.approx(projection.layer_tflops / PEAK)
    # 32 layers: the 2-layer step plus 30 layers; FLOPs 2e9 + 30 * 0.5e9 per token
    assert projection.projected_step_seconds == pytest.approx(0.10 + 30 * 0.03)
    assert projection.projected_tokens_per_s == pytest.approx(8192 / 1.0)
    assert projection.projected_mfu == pytest.approx(17e9 * 8192 / 1.0 / 1e12 / PEAK)
    with pytest.raises(ValueError, match="more layers"):
        layer_projection(deep, shallow)
    slower_shallow = copy.deepcopy(shallow)
    slower_shallow["runners"][0]["step_time_s"]["median"] = 0.2
    with pytest.raises(ValueError, match="not slower"):
        layer_projection(slower_shallow, deep)


def test_failed_skipped_and_missing_runs_are_not_measured():
    doc = full_document()
    doc["items"]["1b_compiled"] = bench(None, exit_code=124, output_tail="step 1\nkilled after 200 s\n")
    doc["items"]["1b_memory_selective"] = bench(None, exit_code=1)
    doc["items"]["1b_lns_vs_pre_ln"] = {"status": "skipped", "note": "the environment item's bf16 engine step failed"}
    del doc["items"]["7b_width_4_layers"], doc["items"]["1b_vs_hf_model"]
    doc["items"]["core_tests"]["tests"]["counts"]["skipped"] = 7
    doc["items"]["core_tests"]["tests"]["counts"]["passed"] = 0
    rows = rows_by_source(doc)
    assert rows["1b_compiled"][0].status == "not measured"
    assert rows["1b_compiled"][0].measured == "failed (exit 124): killed after 200 s"
    (fp8_ratio,) = [row for row in rows["1b_compiled"] if row.figure.startswith("(g)")]  # nothing to compare with
    assert fp8_ratio.status == "not measured" and fp8_ratio.measured.startswith("failed (exit 124)")
    assert rows["1b_memory_selective"][0].status == "not measured"
    assert rows["7b_width_4_layers"][0].measured == "not run"
    assert rows["1b_vs_hf_model"][0].measured == "not run"  # a figure of the issue: listed even when not run
    assert rows["core_tests"][0].status == "missed"  # a GPU run that skipped its tests did not test the GPU
    assert rows["1b_lns_vs_pre_ln"][0].measured == "skipped: the environment item's bf16 engine step failed"
    hf_without_baseline = report([runner("lnstrain-model[lns]", "model", "lns", 0.15)],
                                 notes=["Hugging Face baseline skipped: transformers is not installed"])
    doc["items"]["1b_vs_hf_model"] = bench(hf_without_baseline)
    (row,) = rows_by_source(doc)["1b_vs_hf_model"]
    assert row.status == "not measured" and "transformers is not installed" in row.measured


def test_merge_joins_calls_and_later_results_win():
    first, second = full_document(mfu=0.40), full_document(mfu=0.55)
    del second["items"]["1b_memory_full"]
    second["environment"], second["calls"] = None, [2]
    second["items"]["core_tests"] = {"status": "not started", "note": "110 s needed, 3 s left"}
    merged = merge_documents([first, second])
    assert merged["items"]["1b_eager"]["report"]["runners"][0]["throughput"]["mfu"] == 0.55
    assert "1b_memory_full" in merged["items"] and merged["environment"] == first["environment"]
    assert merged["items"]["core_tests"]["status"] == "done"  # a later "not started" does not erase a result
    assert merged["calls"] == [1, 2]
    with pytest.raises(ValueError, match="not a GPU check document"):
        merge_documents([{"schema": "lnstrain.benchmark/1"}])


def test_markdown_has_the_table_failures_unfinished_stages_and_commands():
    doc = full_document()
    doc["items"]["core_tests"]["tests"]["failures"] = [{"test": "tests.gpu.test_x::test_y", "message": "assert 0.2 <= 0.01"}]
    doc["items"]["1b_vs_hf_engine"] = {"status": "not started", "note": "55 s needed, 20 s left", "allowed_s": 55}
    text = to_markdown(doc)
    assert "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, CUDA 13.0, DeepSpeed 0.19.8" in text
    assert "| figure | measured | goal | status | from |" in text
    assert text.count("\n| ") == len(summary_rows(doc)) + 1  # the separator row starts with "|---"
    assert "`tests.gpu.test_x::test_y`: assert 0.2 <= 0.01" in text
    assert "- 1b_vs_hf_engine: not started 55 s needed, 20 s left" in text
    assert "- 1b_eager: 30 of 95 s, `python tools/benchmark.py ...`" in text
    assert "DRY RUN" not in text and "DRY RUN" in to_markdown({**doc, "dry_run": True})
    dry = [row.figure for row in summary_rows({**doc, "dry_run": True})]  # the tiny shapes ran in their places
    assert all("on a GPU" in figure for figure in dry if "1B" in figure or "7B" in figure)
    assert "(b) tiny shape (1B LNS seq 2048 bf16 on a GPU), training layout (FFN 5632, eager): tokens/s, TFLOP/s, MFU" in dry
    assert "tiny wide shape (7B width on a GPU): per-layer MFU; 32-layer projection" in dry


def test_the_eager_items_switched_pairs_give_the_lns_ratio_and_each_changes_worth():
    doc = full_document()
    del doc["items"]["1b_lns_vs_pre_ln"]
    without = {"lnstrain-engine[lns] without lns_factor": ["lns_factor"],
               "lnstrain-engine[lns] without rotary_kernel": ["rotary_kernel"],
               "lnstrain-engine[lns] without fused_accumulation": ["fused_accumulation"]}
    names = list(without)
    eager = report([runner(ENGINE, "engine", "lns", 1.20, 0.52), runner(names[0], "engine", "pre_ln", 1.199),
                    runner(names[1], "engine", "lns", 1.30), runner(names[2], "engine", "lns", 1.22)],
                   [comparison(names[0], ENGINE, 0.999, 0.995, 1.003), comparison(names[1], ENGINE, 1.08, 1.07, 1.09),
                    comparison(names[2], ENGINE, 1.015, 1.01, 1.02)], memory=memory(0.97))
    eager["switches"] = {"off_by_runner": {ENGINE: [], **without}, "without": {}}
    doc["items"]["1b_eager"] = bench(eager)
    doc["items"]["1b_micro_batch_8"] = bench(report([runner(ENGINE, "engine", "lns", 1.15, 0.545)], memory=memory(1.0)))
    rows = rows_by_source(doc)
    (lns,) = [row for row in rows["1b_eager"] if row.figure.startswith("(e)")]
    assert lns.status == "met" and lns.measured.startswith("1.0010 (95% CI 0.9970-1.0050")  # 1 / (Pre-LN / LNS)
    worth = [row for row in rows["1b_eager"] if row.figure.startswith("worth of")]
    assert [row.figure for row in worth] == ["worth of rotary_kernel (eager): step time without / with",
                                             "worth of fused_accumulation (eager): step time without / with"]
    assert worth[0].measured.startswith("1.0800 (95% CI 1.0700-1.0900")
    (compiled,) = [row for row in rows["1b_compiled"] if row.figure.startswith("compiled / eager")]
    assert compiled.measured == f"{0.14 / 1.20:.4f}" and compiled.status == "met"
    (micro,) = [row for row in rows["1b_micro_batch_8"] if row.figure.startswith("micro-batch 8")]
    assert micro.measured.startswith("MFU 54.5% against MFU 52.0%")
