"""Write depth analyses to disk: JSON, CSV, Markdown, and PNG plots when matplotlib is installed.

One analysis gives a single-run report; several (e.g. Pre-LN and LNS) give one report with the
runs side by side. Files in the output folder:

    depth_analysis.json         {"runs": [DepthAnalysis.to_dict(), ...], "claims": [ClaimResult.to_dict(), ...],
                                 "configurations": {label: [run name, ...]}, "window_differences": [str, ...]}
    <run>_variance.csv          layer, output_variance           (layer 0: embedding output)
    <run>_angular.csv           layer, offset, angular_distance  (states entering l and l + offset)
    <run>_pruning.csv           layer, loss, perplexity, delta_loss, delta_perplexity, accuracy, delta_accuracy
    variance.png, pruning.png, angular_<run>.png   (matplotlib only)
    report.md
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from lnstrain.analysis.claims import ClaimResult, claims_table, configurations, evaluate_claims, unclaimed
from lnstrain.analysis.depth_analysis import DepthAnalysis
from lnstrain.analysis.plots import file_stem, write_plots
from lnstrain.analysis.windows import window_differences

SCHEME_DESCRIPTIONS = {
    "pre_ln": "pre: x + f(norm(x))",
    "sandwich_ln": "sandwich: x + norm(f(norm(x)))",
    "output_ln": "output: x + norm(f(x))",
    "post_ln": "post: norm(x + f(x))",
}
"""How each placement normalises, for the report (schemes not listed are shown by name)."""

logger = logging.getLogger(__name__)


def read_analyses(path: str | Path) -> list[DepthAnalysis]:
    """The analyses in a `depth_analysis.json` (or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "depth_analysis.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return [DepthAnalysis.from_dict(run) for run in data["runs"]]


def write_csvs(analysis: DepthAnalysis, out_dir: Path) -> list[Path]:
    stem = file_stem(analysis.name)
    paths = [out_dir / f"{stem}_variance.csv", out_dir / f"{stem}_angular.csv", out_dir / f"{stem}_pruning.csv"]
    with paths[0].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "output_variance"])
        writer.writerows(enumerate(analysis.output_variance))
    with paths[1].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "offset", "angular_distance"])
        for offset, row in enumerate(analysis.distance_by_offset(), 1):
            writer.writerows((layer, offset, d) for layer, d in enumerate(row, 1) if d is not None)
    with paths[2].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["layer", "loss", "perplexity", "delta_loss", "delta_perplexity", "accuracy", "delta_accuracy"])
        for p in analysis.pruning:
            writer.writerow([p.layer, p.result.loss, p.result.perplexity, p.delta_loss, p.delta_perplexity,
                             "" if p.result.accuracy is None else p.result.accuracy,
                             "" if p.delta_accuracy is None else p.delta_accuracy])
    return paths


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _scheme(run: DepthAnalysis) -> str:
    description = SCHEME_DESCRIPTIONS.get(run.norm_scheme)
    return f"{run.norm_scheme} ({description})" if description else run.norm_scheme


def _negative(run: DepthAnalysis) -> str:
    layers = run.summary.negative_layers
    if not layers:
        return "none"
    return ", ".join(f"{layer} ({run.pruning[layer - 1].delta_loss:+.4f})" for layer in layers)


def _summary_table(runs: Sequence[DepthAnalysis]) -> list[str]:
    threshold = runs[0].summary.near_identity_threshold
    rows = [
        ("norm scheme (placement)", [_scheme(r) for r in runs]),
        ("layers", [str(r.num_layers) for r in runs]),
        ("validation tokens", [str(r.validation_tokens) for r in runs]),
        ("validation loss", [_fmt(r.baseline.loss) for r in runs]),
        ("perplexity", [_fmt(r.baseline.perplexity) for r in runs]),
        (f"near-identity layers (\\|ΔP\\| < {threshold:g} nats)",
         [f"{r.summary.num_near_identity} of {r.num_layers}" for r in runs]),
        ("layers whose removal lowers the loss (ΔP)", [_negative(r) for r in runs]),
        ("share of ΔP in the deepest half", [f"{r.summary.deep_half_share:.1%}" for r in runs]),
        ("output variance, last / first layer",
         [_fmt(r.output_variance[-1] / max(r.output_variance[1], 1e-30), 3) for r in runs]),
    ]
    if any(r.source for r in runs):
        rows.insert(0, ("model", [r.source or "–" for r in runs]))
    if any(r.baseline.accuracy is not None for r in runs):
        rows.append(("multiple-choice accuracy", [_fmt(r.baseline.accuracy, 3) for r in runs]))
    lines = ["| | " + " | ".join(r.name for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in rows]
    return lines


def _per_layer_table(runs: Sequence[DepthAnalysis]) -> list[str]:
    header = ["layer"]
    for r in runs:
        header += [f"{r.name} variance", f"{r.name} ΔP (loss)", f"{r.name} d(l, l+1)"]
        if r.baseline.accuracy is not None:
            header.append(f"{r.name} Δacc")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for layer in range(1, max(r.num_layers for r in runs) + 1):
        cells = [str(layer)]
        for r in runs:
            if layer > r.num_layers:
                cells += ["–"] * (3 + (r.baseline.accuracy is not None))
                continue
            p = r.pruning[layer - 1]
            cells += [_fmt(r.output_variance[layer]), f"{p.delta_loss:+.4f}" + (" ↓" if p.delta_loss < 0 else ""),
                      _fmt(r.angular_distance[layer - 1][layer], 3)]
            if r.baseline.accuracy is not None:
                cells.append(f"{p.delta_accuracy:+.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _windows_section(runs: Sequence[DepthAnalysis]) -> list[str]:
    lines = ["## Windows", ""]
    for r in runs:
        w = r.windows
        if w is None:
            lines.append(f"- {r.name}: not recorded")
            continue
        tokenizer = w.tokenizer + (f" (sha256 {w.tokenizer_sha256[:12]})" if w.tokenizer_sha256 else "")
        lines.append(f"- {r.name}: {w.describe()} ({w.source_kind}, sha256 {w.source_sha256[:12]}), first at token "
                     f"{w.start}; tokenizer {tokenizer}; token ids sha256 {w.tokens_sha256[:12]}")
    if len(runs) > 1:
        differences = window_differences([(r.name, r.windows) for r in runs])
        if differences:
            lines += ["", "**The runs were not measured on the same windows** (compared with "
                      "`--allow-different-windows`); their losses and ΔP are not measured on the same tokens:", ""]
            lines += [f"- {line}" for line in differences]
        else:
            lines += ["", "Every run was measured on the same windows (the same token ids)."]
    return lines + [""]


def _claims_section(runs: Sequence[DepthAnalysis], claims: Sequence[ClaimResult],
                    groups: Sequence[str] | None) -> list[str]:
    found = configurations(runs, groups)
    if all(len(c.runs) == 1 for c in found):
        grouping = "Each run is its own configuration (no two runs are taken as seeds of one)."
    else:
        grouping = "Configurations (their runs are taken as seeds; verdicts compare seed means): " + "; ".join(
            f"{c.title}: {', '.join(r.name for r in c.runs)}" for c in found) + "."
    lines = ["## The paper's claims, checked", "",
             f"Each verdict is computed from the runs above. {grouping} See docs/depth_analysis.md for how each "
             "statistic is defined.", ""]
    if claims:
        lines += [*claims_table(claims), ""]
    others = unclaimed(runs)
    if others:
        lines += ["Not in any claim: " + ", ".join(f"{r.name} ({r.norm_scheme})" for r in others)
                  + ". The paper's claims are about Pre-LN and LayerNorm Scaling; their figures are "
                  "in the summary and per-layer tables.", ""]
    return lines


def markdown_report(runs: Sequence[DepthAnalysis], plots: Sequence[str],
                    claims: Sequence[ClaimResult] = (), groups: Sequence[str] | None = None) -> str:
    title = " vs ".join(r.name for r in runs)
    lines = [f"# Depth analysis: {title}", "",
             "ΔP(l): increase of the validation loss when layer l alone is replaced by the identity (↓: the "
             "loss falls when it is removed). d(l, l+1): mean angular distance (arccos of the cosine similarity "
             "/ π) between the residual stream entering layer l and entering layer l + 1. Variance: of layer "
             "l's output, over all tokens and channels.", "", "## Summary", "", *_summary_table(runs), "",
             *_windows_section(runs)]
    if claims or unclaimed(runs):
        lines += _claims_section(runs, claims, groups)
    for name in plots:
        lines += [f"![{name}]({name})", ""]
    lines += ["## Per layer", "", *_per_layer_table(runs), ""]
    if not plots:
        lines += ["(Install matplotlib for the plots: `pip install matplotlib`.)", ""]
    return "\n".join(lines)


def write_report(runs: Sequence[DepthAnalysis], out_dir: str | Path, plots: bool = True,
                 claims: Sequence[ClaimResult] | None = None, groups: Sequence[str] | None = None) -> Path:
    """Write every output for one or more runs; returns the Markdown report's path. ``groups``: one
    configuration label per run (``claims.configurations``; default: each run its own). ``claims``
    defaults to every claim the runs can test (``claims.evaluate_claims`` with those groups)."""
    if not runs:
        raise ValueError("no analyses to report")
    if len({file_stem(r.name) for r in runs}) != len(runs):
        raise ValueError(f"run names must differ: {[r.name for r in runs]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    claims = evaluate_claims(runs, groups=groups) if claims is None else claims
    record = {"runs": [r.to_dict() for r in runs], "claims": [c.to_dict() for c in claims],
              "configurations": {c.label: [r.name for r in c.runs] for c in configurations(runs, groups)},
              "window_differences": window_differences([(r.name, r.windows) for r in runs]) if len(runs) > 1 else []}
    (out_dir / "depth_analysis.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    for run in runs:
        write_csvs(run, out_dir)
    plot_names = write_plots(runs, out_dir) if plots else []
    report = out_dir / "report.md"
    report.write_text(markdown_report(runs, plot_names, claims, groups), encoding="utf-8")
    logger.info("depth report written to %s", report)
    return report
