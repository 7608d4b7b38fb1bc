"""``collect``: final validation loss and perplexity of every run, as CSV, Markdown and a plot.

Each run's result comes from ``lnstrain.study.results.final_metrics`` (``final_metrics.json``, else
the TensorBoard ``eval/loss`` at the last step). Unfinished runs are listed as missing. The plot
(loss against parameter count, log x, one line per scheme, seeds averaged) needs matplotlib.
"""

from __future__ import annotations

import csv
import logging
from collections import defaultdict
from pathlib import Path
from statistics import mean

from lnstrain.study.plan import PlannedRun
from lnstrain.study.results import final_metrics

logger = logging.getLogger(__name__)
COLUMNS = ["run", "size", "scheme", "variant", "seed", "parameters", "non_embedding_parameters", "step", "tokens",
           "eval_loss", "eval_ppl", "status"]


def read_result(planned: PlannedRun) -> dict:
    """One CSV row for a run; ``status`` is ``done`` or ``missing``."""
    run = planned.run
    row = {"run": run.name, "size": run.size, "scheme": run.scheme, "variant": run.variant, "seed": run.seed,
           "parameters": planned.parameters, "non_embedding_parameters": planned.non_embedding_parameters,
           "step": "", "tokens": "", "eval_loss": "", "eval_ppl": "", "status": "missing"}
    metrics = final_metrics(planned.config.run.dir, planned.config.total_steps)
    if metrics:
        row.update({key: metrics[key] for key in ("step", "tokens", "eval_loss", "eval_ppl")}, status="done")
    return row


def series(row: dict) -> str:
    """The line a run belongs to: its scheme, and its variant in a study with variants."""
    return f"{row['scheme']} {row['variant']}" if row.get("variant") else row["scheme"]


def mean_by_size_and_scheme(rows: list[dict]) -> dict[tuple[str, str], tuple[int, float, float]]:
    """(size, series) -> (parameters, mean loss, mean perplexity) over the finished seeds."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["status"] == "done":
            groups[(row["size"], series(row))].append(row)
    return {key: (group[0]["parameters"], mean(r["eval_loss"] for r in group), mean(r["eval_ppl"] for r in group))
            for key, group in groups.items()}


def markdown_table(rows: list[dict], sizes: list[str], schemes: list[str]) -> str:
    """Perplexity by size (rows) and scheme (columns), seeds averaged, then every run."""
    means = mean_by_size_and_scheme(rows)
    params = {r["size"]: r["parameters"] for r in rows}
    lines = ["| size | parameters | " + " | ".join(f"{s} ppl" for s in schemes) + " |",
             "|---|---|" + "---|" * len(schemes)]
    for size in sizes:
        cells = [f"{means[(size, s)][2]:.2f}" if (size, s) in means else "—" for s in schemes]
        millions = params[size] / 1e6
        shown = f"{millions:,.0f}M" if millions >= 100 else f"{millions:.3g}M"  # the depth studies' sizes are < 10M
        lines.append(f"| {size} | {shown} | " + " | ".join(cells) + " |")
    lines += ["", "| run | eval loss | eval ppl | tokens | status |", "|---|---|---|---|---|"]
    for r in rows:
        loss = f"{r['eval_loss']:.4f}" if r["status"] == "done" else "—"
        ppl = f"{r['eval_ppl']:.2f}" if r["status"] == "done" else "—"
        lines.append(f"| {r['run']} | {loss} | {ppl} | {r['tokens']} | {r['status']} |")
    return "\n".join(lines) + "\n"


def plot_scaling(rows: list[dict], schemes: list[str], path: Path, title: str) -> bool:
    """Loss against parameters (log x), one line per scheme; False (and a log line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed, so no plot was drawn: pip install matplotlib")
        return False
    means = mean_by_size_and_scheme(rows)
    figure, axes = plt.subplots(figsize=(6, 4))
    for scheme in schemes:
        points = sorted((params, loss) for (size, s), (params, loss, _) in means.items() if s == scheme)
        if points:
            axes.plot([p for p, _ in points], [l for _, l in points], marker="o", label=scheme)
    axes.set_xscale("log")
    axes.set_xlabel("parameters")
    axes.set_ylabel("final validation loss")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)
    return True


def collect_results(planned: list[PlannedRun], out_dir: Path, sizes: list[str], schemes: list[str],
                    title: str) -> tuple[list[dict], dict[str, Path]]:
    """Write results.csv, results.md and (with matplotlib) scaling.png under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [read_result(p) for p in planned]
    schemes = list(dict.fromkeys(series(row) for row in rows)) if any(r["variant"] for r in rows) else schemes
    files = {"csv": out_dir / "results.csv", "markdown": out_dir / "results.md"}
    with open(files["csv"], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    files["markdown"].write_text(f"# {title}\n\n" + markdown_table(rows, sizes, schemes), encoding="utf-8")
    if plot_scaling(rows, schemes, out_dir / "scaling.png", title):
        files["plot"] = out_dir / "scaling.png"
    return rows, files
