"""The GPU check's results: one JSON document, its goals checked, and a short Markdown table.

``tools/gpu_check.py`` runs the items of ``lnstrain.benchmark.gpu_plan`` and writes a document of
schema ``SCHEMA``::

    {"schema", "dry_run", "calls", "limit_s", "environment": {...},
     "items": {name: {"status", "allowed_s", "duration_s", "exit_code", "command", "note",
                      "report" (a tools/benchmark.py report, schema lnstrain.benchmark/1),
                      "tests" ({"counts", "failures"}), "install", "engine_step", "output_tail"}}}

An item's status is ``done``, ``failed``, ``skipped`` (it needs the engine and the engine step failed)
or ``not started`` (its seconds did not fit in what was left of the call); a ``done`` item's ``note``
says what went wrong after its figures were taken (its process killed in its teardown). Several calls'
documents are joined by ``merge_documents``. ``summary_rows`` reads the issue's figures out of it and
checks each goal: the environment item passing under a minute, the core GPU tests passing, 1B LNS MFU >= 55%
(non-causal FLOPs), float8 linears >= 1.15x the compiled bf16 step's tokens/s (MFU against the bf16 peak), lnstrain >= 1.2x Hugging Face LLaMA, the LNS / Pre-LN step-time ratio's 95%
interval inside [0.99, 1.01], the ``--dry-run`` memory estimate within 10% of the measured peak, and the
7B-width per-layer MFU with the 32-layer projection it gives. Beside them, for information: what each change
is worth (the step time with it left out over the step time as built, from a ``--switches`` report), the
compiled step against the eager one, and micro-batch 8 against 4.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

SCHEMA = "lnstrain.gpu_check/2"

MFU_GOAL = 0.55
FP8_SPEEDUP_GOAL = 1.15
HF_SPEEDUP_GOAL = 1.2
LNS_RATIO_BAND = (0.99, 1.01)
MEMORY_BAND = (0.9, 1.1)
ENVIRONMENT_SECONDS_GOAL = 60.0
CORE_TESTS_SECONDS_GOAL = 120.0
PROJECTED_LAYERS = 32  # the 7B preset
FIRST_CALL_FIGURES = ("1b_eager", "1b_compiled", "1b_fp8_compiled")
"""Benchmark items of the first call: their rows are listed even when the item did not run."""


@dataclass(frozen=True)
class Row:
    """One line of the summary: a figure, its goal and whether it is met."""

    figure: str
    measured: str
    goal: str
    status: str  # met, missed, info, not measured
    source: str  # the item it comes from


def merge_documents(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls' documents: a later call's items and environment win."""
    if not documents:
        raise ValueError("merge_documents needs at least one document")
    for document in documents:
        if document.get("schema") != SCHEMA:
            raise ValueError(f"not a GPU check document (schema {document.get('schema')!r}, expected {SCHEMA!r})")
    merged: dict[str, Any] = {"schema": SCHEMA, "dry_run": any(d.get("dry_run") for d in documents),
                              "calls": [], "limit_s": documents[-1].get("limit_s"), "environment": None, "items": {}}
    for document in documents:
        merged["calls"] += [call for call in document.get("calls") or [] if call not in merged["calls"]]
        for name, item in (document.get("items") or {}).items():
            if item.get("status") != "not started" or name not in merged["items"]:
                merged["items"][name] = item
        if document.get("environment"):
            merged["environment"] = document["environment"]
    return merged


def _item(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    return (doc.get("items") or {}).get(name)


def _report(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    item = _item(doc, name)
    return item.get("report") if item and item.get("status") == "done" else None


def _not_measured(figure: str, goal: str, source: str, doc: dict[str, Any]) -> Row:
    item = _item(doc, source)
    if item is None:
        return Row(figure, "not run", goal, "not measured", source)
    if item.get("status") in ("skipped", "not started"):
        return Row(figure, f"{item['status']}: {item.get('note') or ''}".rstrip(": "), goal, "not measured", source)
    last_line = next((line.strip() for line in reversed((item.get("output_tail") or "").splitlines()) if line.strip()), "")
    why = f"failed (exit {item.get('exit_code')})" + (f": {last_line[:160]}" if last_line else "")
    return Row(figure, why, goal, "not measured", source)


def _ran(doc: dict[str, Any], name: str) -> bool:
    """Whether the item is in the document (run or attempted): optional items get a row only then."""
    return _item(doc, name) is not None


def environment_rows(doc: dict[str, Any]) -> list[Row]:
    figure = "(a) environment, offline install of .whl/, one bf16 engine step on CUDA"
    goal = f"passes, under {ENVIRONMENT_SECONDS_GOAL:.0f} s"
    item = _item(doc, "environment")
    if item is None:
        return [Row(figure, "not run", goal, "not measured", "environment")]
    step = item.get("engine_step") or {}
    install = item.get("install") or {}
    parts = [f"install {install.get('status', '-')}" + (f" in {install['seconds']:.0f} s" if install.get("seconds") else "")]
    if step.get("loss") is not None:
        parts.append(f"engine step on {step.get('device', '?')}: loss {step['loss']:.3f}")
        if step.get("triton_kernels"):
            parts.append(triton_kernels_line(step["triton_kernels"]))
    elif step:
        parts.append(f"engine step failed: {step.get('error', '?')[:160]}")
    parts.append(f"{item.get('duration_s', 0):.0f} s in all")
    met = item.get("status") == "done" and item.get("duration_s", float("inf")) < ENVIRONMENT_SECONDS_GOAL
    return [Row(figure, "; ".join(parts), goal, _status(met), "environment")]


def triton_kernels_line(kernels: dict[str, bool]) -> str:
    """Which Triton kernels a benchmark's steps ran (each passed its check against eager on the device,
    or was NOT used)."""
    return "Triton kernels " + ", ".join(f"{kernel} {'used' if used else 'NOT used'}" for kernel, used in kernels.items())


def _status(met: bool) -> str:
    return "met" if met else "missed"


def tests_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name, figure, goal_s in (("core_tests", "(d) core GPU tests (pytest -m 'gpu and gpu_core')", CORE_TESTS_SECONDS_GOAL),
                                 ("full_tests", "the whole GPU suite (pytest -m gpu tests/gpu)", None)):
        goal = "all pass" + (f", under {goal_s:.0f} s" if goal_s else "")
        item = _item(doc, name)
        if item is None or not item.get("tests"):
            if name == "core_tests" or item is not None:
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        counts = item["tests"].get("counts") or {}
        passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
        bad = counts.get("failed", 0) + counts.get("errors", 0)
        measured = (f"{passed} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
                    f"{skipped} skipped in {item.get('duration_s', 0):.0f} s")
        met = (item.get("exit_code") == 0 and bad == 0 and skipped == 0 and passed > 0
               and (goal_s is None or item.get("duration_s", float("inf")) < goal_s))
        rows.append(Row(figure, measured, goal, _status(met), name))
    return rows


def throughput_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name, label in (("1b_eager", "FFN 5632, eager"), ("1b_compiled", "FFN 5632, compiled"),
                        ("1b_fp8_compiled", "FFN 5632, compiled, FP8 tensorwise"),
                        ("1b_fp8_rowwise_compiled", "FFN 5632, compiled, FP8 rowwise"),
                        ("1b_micro_batch_8", "FFN 5632, micro-batch 8, eager"),
                        ("1b_paper_shape", "the paper's FFN 5461, eager")):
        report = _report(doc, name)
        figure = f"(b) 1B LNS seq 2048 bf16, training layout ({label}): tokens/s, TFLOP/s, MFU"
        goal = f"MFU >= {MFU_GOAL:.0%}" + (" (against the bf16 peak)" if "fp8" in name else "") if name != "1b_paper_shape" else "-"
        if report is None:
            if _ran(doc, name) or name in FIRST_CALL_FIGURES:
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        rate = report["runners"][0]["throughput"]
        mfu = rate.get("mfu")
        measured = (f"{rate['tokens_per_s']:,.0f} tok/s, {rate['tflops_per_device']:.0f} TFLOP/s, "
                    + (f"MFU {mfu:.1%}" if mfu is not None else "MFU - (no peak for this device)"))
        if report.get("triton_kernels"):
            measured += "; " + triton_kernels_line(report["triton_kernels"])
        status = "info" if name == "1b_paper_shape" else ("not measured" if mfu is None else _status(mfu >= MFU_GOAL))
        rows.append(Row(figure, measured, goal, status, name))
    return rows


FP8_SOURCES = ("1b_fp8_compiled", "1b_fp8_rowwise_compiled")
"""Float8 items, each compared with ``1b_compiled``'s engine as built (bf16 linears, the same call)."""


def fp8_rows(doc: dict[str, Any]) -> list[Row]:
    """Float8's tokens/s over the compiled bf16 step's (separate processes of one call, the same config but
    ``precision.fp8``); the goal is the tensorwise item's."""
    rows = []
    bf16 = _report(doc, "1b_compiled")
    for name in FP8_SOURCES:
        figure = f"(g) FP8 {name.split('_')[2] if 'rowwise' in name else 'tensorwise'} / bf16 tokens/s (compiled, 1B training layout)"
        goal = f">= {FP8_SPEEDUP_GOAL}x" if name == "1b_fp8_compiled" else "-"
        report = _report(doc, name)
        if report is None or bf16 is None:
            if _ran(doc, name) or name == "1b_fp8_compiled":
                rows.append(_not_measured(figure, goal, name if report is None else "1b_compiled", doc))
            continue
        rates = [r["runners"][0]["throughput"]["tokens_per_s"] for r in (report, bf16)]
        speedup = rates[0] / rates[1]
        status = _status(speedup >= FP8_SPEEDUP_GOAL) if name == "1b_fp8_compiled" else "info"
        rows.append(Row(figure, f"{speedup:.3f}x ({rates[0]:,.0f} against {rates[1]:,.0f} tok/s)", goal, status, name))
    return rows


def _runner_by_kind(report: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((run for run in report["runners"] if run["kind"] == kind), None)


def hf_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name, side in (("1b_vs_hf_model", "model"), ("1b_vs_hf_engine", "engine")):
        figure = f"(f) lnstrain {side} / HF LlamaForCausalLM speed (same shape, same run)"
        goal = f">= {HF_SPEEDUP_GOAL}x"
        report = _report(doc, name)
        if report is None:
            if _ran(doc, name) or name == "1b_vs_hf_model":
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


LNS_SOURCES = ("1b_eager", "1b_lns_vs_pre_ln")
"""Where an LNS / Pre-LN pair is read: the eager item's switched pair, or the dedicated item (the later call's)."""


def lns_rows(doc: dict[str, Any]) -> list[Row]:
    figure, goal = "(e) LNS / Pre-LN step time (paired, one 1B engine)", f"95% CI inside [{LNS_RATIO_BAND[0]}, {LNS_RATIO_BAND[1]}]"
    rows = []
    for name in LNS_SOURCES:
        report = _report(doc, name)
        found = lns_ratio(report) if report is not None else None
        if found is None:
            continue
        median, (low, high), pairs = found
        met = LNS_RATIO_BAND[0] <= low and high <= LNS_RATIO_BAND[1]
        rows.append(Row(figure, f"{median:.4f} (95% CI {low:.4f}-{high:.4f}, {pairs} pairs)", goal, _status(met), name))
    if rows:
        return rows
    if "1b_lns_vs_pre_ln" in (doc.get("items") or {}):
        return [_not_measured(figure, goal, "1b_lns_vs_pre_ln", doc)]
    if _report(doc, "1b_eager") is not None:
        return [Row(figure, "not measured: no LNS / Pre-LN pair in the report", goal, "not measured", "1b_eager")]
    return [_not_measured(figure, goal, "1b_eager", doc)]


def switch_rows(doc: dict[str, Any]) -> list[Row]:
    """What each change is worth: step time with it left out / as built (above 1: the change saves time)."""
    rows = []
    for name in ("1b_eager", "1b_compiled", "1b_compiled_kernels_off"):
        report = _report(doc, name)
        off_by_runner = ((report or {}).get("switches") or {}).get("off_by_runner") or {}
        for comparison in (report or {}).get("comparisons", []):
            off = off_by_runner.get(comparison["runner"])
            if not off or off == ["lns_factor"]:  # LNS's factor is row (e)
                continue
            low, high = comparison["ci95"]
            setting = "compiled" if name.startswith("1b_compiled") else name.removeprefix("1b_")
            rows.append(Row(f"worth of {' + '.join(off)} ({setting}): step time without / with",
                            f"{comparison['median_ratio']:.4f} (95% CI {low:.4f}-{high:.4f}, {comparison['pairs']} pairs)",
                            "> 1 (the change saves time)", "info", name))
    eager, compiled = _report(doc, "1b_eager"), _report(doc, "1b_compiled")
    if eager is not None and compiled is not None:
        ratio = compiled["runners"][0]["step_time_s"]["median"] / eager["runners"][0]["step_time_s"]["median"]
        rows.append(Row("compiled / eager step time (default path, separate processes)", f"{ratio:.4f}", "<= 1",
                        _status(ratio <= 1.0), "1b_compiled"))
    larger = _report(doc, "1b_micro_batch_8")
    if eager is not None and larger is not None:
        mfus = [report["runners"][0]["throughput"].get("mfu") for report in (eager, larger)]
        measured = " against ".join(f"MFU {mfu:.1%}" if mfu is not None else "MFU -" for mfu in mfus[::-1])
        memory = larger.get("memory") or {}
        peak = memory.get("peak_allocated_bytes")
        rows.append(Row("micro-batch 8 against 4 (eager, the same tokens a step)",
                        measured + (f"; peak {peak / 2**30:.2f} GiB allocated" if peak else ""),
                        "the larger MFU within memory picks configs/bench/1b_seq2048.yaml's micro-batch", "info",
                        "1b_micro_batch_8"))
    return rows


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
    if not (_ran(doc, "7b_width_2_layers") or _ran(doc, "7b_width_4_layers")):
        return []
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
    for name, mode in (("1b_eager", "none"), ("1b_compiled", "none, compiled"), ("1b_fp8_compiled", "none, compiled, FP8"),
                       ("1b_memory_full", "full"), ("1b_memory_selective", "selective")):
        figure = f"(c) --dry-run memory estimate vs max_memory_allocated, checkpointing {mode}"
        report = _report(doc, name)
        if report is None:
            if _ran(doc, name) or name in FIRST_CALL_FIGURES:
                rows.append(_not_measured(figure, goal, name, doc))
            continue
        memory = report.get("memory") or {}
        ratio = memory.get("estimate_over_measured")
        measured_bytes = memory.get("peak_allocated_bytes", memory.get("peak_tensor_bytes"))
        if ratio is None or measured_bytes is None:
            rows.append(Row(figure, f"not measured: {memory.get('note', 'no memory section')}", goal, "not measured", name))
            continue
        reserved = memory.get("peak_reserved_bytes")
        measured = (f"{ratio:.3f} (estimate {memory['estimated_bytes'] / 2**30:.2f} GiB, allocated "
                    f"{measured_bytes / 2**30:.2f} GiB" + (f", reserved {reserved / 2**30:.2f} GiB" if reserved else "") + ")")
        rows.append(Row(figure, measured, goal, _status(MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]), name))
    return rows


DRY_RUN_SHAPES = {"1B LNS seq 2048 bf16": "tiny shape (1B LNS seq 2048 bf16 on a GPU)",
                  "7B width (hidden 4096), seq 4096": "tiny wide shape (7B width on a GPU)",
                  "1B": "tiny shape (1B on a GPU)"}
"""A dry run measures the tiny shapes in the GPU shapes' places; its rows say which shape they measured."""
_GPU_SHAPE = re.compile("|".join(re.escape(shape) for shape in DRY_RUN_SHAPES))


def summary_rows(doc: dict[str, Any]) -> list[Row]:
    """Every figure of the check with its goal and status, in the issue's order."""
    rows = (environment_rows(doc) + throughput_rows(doc) + fp8_rows(doc) + memory_rows(doc) + tests_rows(doc)
            + lns_rows(doc) + hf_rows(doc) + layer_rows(doc) + switch_rows(doc))
    if doc.get("dry_run"):
        rows = [replace(row, figure=_GPU_SHAPE.sub(lambda match: DRY_RUN_SHAPES[match.group(0)], row.figure))
                for row in rows]
    return rows


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
    """The summary table, the failures, the items not run and the command behind every figure."""
    title = "GPU check" + (" (DRY RUN on the CPU: plumbing only, no GPU figure)" if doc.get("dry_run") else "")
    lines = [f"# {title}", "", environment_line(doc.get("environment")), "",
             "| figure | measured | goal | status | from |", "|---|---|---|---|---|"]
    lines += [f"| {_cell(r.figure)} | {_cell(r.measured)} | {_cell(r.goal)} | {r.status} | {_cell(r.source)} |"
              for r in summary_rows(doc)]
    items = doc.get("items") or {}
    failures = [f for item in items.values() for f in ((item.get("tests") or {}).get("failures") or [])]
    if failures:
        lines += ["", "Failed tests:"] + [f"- `{f['test']}`: {_cell(f['message'])}" for f in failures]
    unfinished = {name: item for name, item in items.items() if item.get("status") != "done"}
    if unfinished:
        lines += ["", "Items not done:"] + [f"- {name}: {item.get('status')} {item.get('note') or ''}".rstrip()
                                            for name, item in unfinished.items()]
    remarked = {name: item["note"] for name, item in items.items() if item.get("status") == "done" and item.get("note")}
    if remarked:
        lines += ["", "Items done, with a remark:"] + [f"- {name}: {note}" for name, note in remarked.items()]
    lines += ["", "Items (seconds taken of seconds allowed) and commands:"]
    lines += [f"- {name}: {item.get('duration_s') or 0:.0f} of {item.get('allowed_s') or 0:.0f} s"
              + (f", `{item['command']}`" if item.get("command") else "") for name, item in items.items()]
    return "\n".join(lines) + "\n"


def summary_json(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The rows as JSON-able dicts (stored beside the raw results)."""
    return [asdict(row) for row in summary_rows(doc)]
