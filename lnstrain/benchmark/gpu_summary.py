"""The GPU check's results: one JSON document, its goals checked, and a short Markdown table.

``tools/gpu_check.py`` runs the GPU test suite and the benchmarks of ``BENCHMARKS`` (each a
``tools/benchmark.py`` run whose JSON, schema ``lnstrain.benchmark/1``, it keeps whole) and writes a
document of schema ``SCHEMA``::

    {"schema", "dry_run", "stages": {stage: {"status", "duration_s", "note"}},
     "environment": {...}, "tests": {"command", "exit_code", "duration_s", "counts", "failures"},
     "benchmarks": {name: {"command", "exit_code", "duration_s", "report", "output_tail"}}}

A session lent a GPU may run the stages over several calls; ``merge_documents`` joins their
documents. ``summary_rows`` reads the figures of the issue out of it and checks each goal:
1B LNS MFU >= 50% (non-causal FLOPs), lnstrain >= 1.2x Hugging Face LLaMA, the LNS / Pre-LN step-time
ratio's 95% interval inside [0.99, 1.01], the ``--dry-run`` memory estimate within 10% of the measured
peak, and the 7B-width per-layer MFU with the 32-layer projection it gives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "lnstrain.gpu_check/1"

MFU_GOAL = 0.50
HF_SPEEDUP_GOAL = 1.2
LNS_RATIO_BAND = (0.99, 1.01)
MEMORY_BAND = (0.9, 1.1)
TEST_SUITE_SECONDS_GOAL = 480.0
PROJECTED_LAYERS = 32  # the 7B preset

BENCHMARKS = {
    "1b_eager": "1B LNS, seq 2048, bf16, engine, eager (memory: checkpointing none)",
    "1b_compiled": "1B LNS, seq 2048, bf16, engine, train.compile",
    "1b_ffn5632": "1B LNS with the FFN width rounded to 5632 (a multiple of 256), eager",
    "1b_vs_hf_model": "lnstrain model vs HF LlamaForCausalLM, same driver, bf16 autocast",
    "1b_vs_hf_engine": "lnstrain engine vs HF LlamaForCausalLM",
    "1b_lns_vs_pre_ln": "LNS vs Pre-LN engines, interleaved",
    "7b_width_2_layers": "7B width (hidden 4096), 2 layers, seq 4096",
    "7b_width_4_layers": "7B width (hidden 4096), 4 layers, seq 4096",
    "1b_memory_full": "1B memory, activation checkpointing full",
    "1b_memory_selective": "1B memory, activation checkpointing selective",
}
"""Every benchmark the check knows, by the name its result is stored under."""


@dataclass(frozen=True)
class Row:
    """One line of the summary: a figure, its goal and whether it is met."""

    figure: str
    measured: str
    goal: str
    status: str  # met, missed, info, not measured
    source: str  # the benchmark (or "tests") it comes from


def merge_documents(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls' documents: later stages, tests and benchmarks win."""
    if not documents:
        raise ValueError("merge_documents needs at least one document")
    for document in documents:
        if document.get("schema") != SCHEMA:
            raise ValueError(f"not a GPU check document (schema {document.get('schema')!r}, expected {SCHEMA!r})")
    merged: dict[str, Any] = {"schema": SCHEMA, "dry_run": any(d.get("dry_run") for d in documents),
                              "stages": {}, "environment": None, "tests": None, "benchmarks": {}}
    for document in documents:
        merged["stages"].update(document.get("stages") or {})
        merged["benchmarks"].update(document.get("benchmarks") or {})
        for key in ("environment", "tests"):
            if document.get(key):
                merged[key] = document[key]
    return merged


def _report(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    run = (doc.get("benchmarks") or {}).get(name)
    return run.get("report") if run and run.get("exit_code") == 0 else None


def _not_measured(figure: str, goal: str, source: str, doc: dict[str, Any]) -> Row:
    run = (doc.get("benchmarks") or {}).get(source)
    if run is None:
        return Row(figure, "not run", goal, "not measured", source)
    last_line = next((line.strip() for line in reversed((run.get("output_tail") or "").splitlines()) if line.strip()), "")
    why = f"failed (exit {run.get('exit_code')})" + (f": {last_line[:160]}" if last_line else "")
    return Row(figure, why, goal, "not measured", source)


def _status(met: bool) -> str:
    return "met" if met else "missed"


def suite_rows(doc: dict[str, Any]) -> list[Row]:
    tests = doc.get("tests")
    figure, goal = "GPU test suite (tests/gpu)", f"all pass, under {TEST_SUITE_SECONDS_GOAL:.0f} s"
    if not tests:
        return [Row(figure, "not run", goal, "not measured", "tests")]
    counts = tests.get("counts") or {}
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    bad = counts.get("failed", 0) + counts.get("errors", 0)
    measured = (f"{passed} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
                f"{skipped} skipped in {tests.get('duration_s', 0):.0f} s")
    met = tests.get("exit_code") == 0 and bad == 0 and skipped == 0 and passed > 0 \
        and tests.get("duration_s", float("inf")) < TEST_SUITE_SECONDS_GOAL
    return [Row(figure, measured, goal, _status(met), "tests")]


def throughput_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name, label in (("1b_eager", "eager"), ("1b_compiled", "compiled"), ("1b_ffn5632", "FFN 5632, eager")):
        report = _report(doc, name)
        figure = f"1B LNS seq 2048 bf16 ({label}): tokens/s, TFLOP/s, MFU"
        goal = f"MFU >= {MFU_GOAL:.0%}" if name != "1b_ffn5632" else "-"
        if report is None:
            if name in (doc.get("benchmarks") or {}) or name == "1b_eager":
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        rate = report["runners"][0]["throughput"]
        mfu = rate.get("mfu")
        measured = (f"{rate['tokens_per_s']:,.0f} tok/s, {rate['tflops_per_device']:.0f} TFLOP/s, "
                    + (f"MFU {mfu:.1%}" if mfu is not None else "MFU - (no peak for this device)"))
        status = "info" if name == "1b_ffn5632" else ("not measured" if mfu is None else _status(mfu >= MFU_GOAL))
        rows.append(Row(figure, measured, goal, status, name))
    return rows


def _runner_by_kind(report: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((run for run in report["runners"] if run["kind"] == kind), None)


def hf_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name, side in (("1b_vs_hf_model", "model"), ("1b_vs_hf_engine", "engine")):
        figure = f"lnstrain {side} / HF LlamaForCausalLM speed (same shape, same run)"
        goal = f">= {HF_SPEEDUP_GOAL}x"
        report = _report(doc, name)
        if report is None:
            if name in (doc.get("benchmarks") or {}) or name == "1b_vs_hf_model":
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        comparison = next((c for c in report["comparisons"] if c["runner"].startswith("hf-")), None)
        if comparison is None:
            notes = "; ".join(report.get("notes") or []) or "no HF runner in the report"
            rows.append(Row(figure, f"not measured: {notes}", goal, "not measured", name))
            continue
        # the comparison is HF time / lnstrain time: lnstrain's speed-up
        low, high = comparison["ci95"]
        speedup = comparison["median_ratio"]
        rows.append(Row(figure, f"{speedup:.3f}x (95% CI {low:.3f}-{high:.3f}, {comparison['pairs']} pairs)", goal,
                        _status(speedup >= HF_SPEEDUP_GOAL), name))
    return rows


def lns_ratio(report: dict[str, Any]) -> tuple[float, tuple[float, float], int] | None:
    """LNS / Pre-LN step time (median, 95% CI, pairs) from a two-scheme report, whichever came first."""
    schemes = {run["name"]: run["norm_scheme"] for run in report["runners"]}
    for comparison in report["comparisons"]:
        pair = (schemes.get(comparison["runner"]), schemes.get(comparison["reference"]))
        low, high = comparison["ci95"]
        if pair == ("lns", "pre_ln"):
            return comparison["median_ratio"], (low, high), comparison["pairs"]
        if pair == ("pre_ln", "lns"):
            return 1.0 / comparison["median_ratio"], (1.0 / high, 1.0 / low), comparison["pairs"]
    return None


def lns_rows(doc: dict[str, Any]) -> list[Row]:
    figure, goal = "LNS / Pre-LN step time (paired, 1B engine)", f"95% CI inside [{LNS_RATIO_BAND[0]}, {LNS_RATIO_BAND[1]}]"
    report = _report(doc, "1b_lns_vs_pre_ln")
    if report is None:
        return [_not_measured(figure, goal, "1b_lns_vs_pre_ln", doc)]
    found = lns_ratio(report)
    if found is None:
        return [Row(figure, "not measured: no LNS / Pre-LN pair in the report", goal, "not measured", "1b_lns_vs_pre_ln")]
    median, (low, high), pairs = found
    met = LNS_RATIO_BAND[0] <= low and high <= LNS_RATIO_BAND[1]
    return [Row(figure, f"{median:.4f} (95% CI {low:.4f}-{high:.4f}, {pairs} pairs)", goal, _status(met),
                "1b_lns_vs_pre_ln")]


@dataclass(frozen=True)
class LayerProjection:
    """Per-layer cost from two depths of one width, and the step it projects for ``layers`` layers."""

    layer_seconds: float
    layer_mfu: float | None
    layer_tflops: float
    projected_layers: int
    projected_step_seconds: float
    projected_tokens_per_s: float
    projected_mfu: float | None


def layer_projection(shallow: dict[str, Any], deep: dict[str, Any], layers: int = PROJECTED_LAYERS) -> LayerProjection:
    """Difference two runs of the same width at two depths: the extra layers' time and FLOPs.

    FLOPs per token are linear in the layer count (``lnstrain.estimate.flops``), so their difference
    is exact; the step time's difference removes the embedding, head, loss and their optimizer work.
    The projection adds ``layers - shallow`` such layers to the shallow run's step.
    """
    depth = (shallow["shape"]["model"]["num_layers"], deep["shape"]["model"]["num_layers"])
    if depth[1] <= depth[0]:
        raise ValueError(f"the deep run must have more layers than the shallow one (got {depth})")
    if shallow["shape"]["tokens_per_step"] != deep["shape"]["tokens_per_step"]:
        raise ValueError("the two runs must take the same tokens per step")
    tokens = shallow["shape"]["tokens_per_step"]
    times = [r["runners"][0]["step_time_s"]["median"] for r in (shallow, deep)]
    flops = [r["flops"]["per_token_noncausal"] for r in (shallow, deep)]
    peak = deep["peak"]["tflops"]
    extra = depth[1] - depth[0]
    layer_seconds = (times[1] - times[0]) / extra
    if layer_seconds <= 0:
        raise ValueError(f"the deeper run was not slower ({times[1]:.4f} s vs {times[0]:.4f} s): too noisy to difference")
    layer_flops = (flops[1] - flops[0]) / extra
    layer_tflops = layer_flops * tokens / layer_seconds / 1e12
    step = times[0] + (layers - depth[0]) * layer_seconds
    projected_tflops = (flops[0] + (layers - depth[0]) * layer_flops) * tokens / step / 1e12
    return LayerProjection(layer_seconds=layer_seconds, layer_mfu=layer_tflops / peak if peak else None,
                           layer_tflops=layer_tflops, projected_layers=layers, projected_step_seconds=step,
                           projected_tokens_per_s=tokens / step,
                           projected_mfu=projected_tflops / peak if peak else None)


def layer_rows(doc: dict[str, Any]) -> list[Row]:
    figure = "7B width (hidden 4096), seq 4096: per-layer MFU; 32-layer projection"
    shallow, deep = _report(doc, "7b_width_2_layers"), _report(doc, "7b_width_4_layers")
    if shallow is None or deep is None:
        missing = "7b_width_2_layers" if shallow is None else "7b_width_4_layers"
        return [_not_measured(figure, "-", missing, doc)]
    try:
        projection = layer_projection(shallow, deep)
    except ValueError as error:
        return [Row(figure, f"not measured: {error}", "-", "not measured", "7b_width_2_layers, 7b_width_4_layers")]
    mfu = "-" if projection.layer_mfu is None else f"{projection.layer_mfu:.1%}"
    projected = "-" if projection.projected_mfu is None else f"{projection.projected_mfu:.1%}"
    measured = (f"per layer {projection.layer_seconds * 1e3:.2f} ms, {projection.layer_tflops:.0f} TFLOP/s, MFU {mfu}; "
                f"32 layers: {projection.projected_tokens_per_s:,.0f} tok/s, MFU {projected}")
    return [Row(figure, measured, "-", "info", "7b_width_2_layers, 7b_width_4_layers")]


def memory_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    goal = f"estimate / measured in [{MEMORY_BAND[0]}, {MEMORY_BAND[1]}]"
    for name, mode in (("1b_eager", "none"), ("1b_memory_full", "full"), ("1b_memory_selective", "selective")):
        figure = f"--dry-run memory estimate vs measured peak, checkpointing {mode}"
        report = _report(doc, name)
        if report is None:
            if name in (doc.get("benchmarks") or {}) or mode != "selective":
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        memory = report.get("memory") or {}
        ratio = memory.get("estimate_over_measured")
        measured_bytes = memory.get("peak_allocated_bytes", memory.get("peak_tensor_bytes"))
        if ratio is None or measured_bytes is None:
            rows.append(Row(figure, f"not measured: {memory.get('note', 'no memory section')}", goal, "not measured", name))
            continue
        measured = (f"{ratio:.3f} (estimate {memory['estimated_bytes'] / 2**30:.2f} GiB, "
                    f"measured {measured_bytes / 2**30:.2f} GiB)")
        rows.append(Row(figure, measured, goal, _status(MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]), name))
    return rows


def summary_rows(doc: dict[str, Any]) -> list[Row]:
    """Every figure of the check with its goal and status, in the issue's order."""
    return (suite_rows(doc) + throughput_rows(doc) + hf_rows(doc) + lns_rows(doc) + layer_rows(doc)
            + memory_rows(doc))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def environment_line(environment: dict[str, Any] | None) -> str:
    if not environment:
        return "environment: not recorded"
    parts = [environment.get("device_name") or "no GPU", f"torch {environment.get('torch')}",
             f"CUDA {environment.get('cuda') or '-'}", f"DeepSpeed {environment.get('deepspeed') or '-'}",
             f"transformers {environment.get('transformers') or '-'}",
             f"apex {'yes' if environment.get('apex') else 'no'}",
             f"torch fused RMSNorm on CUDA {'yes' if environment.get('torch_fused_rms_norm_on_cuda') else 'no'}"]
    return ", ".join(parts)


def to_markdown(doc: dict[str, Any]) -> str:
    """The summary table, the failures and the commands behind every figure."""
    title = "GPU check" + (" (DRY RUN on the CPU: plumbing only, no GPU figure)" if doc.get("dry_run") else "")
    lines = [f"# {title}", "", environment_line(doc.get("environment")), "",
             "| figure | measured | goal | status | from |", "|---|---|---|---|---|"]
    lines += [f"| {_cell(r.figure)} | {_cell(r.measured)} | {_cell(r.goal)} | {r.status} | {_cell(r.source)} |"
              for r in summary_rows(doc)]
    tests = doc.get("tests") or {}
    if tests.get("failures"):
        lines += ["", "Failed tests:"] + [f"- `{f['test']}`: {_cell(f['message'])}" for f in tests["failures"]]
    stages = doc.get("stages") or {}
    unfinished = {name: stage for name, stage in stages.items() if stage.get("status") != "done"}
    if unfinished:
        lines += ["", "Stages not completed:"] + [f"- {name}: {stage.get('status')} {stage.get('note') or ''}".rstrip()
                                                  for name, stage in unfinished.items()]
    commands = [("tests", tests.get("command"))] + [(name, run.get("command"))
                                                   for name, run in (doc.get("benchmarks") or {}).items()]
    lines += ["", "Commands:"] + [f"- {name}: `{command}`" for name, command in commands if command]
    return "\n".join(lines) + "\n"


def summary_json(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The rows as JSON-able dicts (stored beside the raw results)."""
    return [asdict(row) for row in summary_rows(doc)]
