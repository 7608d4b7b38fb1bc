"""``collect`` of a study with a ``depth`` section: the depth analysis of each run's checkpoints, the
paper's claims for every (size, variant, training length), and where each claim's verdict turns.

Files under ``<output_dir>/_study/depth/``:

    runs/<run>/step<N>/           one checkpoint's analysis (depth_analysis.json, CSVs; reused when present)
                                  (and, with ``depth.archive``, a copy kept with the study: ``depth_archive``)
    compare/<size>_<variant>/step<N>/   the schemes side by side, with the claim table (report.md)
    claims.csv                    one row per (size, variant, step, claim, scheme): values and verdict
    layers.csv                    one row per (run, step, layer): ΔP, variance, d(l, l+1), norm gains
    report.md                     per size and variant: verdicts against training tokens, where they turn,
                                  the deep half's mean ΔP, the validation loss and each downstream task
                                  (where ``<run dir>/downstream/step<N>.json`` exists) against tokens;
                                  plots beside it (matplotlib)

Runs of one scheme with different seeds are seeds of one configuration (``claims.evaluate_claims``
with each run's scheme as its group).
A checkpoint that is missing (the run is shorter, or not there yet) is skipped and listed.
"""

from __future__ import annotations

import csv
import logging
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lnstrain.analysis.claims import (ClaimResult, deep_half_mean_delta_loss, deep_layers, evaluate_claims,
                                      turning_step, verdict_mark)
from lnstrain.analysis.depth_analysis import DepthAnalysis, analyze_model
from lnstrain.analysis.report import read_analyses, write_report
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.verifier import Trust
from lnstrain.config.run_config import Config
from lnstrain.evaluation.results import run_headlines
from lnstrain.study.depth_archive import DepthArchive, open_archive, run_hashes
from lnstrain.study.plan import PlannedRun, plan_study
from lnstrain.study.spec import DepthCollection, Study, load_study

logger = logging.getLogger(__name__)


@dataclass
class CheckpointAnalysis:
    """One run's analysis at one checkpoint."""

    run: PlannedRun
    step: int
    tokens: int
    analysis: DepthAnalysis


@dataclass
class Comparison:
    """The schemes (and seeds) of one size and variant at one training length."""

    size: str
    variant: str
    step: int
    tokens: int
    members: list[CheckpointAnalysis]
    claims: list[ClaimResult]

    @property
    def label(self) -> str:
        return f"{self.size}_{self.variant}" if self.variant else self.size


def analysis_steps(depth: DepthCollection, total_steps: int) -> list[int]:
    """The checkpoints to analyse in a run of ``total_steps`` steps."""
    return sorted({step for step in depth.steps if step <= total_steps}) if depth.steps else [total_steps]


def analyse_checkpoint(step_dir: Path, depth: DepthCollection, name: str, trust: Trust) -> DepthAnalysis:
    """Depth analysis of one checkpoint on the study's validation data, read under ``trust`` (the run's
    own: its signing key and opt-ins)."""
    from lnstrain.analysis.eval_data import token_file_windows
    from lnstrain.analysis.model_loading import load_for_analysis

    config, model = load_for_analysis(checkpoint=str(step_dir), trust=trust)
    windows = token_file_windows(depth.data, config.data.seq_len, depth.num_samples, depth.batch_size,
                                 config.model.vocab_size)
    return analyze_model(model, windows.batches, name=name, windows=windows.record)


TRAINED_AS_FILE = "trained_as.txt"
"""Beside an analysis an earlier ``collect`` computed: the ``trained_as`` of the run it measured."""


def _local_trained_as(out_dir: Path) -> str | None:
    try:
        return (out_dir / TRAINED_AS_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def run_trust(config: Config) -> Trust:
    """What the run itself would accept on resume: its signing key and its opt-ins."""
    return Trust.from_config(config.checkpoint, [config.run.dir, config.checkpoint_dir])


def run_analyses(study: Study, planned: Sequence[PlannedRun], archive: DepthArchive | None = None,
                 refused: list[tuple[str, int, str]] | None = None
                 ) -> tuple[list[CheckpointAnalysis], list[tuple[str, int]]]:
    """Every available analysis (read back from an earlier collect of the same run, as ``trained_as``
    says, or from the archive, or computed), and what is missing. Each analysis found or computed here
    is also stored in the archive. A checkpoint the run's trust refuses is listed in ``refused``
    (run, step, why), not analysed."""
    from lnstrain.checkpoint.metadata import is_complete

    depth, found, missing = study.spec.depth, [], []
    refused = [] if refused is None else refused
    root = study.output_dir / "_study" / "depth" / "runs"
    for p in planned:
        config = p.config
        hashes = run_hashes(config)  # hashes the run's data, when it is here: once per run
        trained = hashes.trained_as  # None: an earlier analysis here cannot be checked, and is taken as it is
        for step in analysis_steps(depth, config.total_steps):
            step_dir = config.checkpoint_dir / f"global_step{step}"
            out_dir = root / p.run.name / f"step{step}"
            name = f"{p.run.scheme}_s{p.run.seed}"
            archived = archive.load(p.run.name, step, hashes) if archive else None
            if (out_dir / "depth_analysis.json").is_file() and trained in (None, _local_trained_as(out_dir)):
                [analysis] = read_analyses(out_dir)
            elif archived is not None:
                analysis = archived
                archive.read.append(f"{p.run.name} step {step}")
            elif step_dir.is_dir() and is_complete(step_dir):
                logger.info("%s: depth analysis of step %d", p.run.name, step)
                try:
                    analysis = analyse_checkpoint(step_dir, depth, name, run_trust(config))
                except CheckpointError as error:
                    logger.error("%s step %d: not analysed: %s", p.run.name, step, error)
                    refused.append((p.run.name, step, str(error)))
                    continue
                write_report([analysis], out_dir, plots=False)
                if trained:
                    (out_dir / TRAINED_AS_FILE).write_text(trained + "\n", encoding="utf-8")
            else:
                missing.append((p.run.name, step))
                continue
            if archive and archived is None:
                archive.store(p.run.name, step, hashes, analysis)
            found.append(CheckpointAnalysis(p, step, step * config.tokens_per_step, analysis))
    return found, missing


def beside_analyses(study: Study) -> dict[str, list[CheckpointAnalysis]]:
    """Axis -> the analyses of the studies ``depth.beside`` names for it (as their own ``collect`` finds
    them: measured, kept by an earlier collect, or read from their archive)."""
    found: dict[str, list[CheckpointAnalysis]] = defaultdict(list)
    for axis, files in study.spec.depth.beside.items():
        for file in files:
            other = load_study(study.path(file))
            if other.spec.depth is None:
                logger.warning("%s has no depth section: nothing of it is shown beside the %s trend", file, axis)
                continue
            planned = [p for p in plan_study(other) if not p.error]
            analyses, _ = run_analyses(other, planned, open_archive(other.spec.depth))
            found[axis] += analyses
    return dict(found)


def compare(study: Study, analyses: Sequence[CheckpointAnalysis]) -> list[Comparison]:
    """Group by (size, variant, step), evaluate the claims, write each group's side-by-side report."""
    groups: dict[tuple[str, str, int], list[CheckpointAnalysis]] = defaultdict(list)
    for a in analyses:
        groups[(a.run.run.size, a.run.run.variant, a.step)].append(a)
    comparisons = []
    root = study.output_dir / "_study" / "depth" / "compare"
    for (size, variant, step), members in groups.items():
        runs = [m.analysis for m in members]
        by_scheme = [run.norm_scheme for run in runs]  # a scheme's runs are seeds of one configuration
        claims = evaluate_claims(runs, reference=study.spec.depth.reference, groups=by_scheme)
        comparison = Comparison(size, variant, step, members[0].tokens, members, claims)
        write_report(runs, root / comparison.label / f"step{step}", plots=False, claims=claims, groups=by_scheme)
        comparisons.append(comparison)
    order = {(s, v): i for i, (s, v) in enumerate(dict.fromkeys((a.run.run.size, a.run.run.variant) for a in analyses))}
    return sorted(comparisons, key=lambda c: (order[(c.size, c.variant)], c.step))


CLAIM_COLUMNS = ["size", "variant", "step", "tokens", "claim", "scheme", "statistic", "expected", "subject_mean",
                 "reference_mean", "threshold", "difference", "holds", "verdict", "seeds", "beyond_seed_spread",
                 "values"]
LAYER_COLUMNS = ["run", "size", "variant", "scheme", "seed", "step", "tokens", "layer", "delta_loss",
                 "output_variance", "neighbour_distance", "attention_norm_gain", "mlp_norm_gain"]


def write_claims_csv(comparisons: Sequence[Comparison], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CLAIM_COLUMNS)
        writer.writeheader()
        for c in comparisons:
            for r in c.claims:
                writer.writerow({
                    "size": c.size, "variant": c.variant, "step": c.step, "tokens": c.tokens, "claim": r.id,
                    "scheme": r.scheme, "statistic": r.statistic, "expected": r.expected,
                    "subject_mean": r.subject.mean if r.subject else "",
                    "reference_mean": r.reference.mean if r.reference else "",
                    "threshold": "" if r.threshold is None else r.threshold,
                    "difference": "" if r.difference is None else r.difference, "holds": r.holds,
                    "verdict": r.verdict, "seeds": r.seeds, "beyond_seed_spread": r.beyond_seed_spread,
                    "values": "; ".join(f"{v.name}={v.value:.6g}" for v in r.runs)})


def write_layers_csv(analyses: Sequence[CheckpointAnalysis], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=LAYER_COLUMNS)
        writer.writeheader()
        for a in analyses:
            run, analysis = a.run.run, a.analysis
            for p in analysis.pruning:
                gains = analysis.norm_gains[p.layer - 1] if analysis.norm_gains else ["", ""]
                writer.writerow({
                    "run": run.name, "size": run.size, "variant": run.variant, "scheme": run.scheme, "seed": run.seed,
                    "step": a.step, "tokens": a.tokens, "layer": p.layer, "delta_loss": p.delta_loss,
                    "output_variance": analysis.output_variance[p.layer],
                    "neighbour_distance": analysis.angular_distance[p.layer - 1][p.layer],
                    "attention_norm_gain": gains[0], "mlp_norm_gain": gains[1]})


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def verdict_tables(comparisons: Sequence[Comparison]) -> list[str]:
    """Per size and variant: each claim's verdict against training tokens, and where it turns."""
    lines = []
    by_series: dict[str, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        by_series[c.label].append(c)
    for label, series in by_series.items():
        lines += [f"### {label}", "", "| claim | scheme | " + " | ".join(_tokens(c.tokens) for c in series)
                  + " | holds from |", "|---|---|" + "---|" * (len(series) + 1)]
        keys = list(dict.fromkeys((r.id, r.scheme) for c in series for r in c.claims))
        for claim_id, scheme in keys:
            cells, verdicts = [], []
            for c in series:
                result = next((r for r in c.claims if (r.id, r.scheme) == (claim_id, scheme)), None)
                cells.append("–" if result is None else verdict_mark(result))
                verdicts.append((c.step, None if result is None else result.holds))
            turn = turning_step(verdicts)
            if all(holds is None for _, holds in verdicts):
                turned = "–"
            else:
                turned = "never" if turn is None else _tokens(next(c.tokens for c in series if c.step == turn))
            lines.append(f"| `{claim_id}` | {scheme} | " + " | ".join(cells) + f" | {turned} |")
        lines.append("")
        for title, statistic in SERIES_STATISTICS:
            lines += series_table(series, title, statistic)
        lines += downstream_tables(series)
    return lines


def deep_half_mean_gain(analysis: DepthAnalysis) -> float | None:
    """Mean effective pre-sublayer norm gain (attention and MLP) of the deepest half's layers."""
    if not analysis.norm_gains:
        return None
    return statistics.fmean(gain for layer in deep_layers(analysis.num_layers)
                            for gain in analysis.norm_gains[layer - 1])


SERIES_STATISTICS: list[tuple[str, Callable[[CheckpointAnalysis], float | None]]] = [
    ("Mean ΔP of the deepest half (nats", lambda member: deep_half_mean_delta_loss(member.analysis)),
    ("Mean effective pre-sublayer norm gain of the deepest half (learned gain times the scheme's factor",
     lambda member: deep_half_mean_gain(member.analysis)),
    ("Validation loss of the measured windows (nats", lambda member: member.analysis.baseline.loss),
]


def downstream_tables(series: Sequence[Comparison]) -> list[str]:
    """One table per lm-evaluation-harness task any analysed checkpoint of ``series`` was evaluated on
    (its headline metric, ``evaluation.results.headline``); – where a checkpoint was not evaluated."""
    found: dict[tuple[str, int], dict[str, tuple[str, float]]] = {}
    for c in series:
        for m in c.members:
            found[(m.run.run.name, c.step)] = run_headlines(m.run.config.run.dir, c.step)
    tasks = list(dict.fromkeys((task, metric) for scores in found.values() for task, (metric, _) in scores.items()))
    lines = []
    for task, metric in tasks:
        def score(member: CheckpointAnalysis, task: str = task, metric: str = metric) -> float | None:
            pair = found[(member.run.run.name, member.step)].get(task)
            return pair[1] if pair is not None and pair[0] == metric else None

        lines += series_table(series, f"Downstream: {task} {metric} (lm-evaluation-harness on the checkpoint", score)
    return lines


def series_table(series: Sequence[Comparison], title: str,
                 statistic: Callable[[CheckpointAnalysis], float | None]) -> list[str]:
    """One statistic per scheme (seed mean, each seed in brackets when several) against tokens."""
    schemes = list(dict.fromkeys(m.run.run.scheme for c in series for m in c.members))
    lines = [f"{title}; seeds averaged, each seed in brackets when several):", "",
             "| scheme | " + " | ".join(_tokens(c.tokens) for c in series) + " |", "|---|" + "---|" * len(series)]
    for scheme in schemes:
        cells = []
        for c in series:
            values = [statistic(m) for m in c.members if m.run.run.scheme == scheme]
            values = [v for v in values if v is not None]
            if not values:
                cells.append("–")
                continue
            cell = f"{statistics.fmean(values):.4f}"
            cells.append(cell if len(values) == 1 else cell + " (" + ", ".join(f"{v:.4f}" for v in values) + ")")
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return lines + [""]


def collect_depth(study: Study, planned: Sequence[PlannedRun]) -> dict[str, Path]:
    """Analyse, compare and report; returns the files written."""
    out_dir = study.output_dir / "_study" / "depth"
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = open_archive(study.spec.depth)
    refused: list[tuple[str, int, str]] = []
    analyses, missing = run_analyses(study, planned, archive, refused)
    comparisons = compare(study, analyses)
    files = {"claims": out_dir / "claims.csv", "layers": out_dir / "layers.csv", "depth report": out_dir / "report.md"}
    write_claims_csv(comparisons, files["claims"])
    write_layers_csv(analyses, files["layers"])
    from lnstrain.study.depth_plots import plot_depth_by_tokens

    plots = plot_depth_by_tokens(analyses, study.spec.depth.reference, out_dir)
    lines = [f"# Study '{study.spec.name}': depth analysis against training length", "",
             f"Each checkpoint measured on {study.spec.depth.num_samples} windows of {study.spec.depth.data}. "
             "✓ holds, ✗ does not hold, = tie, – not testable; ~ after a mark: the seeds do not all agree with "
             "it. \"holds from\": the first training length from which the claim holds at every later one "
             "where it is testable (– lengths are skipped). Claims and statistics: docs/depth_analysis.md.", "", *verdict_tables(comparisons)]
    lines += [f"![{path.name}]({path.name})" for path in plots] + [""]
    if study.spec.depth.size_axes:
        from lnstrain.study.size_report import size_section

        size_lines, size_files = size_section(study, planned, analyses, comparisons, archive.read if archive else [],
                                              out_dir, beside_analyses(study))
        lines += size_lines
        files.update(size_files)
    if archive and archive.read:
        lines += [f"{len(archive.read)} of these analyses were read from the archive {archive.root}, not measured "
                  "here (nor kept by an earlier collect here).", ""]
    if archive and archive.unchecked:
        trained_on, measured = archive.archive_data or ("?", "?")
        lines += [f"The study's data is not here, so {len(archive.unchecked)} of the archived analyses could not be "
                  "checked against it: each was taken because its run's settings match and it was made on the "
                  f"data most of the archive was made on (training data {trained_on[:16]}, validation data "
                  f"{measured[:16]}). Analyses made on other data are listed as not used.", ""]
    if archive and archive.stale:
        lines += [f"Not used from the archive {archive.root} (made from another config or data): "
                  + "; ".join(archive.stale), ""]
    if refused:
        lines += ["Not analysed: the run's own checkpoint checks refused these checkpoints (their trust: "
                  "`checkpoint.signing_key_file`, `allow_unverified`, `allow_pickle`):", ""]
        lines += [f"- {run} step {step}: {why}" for run, step, why in refused] + [""]
    if missing:
        by_run: dict[str, list[str]] = defaultdict(list)
        for run, step in missing:
            by_run[run].append(str(step))
        lines += ["Not analysed yet (no complete checkpoint): "
                  + "; ".join(f"{run} step {', '.join(steps)}" for run, steps in by_run.items()), ""]
    files["depth report"].write_text("\n".join(lines), encoding="utf-8")
    files.update({path.stem: path for path in plots})
    return files
