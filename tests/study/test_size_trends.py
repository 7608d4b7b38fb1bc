"""The claims against model size (lnstrain/study/size_trends.py, size_report.py): the fit, its interval
and verdicts on hand-made numbers, then a whole `collect` of the depth-width study on synthetic
analyses of known trends, regenerated from its archive in a session without the checkpoints."""

import csv
import math
import re
from pathlib import Path

import pytest
import scipy.stats  # the independent reference for the fits (setup.py's test extra installs it)

from lnstrain.analysis.depth_analysis import DepthAnalysis, summarize
from lnstrain.analysis.pruning import EvalResult, LayerPruning
from lnstrain.study import depth as study_depth
from lnstrain.study.depth import collect_depth
from lnstrain.study.plan import plan_study
from lnstrain.study.size_trends import SizePoint, Trend, fit_trend, t_quantile_975
from lnstrain.config.loader import ConfigError
from lnstrain.study.spec import load_study
from lnstrain.testing.tiny_corpus import build_tiny_corpus

REPO = Path(__file__).resolve().parents[2]


def _trend(points: dict[int, list[float]], sign: int = 1) -> Trend:
    series = [SizePoint(f"s{x}", x, 1000 * x, list(range(len(v))), v, v) for x, v in points.items()]
    return fit_trend(Trend("", "depth", "claim", "lns", "g", sign, series))


def test_t_quantiles_agree_with_scipy():
    stats = scipy.stats
    for dof in (1, 2, 3, 7, 30, 31, 60, 500):
        assert t_quantile_975(dof) == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_slope_and_interval_agree_with_an_independent_fit():
    stats = scipy.stats
    points = {8: [-0.81, -0.77], 16: [-0.62, -0.57], 32: [-0.41, -0.44], 48: [-0.30]}
    trend = _trend(points)
    xs = [math.log2(x) for x, v in points.items() for _ in v]
    ys = [y for v in points.values() for y in v]
    reference = stats.linregress(xs, ys)
    half = stats.t.ppf(0.975, len(xs) - 2) * reference.stderr
    assert trend.n == 7 and trend.slope == pytest.approx(reference.slope, rel=1e-12)
    assert (trend.slope_low, trend.slope_high) == pytest.approx((reference.slope - half, reference.slope + half), rel=1e-4)
    assert trend.verdict == "narrows"  # negative gap, positive slope: towards zero
    assert trend.crossing is not None and not trend.crossing.inside and trend.crossing.beyond > 1
    # zero where the fitted line is: intercept + slope * log2(x) = 0
    assert math.log2(trend.crossing.axis_value) == pytest.approx(-reference.intercept / reference.slope, rel=1e-9)
    assert trend.crossing.low < trend.crossing.axis_value < trend.crossing.high
    assert trend.crossing.parameters == pytest.approx(1000 * trend.crossing.axis_value, rel=1e-9)  # N ∝ axis here


@pytest.mark.parametrize("points, verdict, crossing", [
    ({8: [0.2], 16: [0.4], 32: [0.61], 64: [0.79]}, "widens", False),       # positive and growing
    ({8: [-0.2], 16: [-0.41], 32: [-0.6], 64: [-0.8]}, "widens", False),    # negative and falling
    ({8: [0.3, 0.5], 16: [0.6, 0.2], 32: [0.4, 0.45]}, "holds", False),     # seed noise only
    ({8: [-0.2], 16: [0.01], 32: [0.2], 64: [0.41]}, "turns", True),        # crosses inside the range
    ({8: [-0.3, 0.3], 16: [-0.2, 0.25], 32: [0.2, -0.1]}, "holds", True),   # ... with no slope to speak of
    ({8: [0.3], 16: [0.4]}, "too few points", False),
    ({8: [0.3, 0.4, 0.5]}, "too few points", False),                       # one size
])
def test_trend_verdicts(points, verdict, crossing):
    trend = _trend(points)
    assert trend.verdict == verdict
    assert (trend.crossing is not None) == crossing
    if verdict == "turns":
        assert trend.crossing.inside and trend.crossing.axis_value == pytest.approx(2 ** 4, rel=0.05)
        assert trend.crossing.low < trend.crossing.axis_value < trend.crossing.high
    elif crossing:
        assert trend.crossing.low is None and trend.crossing.high is None  # unbounded: the interval holds 0


def layered(name: str, scheme: str, layers: int, *, deep: float, loss: float, growth: float,
            neighbour_deep: float) -> DepthAnalysis:
    """An analysis of ``layers`` layers: ΔP 1.0 in the shallow half and ``deep`` in the deep half,
    output variance rising linearly from 1 (layer 1) to ``growth`` (layer L), d(l, l+1) 0.3 in the shallow
    half and ``neighbour_deep`` in the deep half."""
    shallow = layers - layers // 2
    delta = [1.0] * shallow + [deep] * (layers // 2)
    variance = [1.0] + [1.0 + (growth - 1.0) * (layer - 1) / (layers - 1) for layer in range(1, layers + 1)]
    angular = [[0.0] * (layers + 1) for _ in range(layers + 1)]
    for layer in range(1, layers + 1):
        angular[layer - 1][layer] = angular[layer][layer - 1] = 0.3 if layer <= shallow else neighbour_deep
    pruning = [LayerPruning(layer=n, result=EvalResult(loss + d, 0.0, 100), delta_loss=d, delta_perplexity=0.0)
               for n, d in enumerate(delta, 1)]
    return DepthAnalysis(name=name, num_layers=layers, norm_scheme=scheme, validation_tokens=100,
                         output_variance=variance, angular_distance=angular, baseline=EvalResult(loss, 0.0, 100),
                         pruning=pruning, summary=summarize(pruning))


def fake_analysis(step_dir, depth, name, trust):
    """Known trends over depth (layers L) and width (read from the run's config): LNS's deep-half ΔP
    relative to Pre-LN's is -0.8 at 8 layers and rises 0.2 a doubling (zero at 128 layers); the loss
    gap is -0.05 nats everywhere; Pre-LN's variance growth is L / 2, LNS's 2. Seed 1235 moves LNS's
    relative gap by +0.02."""
    scheme, seed = name.rsplit("_s", 1)
    layers, width = map(int, re.match(r"depth(\d+)x(\d+)_", step_dir.parents[1].name).groups())
    if scheme == "pre_ln":
        return layered(name, scheme, layers, deep=0.05, loss=4.0, growth=layers / 2, neighbour_deep=0.1)
    gap = -0.8 + 0.2 * (math.log2(layers / 8) + math.log2(width / 64)) + (0.02 if seed == "1235" else 0.0)
    return layered(name, scheme, layers, deep=0.05 * (1 + gap), loss=3.95, growth=2.0, neighbour_deep=0.05)


FINISHED = ["depth8x64_{}_s1234", "depth8x64_{}_s1235", "depth16x64_{}_s1234", "depth16x64_{}_s1235",
            "depth32x64_{}_s1234", "depth48x64_{}_s1234", "depth16x128_{}_s1234"]


@pytest.mark.slow
def test_collect_reports_claims_against_size_and_regenerates_from_the_archive(tmp_path, monkeypatch):
    corpus = build_tiny_corpus(tmp_path / "corpus")
    study = load_study(REPO / "configs/studies/depth_width.yaml")
    study.spec.output_dir, study.spec.data_prefix = str(tmp_path / "session1"), str(corpus.prefix)
    study.spec.tokenizer = str(corpus.tokenizer)
    study.spec.set = [f"data.valid_sources=[{{prefix: {corpus.prefix}}}]"]
    study.spec.depth.data, study.spec.depth.archive = str(corpus.prefix), str(tmp_path / "archive")
    monkeypatch.setattr(study_depth, "analyse_checkpoint", fake_analysis)
    monkeypatch.setattr("lnstrain.checkpoint.metadata.is_complete", lambda step_dir: True)
    planned = plan_study(study)
    finished = {pattern.format(scheme) for pattern in FINISHED for scheme in ("pre_ln", "lns")}
    for p in planned:
        if p.run.name in finished:
            (p.config.checkpoint_dir / f"global_step{p.config.total_steps}").mkdir(parents=True)
    partial = next(p for p in planned if p.run.name == "depth48x64_lns_s1235")
    (partial.config.checkpoint_dir / "global_step1200").mkdir(parents=True)

    files = collect_depth(study, planned)
    report = files["depth report"].read_text()
    depth_section = report.split("### Depth (")[1].split("### Width (")[0]
    row = next(line for line in depth_section.splitlines() if line.startswith("| `lns_deep_layers_matter_more` | lns | ("))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[3:7] == ["-0.790 (-0.800, -0.780)", "-0.590 (-0.600, -0.580)", "-0.400", "-0.283"]
    assert cells[8] == "narrows" and cells[9].startswith("1")  # zero at ~128 layers (seed jitter moves it a little)
    slope = float(cells[7].split(" (")[0])
    assert slope == pytest.approx(0.2, abs=0.01)
    assert "| `lns_deep_layers_matter_more` | lns | ✗ | ✗ | ✗ | ✗ | never |" in depth_section
    assert "| `lns_curbs_variance_growth` | lns | ln(LNS ratio / Pre-LN ratio) (< 0) |" in depth_section
    curbs = next(line for line in depth_section.splitlines() if line.startswith("| `lns_curbs_variance_growth` | lns | ln"))
    assert "| widens |" in curbs  # LNS's ratio stays 2 while Pre-LN's doubles with depth
    loss = next(line for line in depth_section.splitlines() if line.startswith("| `lns_lowers_loss` | lns | LNS"))
    assert "| holds |" in loss
    note = next(line for line in depth_section.splitlines() if line.startswith("- `lns_deep_layers_matter_more`"))
    assert "the largest size measured (48 layers)" in note and "An extrapolation of a straight line" in note
    assert "non-embedding parameters along this axis" in note

    width_section = report.split("### Width (")[1]
    assert "| `lns_deep_layers_matter_more` | lns | ✗ | ✗ | – | never |" in width_section
    # no seed spread in the near-identity counts (all 0), and a tie is within it; the loss gap lies outside its 0
    assert "- depth16x128: second seed called for by `lns_fewer_near_identity_layers`" in report
    runs = report.split("### Runs")[1]
    assert "| depth16x64_lns_s1235 | 2,400 | 2,457,600 | finished, analysed at step 2400 |" in runs
    assert "| depth48x64_lns_s1235 | 7,200 | 7,372,800 | not finished: last checkpoint at step 1200 of 7200 |" in runs
    assert "| depth16x192_pre_ln_s1234 | 21,562 | 22,079,488 | not run (no checkpoint here, none archived) |" in runs
    with open(files["size trends"]) as handle:
        rows = list(csv.DictReader(handle))
    assert {r["axis"] for r in rows} == {"depth", "width"}
    assert len([r for r in rows if r["claim"] == "lns_lowers_loss" and r["axis"] == "depth"]) == 6  # per seed
    assert (tmp_path / "session1/_study/depth/size_trend_depth.png").is_file()

    # another session: no checkpoints, no earlier collect; the archive gives the same size section
    monkeypatch.setattr(study_depth, "analyse_checkpoint", lambda *a: pytest.fail("measured again"))
    study.spec.output_dir = str(tmp_path / "session2")
    again = collect_depth(study, plan_study(study))["depth report"].read_text()
    size_part = report.split("## The claims against model size")[1].split("### Runs")[0]
    assert again.split("## The claims against model size")[1].split("### Runs")[0] == size_part
    assert "| depth16x64_lns_s1235 | 2,400 | 2,457,600 | finished, analysed at step 2400 (read from the archive) |" in again
    assert "| depth48x64_lns_s1235 | 7,200 | 7,372,800 | not run (no checkpoint here, none archived) |" in again


@pytest.mark.slow
def test_another_studys_point_is_shown_beside_a_trend_and_not_fitted(tmp_path, monkeypatch):
    """depth.beside: the GPU point (12 x 768) beside the width trend, its g in a table of its own and set
    against the width line extrapolated to 768; the fit itself is the same with and without it."""
    corpus = build_tiny_corpus(tmp_path / "corpus")
    gpu_file = tmp_path / "gpu.yaml"
    gpu_file.write_text((REPO / "configs/studies/depth_width_gpu.yaml").read_text()
                        .replace("../recipes/", f"{REPO}/configs/recipes/")
                        .replace("output_dir: depth_study/depth_width_gpu", f"output_dir: {tmp_path / 'gpu_runs'}")
                        .replace("archive: docs/depth_study/depth_width_gpu", f"archive: {tmp_path / 'gpu_archive'}")
                        .replace("data: depth_study/data/valid", f"data: {corpus.prefix}")
                        + f"sizes_dir: {REPO}/configs/sizes\nschemes_dir: {REPO}/configs/schemes\n"
                        + f"set: ['data.valid_sources=[{{prefix: {corpus.prefix}}}]']\n")
    study = load_study(REPO / "configs/studies/depth_width.yaml")
    study.spec.output_dir, study.spec.data_prefix = str(tmp_path / "runs"), str(corpus.prefix)
    study.spec.tokenizer = str(corpus.tokenizer)
    study.spec.set = [f"data.valid_sources=[{{prefix: {corpus.prefix}}}]"]
    study.spec.depth.data, study.spec.depth.archive = str(corpus.prefix), str(tmp_path / "archive")
    study.spec.depth.beside = {"width": [str(gpu_file)]}
    monkeypatch.setattr(study_depth, "analyse_checkpoint", fake_analysis)
    monkeypatch.setattr("lnstrain.checkpoint.metadata.is_complete", lambda step_dir: True)
    gpu = load_study(gpu_file)
    gpu.spec.data_prefix = str(corpus.prefix)
    monkeypatch.setattr(study_depth, "load_study", lambda path: gpu if Path(path) == gpu_file else load_study(path))
    for p in [*plan_study(study), *plan_study(gpu)]:
        if p.run.name.startswith(("depth16x64_", "depth16x128_", "depth12x768_")):
            (p.config.checkpoint_dir / f"global_step{p.config.total_steps}").mkdir(parents=True)

    report = collect_depth(study, plan_study(study))["depth report"].read_text()
    width_section = report.split("### Width (")[1].split("### Runs")[0]
    assert "depth12x768 (768 width, 85M non-embedding parameters, 0.17 tokens per parameter)" in width_section
    row = next(line for line in width_section.splitlines()
               if line.startswith("| `lns_deep_layers_matter_more` | lns | ") and line.count("|") == 5)
    measured, line_at_768 = (float(cell) for cell in row.split("|")[3:5])
    # fake_analysis: g = -0.8 + 0.2 (log2(L / 8) + log2(w / 64)) (+0.02 for seed 1235)
    assert measured == pytest.approx(-0.8 + 0.2 * (math.log2(12 / 8) + math.log2(768 / 64)), abs=1e-3)
    assert line_at_768 == pytest.approx(-0.6 + 0.2 * math.log2(12) + 0.01 * 2 / 3, abs=0.02)
    fits = (tmp_path / "runs/_study/depth/size_trend_fits.csv").read_text()
    study.spec.depth.beside = {}
    study.spec.output_dir = str(tmp_path / "runs_alone")
    collect_depth(study, plan_study(study))
    assert (tmp_path / "runs_alone/_study/depth/size_trend_fits.csv").read_text() == fits


def test_a_beside_study_must_name_a_size_axis_and_exist(tmp_path):
    text = (REPO / "configs/studies/depth_width.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("recipe: ../recipes/", f"recipe: {REPO}/configs/recipes/")
                   .replace("sizes_dir", "sizes_dir") + f"sizes_dir: {REPO}/configs/sizes\nschemes_dir: {REPO}/configs/schemes\n")
    bad.write_text(bad.read_text().replace("    width: [depth_width_gpu.yaml]\n", "    height: [nowhere.yaml]\n"))
    with pytest.raises(ConfigError) as error:
        load_study(bad)
    message = str(error.value)
    assert "depth.beside: axis 'height' is not one of depth.size_axes" in message
    assert "depth.beside.height: study file not found" in message
