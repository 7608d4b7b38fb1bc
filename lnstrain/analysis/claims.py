"""The LNS paper's claims, each with a verdict computed from depth analyses.

A claim is one statistic of a run (the last/first-layer variance ratio, the mean ΔP of the deepest
half, ...) and the direction the paper expects it to take: against a fixed value within one scheme
(``pre_ln_variance_grows``: Pre-LN's ratio > 1), or between schemes (``lns_curbs_variance_growth``:
LNS's ratio < Pre-LN's). Claims are made about configurations: each run is its own, unless the caller
groups runs (``groups``: runs with one label are seeds of one configuration, and must share a norm
scheme). A claim within one scheme is evaluated for every configuration of that scheme, a claim
between schemes for every pair of configurations; the verdict compares seed means, and with several
seeds on each side it also says whether every seed lies on the expected side of every other
(``beyond_seed_spread``). A run whose scheme no claim is about (a sandwich or output norm placement
of an open model) is in no claim: ``unclaimed``.

Verdicts are computed, never written in advance: ``holds`` (the expected direction, strictly),
``does not hold`` (the opposite direction), ``tie`` (equal to within ``TIE_TOLERANCE``, which
integer counts often are) or ``not testable`` (the runs lack a scheme the claim needs).

Comparative claims are evaluated for every scheme of the LNS family present (``lns`` and its
variants ``lns_after_sublayer``, ``lns_gain_init``), each standing where the paper has LNS; the
entry's ``scheme`` names which.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lnstrain.analysis.depth_analysis import DepthAnalysis

REFERENCE_SCHEME = "pre_ln"
LNS_FAMILY = ("lns", "lns_after_sublayer", "lns_gain_init")
TIE_TOLERANCE = 1e-9
"""Relative (and absolute, near zero) difference under which two statistics count as equal."""


def deep_layers(num_layers: int) -> range:
    """The deepest floor(L / 2) layers, 1-based (the half the depth summary calls deep)."""
    return range(num_layers - num_layers // 2 + 1, num_layers + 1)


def shallow_layers(num_layers: int) -> range:
    return range(1, num_layers - num_layers // 2 + 1)


def variance_growth(run: DepthAnalysis) -> float:
    """Output variance of the last layer over that of the first."""
    return run.output_variance[-1] / max(run.output_variance[1], 1e-30)


def validation_loss(run: DepthAnalysis) -> float:
    return run.baseline.loss


def deep_half_mean_delta_loss(run: DepthAnalysis) -> float:
    """Mean ΔP (validation-loss increase, nats) over the deepest half's layers, each removed alone."""
    return statistics.fmean(run.pruning[layer - 1].delta_loss for layer in deep_layers(run.num_layers))


def deep_half_share(run: DepthAnalysis) -> float:
    return run.summary.deep_half_share


def near_identity_layers(run: DepthAnalysis) -> float:
    return float(run.summary.num_near_identity)


def _neighbour_distance(run: DepthAnalysis, layers: range) -> float:
    return statistics.fmean(run.angular_distance[layer - 1][layer] for layer in layers)


def deep_half_neighbour_distance(run: DepthAnalysis) -> float:
    """Mean angular distance d(l, l+1) between the states entering layer l and l + 1, deepest half."""
    return _neighbour_distance(run, deep_layers(run.num_layers))


def deep_over_shallow_neighbour_distance(run: DepthAnalysis) -> float:
    """Mean d(l, l+1) over the deepest half divided by the mean over the rest."""
    shallow = _neighbour_distance(run, shallow_layers(run.num_layers))
    return deep_half_neighbour_distance(run) / max(shallow, 1e-30)


@dataclass(frozen=True)
class Claim:
    """What the paper says and how it is measured.

    ``subject``: the scheme whose statistic is tested ("lns" stands for every LNS-family scheme
    present). ``against``: a scheme name (between-scheme claim) or a constant (within-scheme).
    """

    id: str
    says: str
    where: str
    statistic: str
    measure: Callable[[DepthAnalysis], float]
    relation: Literal["greater", "less"]
    subject: str
    against: str | float


CLAIMS: tuple[Claim, ...] = (
    Claim("pre_ln_variance_grows", "Pre-LN's output variance grows with depth",
          "Fig. 1, App. E", "output variance, last / first layer", variance_growth, "greater", "pre_ln", 1.0),
    Claim("lns_curbs_variance_growth", "LNS curbs the variance growth of Pre-LN",
          "Fig. 1, §4", "output variance, last / first layer", variance_growth, "less", "lns", "pre_ln"),
    Claim("lns_lowers_loss", "LNS reaches a lower loss than Pre-LN",
          "Table 1", "validation loss (nats)", validation_loss, "less", "lns", "pre_ln"),
    Claim("pre_ln_deep_layers_matter_less", "removing a deep Pre-LN layer costs little; early layers carry the model",
          "Fig. 2, App. C", "share of ΔP in the deepest half", deep_half_share, "less", "pre_ln", 0.5),
    Claim("lns_deep_layers_matter_more", "under LNS, removing a deep layer costs more than under Pre-LN",
          "Fig. 4", "mean ΔP of the deepest half (nats)", deep_half_mean_delta_loss, "greater", "lns", "pre_ln"),
    Claim("lns_fewer_near_identity_layers", "fewer layers act as identity maps than under Pre-LN",
          "§4", "near-identity layers (count)", near_identity_layers, "less", "lns", "pre_ln"),
    Claim("pre_ln_deep_layers_similar", "Pre-LN's neighbouring deep layers are highly similar (small angular distance)",
          "App. C, Fig. 5b", "mean d(l, l+1), deepest half / rest", deep_over_shallow_neighbour_distance,
          "less", "pre_ln", 1.0),
    Claim("lns_deep_layers_less_similar", "LNS improves the angular distance of deep layers",
          "App. C, App. J", "mean d(l, l+1) of the deepest half", deep_half_neighbour_distance,
          "greater", "lns", "pre_ln"),
)


@dataclass
class RunValue:
    name: str
    scheme: str
    value: float


@dataclass
class Configuration:
    """Runs taken as seeds of one configuration, under one label."""

    label: str
    scheme: str
    runs: list[DepthAnalysis]

    @property
    def title(self) -> str:
        """The label, with the scheme when the label is not the scheme's name."""
        return self.label if self.label == self.scheme else f"{self.label} ({self.scheme})"


def group_problems(names: Sequence[str], schemes: Sequence[str], groups: Sequence[str]) -> list[str]:
    """What is wrong with `groups` as configuration labels of runs with these names and norm schemes."""
    if len(groups) != len(names):
        return [f"--groups has {len(groups)} labels for {len(names)} runs (one label per run)"]
    problems = []
    for label in dict.fromkeys(groups):
        members = [(name, scheme) for name, scheme, group in zip(names, schemes, groups) if group == label]
        if len({scheme for _, scheme in members}) > 1:
            problems.append(f"group {label!r} holds runs of different norm schemes ("
                            + ", ".join(f"{name}: {scheme}" for name, scheme in members)
                            + "); seeds of one configuration share a scheme: give them different group labels")
    return problems


def configurations(runs: Sequence[DepthAnalysis], groups: Sequence[str] | None = None) -> list[Configuration]:
    """The runs' configurations in order of first appearance: one per run (labelled by its name) unless
    `groups` gives each run a label. ValueError when the labels do not fit (`group_problems`)."""
    if groups is None:
        return [Configuration(run.name, run.norm_scheme, [run]) for run in runs]
    problems = group_problems([r.name for r in runs], [r.norm_scheme for r in runs], groups)
    if problems:
        raise ValueError("; ".join(problems))
    found: dict[str, Configuration] = {}
    for label, run in zip(groups, runs):
        found.setdefault(label, Configuration(label, run.norm_scheme, [])).runs.append(run)
    return list(found.values())


@dataclass
class Spread:
    """A statistic over the runs (seeds) of one configuration."""

    scheme: str
    values: list[float]
    mean: float
    minimum: float
    maximum: float
    std: float | None
    """Sample standard deviation; None with a single run."""
    configuration: str = ""
    """The configuration's label (its scheme's name when runs are grouped by scheme)."""

    @classmethod
    def of(cls, configuration: Configuration, values: Sequence[float]) -> Spread:
        return cls(scheme=configuration.scheme, values=list(values), mean=statistics.fmean(values),
                   minimum=min(values), maximum=max(values), std=statistics.stdev(values) if len(values) > 1 else None,
                   configuration=configuration.label)


@dataclass
class ClaimResult:
    id: str
    says: str
    where: str
    statistic: str
    expected: str
    """The paper's direction, e.g. "lns < pre_ln", "pre_ln > 1" or "llama (pre_ln) > 1"."""
    scheme: str
    """The scheme tested (an LNS-family scheme standing where the paper has LNS)."""
    configuration: str
    """The label of the configuration tested."""
    reference_configuration: str | None
    """The label of the configuration compared with (between-scheme claims)."""
    runs: list[RunValue]
    subject: Spread | None
    reference: Spread | None
    """The reference scheme's spread (between-scheme claims)."""
    threshold: float | None
    """The constant compared with (within-scheme claims)."""
    difference: float | None
    """subject mean - reference mean (or - threshold)."""
    holds: bool | None
    """True when the data go the paper's way (strictly); None when not testable."""
    verdict: str
    seeds: int
    """Fewest runs on either side."""
    beyond_seed_spread: bool | None
    """With >= 2 runs on each side and no tie: whether every pair of runs (subject seed, reference
    seed or threshold) lies on the side the means do; None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _side(a: float, b: float, relation: str) -> int:
    """+1 when a is on the expected side of b, -1 on the other side, 0 for a tie."""
    if math.isclose(a, b, rel_tol=TIE_TOLERANCE, abs_tol=TIE_TOLERANCE):
        return 0
    expected = a > b if relation == "greater" else a < b
    return 1 if expected else -1


def _evaluate(claim: Claim, subject_configuration: Configuration,
              reference_configuration: Configuration | None) -> ClaimResult:
    symbol = ">" if claim.relation == "greater" else "<"
    scheme = subject_configuration.scheme
    between = isinstance(claim.against, str)
    subject_runs = subject_configuration.runs
    reference_runs = reference_configuration.runs if reference_configuration else []
    runs = [RunValue(r.name, scheme, claim.measure(r)) for r in subject_runs]
    runs += [RunValue(r.name, str(claim.against), claim.measure(r)) for r in reference_runs]
    subject = Spread.of(subject_configuration, [v.value for v in runs[:len(subject_runs)]])
    threshold = None if between else float(claim.against)
    reference = (Spread.of(reference_configuration, [v.value for v in runs[len(subject_runs):]])
                 if reference_configuration else None)
    other_side = (reference_configuration.title if reference_configuration else claim.against) if between \
        else f"{claim.against:g}"
    result = ClaimResult(id=claim.id, says=claim.says, where=claim.where, statistic=claim.statistic,
                         expected=f"{subject_configuration.title} {symbol} {other_side}", scheme=scheme,
                         configuration=subject_configuration.label,
                         reference_configuration=reference_configuration.label if reference_configuration else None,
                         runs=runs, subject=subject, reference=reference, threshold=threshold,
                         difference=None, holds=None, verdict="not testable", seeds=0, beyond_seed_spread=None)
    if between and reference is None:
        result.verdict = f"not testable: no {claim.against} run"
        return result
    other = threshold if threshold is not None else reference.mean
    result.difference = subject.mean - other
    side = _side(subject.mean, other, claim.relation)
    result.holds = side == 1
    result.verdict = {1: "holds", 0: "tie", -1: "does not hold"}[side]
    others = [threshold] if threshold is not None else reference.values
    result.seeds = len(subject.values) if threshold is not None else min(len(subject.values), len(others))
    if result.seeds >= 2 and side != 0:
        result.beyond_seed_spread = all(_side(a, b, claim.relation) == side for a in subject.values for b in others)
    return result


def evaluate_claims(runs: Sequence[DepthAnalysis], claims: Sequence[Claim] = CLAIMS,
                    reference: str = REFERENCE_SCHEME, groups: Sequence[str] | None = None) -> list[ClaimResult]:
    """Every claim for every configuration of its subject scheme present, in the order of ``claims``;
    claims about LNS for each configuration of an LNS-family scheme, against each configuration of
    ``reference`` (the paper's Pre-LN by default; claims about Pre-LN alone stay so). ``groups``: one
    configuration label per run (runs sharing one are seeds); by default each run is its own."""
    found = configurations(runs, groups)
    results = []
    for claim in claims:
        claim = dataclasses.replace(claim, against=reference) if claim.against == REFERENCE_SCHEME else claim
        schemes = LNS_FAMILY if claim.subject == "lns" else (claim.subject,)
        for subject in (c for c in found if c.scheme in schemes):
            if not isinstance(claim.against, str):
                results.append(_evaluate(claim, subject, None))
                continue
            references = [c for c in found if c.scheme == claim.against] or [None]
            results += [_evaluate(claim, subject, other) for other in references]
    return results


def unclaimed(runs: Sequence[DepthAnalysis], claims: Sequence[Claim] = CLAIMS,
              reference: str = REFERENCE_SCHEME) -> list[DepthAnalysis]:
    """The runs no claim is about: their scheme is neither a claim's subject nor the reference."""
    schemes = {reference, *LNS_FAMILY} | {c.subject for c in claims if c.subject != "lns"}
    return [run for run in runs if run.norm_scheme not in schemes]


def _values(spread: Spread | None) -> str:
    if spread is None:
        return "–"
    text = ", ".join(f"{v:.4g}" for v in spread.values)
    return text if len(spread.values) == 1 else f"{text} (mean {spread.mean:.4g})"


def verdict_mark(result: ClaimResult) -> str:
    """✓ holds, ✗ does not hold, = tie, – not testable; ~ after it when the seeds do not all agree."""
    return {"holds": "✓", "does not hold": "✗", "tie": "="}.get(result.verdict, "–") + (
        "" if result.beyond_seed_spread is not False else "~")


def turning_step(verdicts: Sequence[tuple[int, bool | None]]) -> int | None:
    """The first position (a training step, a model size) from which a claim holds at every later one
    (None: it does not hold at the last). ``verdicts``: (position, holds) in order; ``holds`` None
    (not testable there, e.g. a run not analysed yet) is skipped."""
    turn = None
    for position, holds in verdicts:
        if holds is None:
            continue
        if holds:
            turn = position if turn is None else turn
        else:
            turn = None
    return turn


def seed_text(result: ClaimResult) -> str:
    """"" for a single seed; else whether the seeds agree with the verdict."""
    if result.seeds < 2:
        return ""
    if result.beyond_seed_spread is None:
        return f"{result.seeds} seeds"
    return f"{result.seeds} seeds, {'beyond' if result.beyond_seed_spread else 'within'} their spread"


def verdict_text(result: ClaimResult) -> str:
    seeds = seed_text(result)
    return f"{result.verdict} ({seeds})" if seeds else result.verdict


def _side_values(result: ClaimResult, separator: str, joiner: str) -> str:
    """Each side's configuration and values, e.g. "lns: 4.8; pre_ln: 5.1"."""
    sides = [s for s in (result.subject, result.reference) if s is not None]
    return joiner.join(f"{side.configuration}{separator}{_values(side)}" for side in sides)


def claims_table(results: Sequence[ClaimResult]) -> list[str]:
    """A Markdown table: one row per claim and configuration (or pair of configurations)."""
    lines = ["| claim | the paper says | statistic | expected | values | verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        values = _side_values(r, ": ", "; ")
        lines.append(f"| `{r.id}` | {r.says} ({r.where}) | {r.statistic} | {r.expected} | {values} | "
                     f"{verdict_text(r)} |")
    return lines


def claims_console(results: Sequence[ClaimResult]) -> str:
    """Two lines per claim for a terminal: the verdict and claim, then the values behind it."""
    lines = []
    for r in results:
        label = r.id if r.scheme in ("lns", "pre_ln") else f"{r.id} [{r.scheme} for lns]"
        values = _side_values(r, " ", " vs ")
        seeds = seed_text(r)
        lines += [f"  {r.verdict:<14} {label}: {r.says}",
                  f"  {'':<14} {r.statistic}, expected {r.expected}: {values}" + (f"; {seeds}" if seeds else "")]
    return "\n".join(lines)
