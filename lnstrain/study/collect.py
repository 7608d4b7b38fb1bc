"""``collect``: final validation loss, perplexity and downstream accuracy of every run, as CSV,
Markdown and a plot.

Each run's result comes from ``lnstrain.study.results.final_metrics`` (``final_metrics.json``, else
the TensorBoard ``eval/loss`` at the last step). Unfinished runs are listed as missing. Beside
perplexity, each lm-evaluation-harness task evaluated on the run's final checkpoint
(``<run dir>/downstream/step<N>.json``, from ``train.eval_tasks`` or ``tools/evaluate.py``) gets a
column with its headline metric (``acc_norm``, else ``acc``, ...; ``evaluation.results.headline``),
blank where that run was not evaluated. The plot (loss against parameter count, log x, one line per
scheme, seeds averaged) needs matplotlib.
"""

from __future__ import annotations

import csv
import logging
from collections import defaultdict
from pathlib import Path
from statistics import mean

from lnstrain.evaluation.results import run_headlines
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
        for task, (metric, value) in run_headlines(planned.config.run.dir, int(metrics["step"])).items():
            row[downstream_column(task, metric)] = value
    return row


def downstream_column(task: str, metric: str) -> str:
    return f"downstream {task} {metric}"


def downstream_columns(rows: list[dict]) -> list[str]:
    """The downstream columns any run has, in the order first seen."""
    return list(dict.fromkeys(key for row in rows for key in row if key.startswith("downstream ")))


def _cell(value, digits: int) -> str:
    return "—" if value in ("", None) else f"{value:.{digits}f}"


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


def mean_downstream(rows: list[dict], size: str, scheme: str, column: str) -> float | None:
    """The mean of a downstream column over the finished seeds of (size, series) that were evaluated."""
    values = [r[column] for r in rows if r["status"] == "done" and r["size"] == size and series(r) == scheme
              and r.get(column) not in ("", None)]
    return mean(values) if values else None


def markdown_table(rows: list[dict], sizes: list[str], schemes: list[str]) -> str:
    """Perplexity (and each downstream task) by size (rows) and scheme (columns), seeds averaged, then
    every run; — where a run is missing or was not evaluated on a task."""
    means = mean_by_size_and_scheme(rows)
    params = {r["size"]: r["parameters"] for r in rows}
    downstream = downstream_columns(rows)
    headers = [f"{s} ppl" for s in schemes] + [f"{s} {c.removeprefix('downstream ')}" for c in downstream for s in schemes]
    lines = ["| size | parameters | " + " | ".join(headers) + " |", "|---|---|" + "---|" * len(headers)]
    for size in sizes:
        cells = [f"{means[(size, s)][2]:.2f}" if (size, s) in means else "—" for s in schemes]
        cells += [_cell(mean_downstream(rows, size, s, c), 4) for c in downstream for s in schemes]
        millions = params[size] / 1e6
        shown = f"{millions:,.0f}M" if millions >= 100 else f"{millions:.3g}M"  # the depth studies' sizes are < 10M
        lines.append(f"| {size} | {shown} | " + " | ".join(cells) + " |")
    titles = [c.removeprefix("downstream ") for c in downstream]
    lines += ["", "| run | eval loss | eval ppl | " + "".join(f"{t} | " for t in titles) + "tokens | status |",
              "|---|---|---|" + "---|" * len(titles) + "---|---|"]
    for r in rows:
        loss = f"{r['eval_loss']:.4f}" if r["status"] == "done" else "—"
        ppl = f"{r['eval_ppl']:.2f}" if r["status"] == "done" else "—"
        scores = "".join(f"{_cell(r.get(c), 4)} | " for c in downstream)
        lines.append(f"| {r['run']} | {loss} | {ppl} | {scores}{r['tokens']} | {r['status']} |")
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
        writer = csv.DictWriter(handle, fieldnames=COLUMNS + downstream_columns(rows), restval="")
        writer.writeheader()
        writer.writerows(rows)
    files["markdown"].write_text(f"# {title}\n\n" + markdown_table(rows, sizes, schemes), encoding="utf-8")
    if plot_scaling(rows, schemes, out_dir / "scaling.png", title):
        files["plot"] = out_dir / "scaling.png"
    return rows, files
