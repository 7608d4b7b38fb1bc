"""Claim verdicts on synthetic analyses: both directions, ties, configurations and seeds, missing
schemes, and the tool (which refuses analyses made on different windows)."""

import dataclasses
import json

import pytest

from lnstrain.analysis.claims import (CLAIMS, configurations, deep_half_mean_delta_loss, deep_half_neighbour_distance,
                                      deep_over_shallow_neighbour_distance, evaluate_claims, unclaimed, variance_growth)
from lnstrain.analysis.depth_analysis import DepthAnalysis, summarize
from lnstrain.analysis.pruning import EvalResult, LayerPruning
from lnstrain.analysis.report import write_report
from lnstrain.analysis.windows import WindowRecord
from tools.analyze_depth import main as analyze_depth

L = 4
WINDOWS = WindowRecord(seq_len=16, count=6, requested=6, start=0, source="valid.jsonl", source_kind="text",
                       source_sha256="a" * 64, tokenizer="the tokenizer of llama", tokenizer_sha256="b" * 64,
                       tokens_sha256="c" * 64)


def synthetic(name, scheme, *, loss=5.0, variance=(1.0, 1.0, 2.0, 3.0, 4.0), delta=(1.0, 0.5, 0.2, 0.1),
              neighbour=(0.4, 0.3, 0.2, 0.1), windows=WINDOWS) -> DepthAnalysis:
    """A 4-layer analysis with the given per-layer statistics (variance includes the embedding output)."""
    angular = [[0.0] * (L + 1) for _ in range(L + 1)]
    for layer, distance in enumerate(neighbour, 1):
        angular[layer - 1][layer] = angular[layer][layer - 1] = distance
    pruning = [LayerPruning(layer=n, result=EvalResult(loss + d, 0.0, 100), delta_loss=d, delta_perplexity=0.0)
               for n, d in enumerate(delta, 1)]
    return DepthAnalysis(name=name, num_layers=L, norm_scheme=scheme, validation_tokens=100,
                         output_variance=list(variance), angular_distance=angular,
                         baseline=EvalResult(loss, 0.0, 100), pruning=pruning, summary=summarize(pruning),
                         windows=windows)


def by_id(results, scheme=None):
    return {r.id: r for r in results if scheme is None or r.scheme == scheme}


def test_statistics_read_the_right_layers():
    run = synthetic("a", "pre_ln", variance=(9.0, 2.0, 1.0, 1.0, 8.0), delta=(1.0, 0.5, 0.2, 0.1),
                    neighbour=(0.4, 0.2, 0.3, 0.1))
    assert variance_growth(run) == 4.0                         # layer 4 / layer 1, not / embedding
    assert deep_half_mean_delta_loss(run) == pytest.approx(0.15)  # layers 3 and 4
    assert deep_half_neighbour_distance(run) == pytest.approx(0.2)
    assert deep_over_shallow_neighbour_distance(run) == pytest.approx(0.2 / 0.3)


def test_every_claim_holds_when_the_data_go_the_papers_way():
    pre = synthetic("pre_ln", "pre_ln", loss=5.0, variance=(1, 1, 2, 4, 8), delta=(1.0, 0.3, 0.001, 0.002),
                    neighbour=(0.4, 0.3, 0.1, 0.05))
    lns = synthetic("lns", "lns", loss=4.8, variance=(1, 1, 1.2, 1.3, 1.4), delta=(1.0, 0.3, 0.2, 0.1),
                    neighbour=(0.4, 0.3, 0.2, 0.2))
    results = evaluate_claims([pre, lns])
    assert [r.id for r in results] == [c.id for c in CLAIMS]
    assert all(r.holds for r in results), [(r.id, r.verdict) for r in results]
    curbs = by_id(results)["lns_curbs_variance_growth"]
    assert curbs.expected == "lns < pre_ln" and curbs.difference == pytest.approx(1.4 - 8.0)
    assert [(v.name, v.value) for v in curbs.runs] == [("lns", 1.4), ("pre_ln", 8.0)]
    assert curbs.seeds == 1 and curbs.beyond_seed_spread is None


def test_the_opposite_direction_does_not_hold():
    pre = synthetic("pre", "pre_ln", loss=4.5, variance=(1, 1, 1, 1, 0.5), delta=(1.0, 0.5, 0.3, 0.3))
    lns = synthetic("lns", "lns", loss=4.9, variance=(1, 1, 2, 3, 4), delta=(1.0, 0.5, 0.0, 0.0))
    results = by_id(evaluate_claims([pre, lns]))
    for claim in ("pre_ln_variance_grows", "lns_curbs_variance_growth", "lns_lowers_loss",
                  "lns_deep_layers_matter_more", "lns_fewer_near_identity_layers"):
        assert results[claim].holds is False and results[claim].verdict == "does not hold", claim
    assert results["lns_deep_layers_matter_more"].difference == pytest.approx(0.0 - 0.3)


def test_ties_are_neither_way():
    pre = synthetic("pre", "pre_ln", delta=(1.0, 0.5, 0.001, 0.001))
    lns = synthetic("lns", "lns", delta=(1.0, 0.5, 0.001, 0.001))
    results = by_id(evaluate_claims([pre, lns]))
    for claim in ("lns_lowers_loss", "lns_deep_layers_matter_more", "lns_fewer_near_identity_layers",
                  "lns_deep_layers_less_similar"):
        assert results[claim].verdict == "tie" and results[claim].holds is False, claim
    flat = synthetic("flat", "pre_ln", variance=(1, 2, 2, 2, 2))
    assert by_id(evaluate_claims([flat]))["pre_ln_variance_grows"].verdict == "tie"


def by_scheme(runs):
    """Claims with each scheme's runs as seeds of one configuration."""
    return evaluate_claims(runs, groups=[run.norm_scheme for run in runs])


def test_seeds_give_a_spread_and_say_whether_it_separates_the_schemes():
    pre = [synthetic(f"pre_s{s}", "pre_ln", loss=loss) for s, loss in ((1, 5.0), (2, 5.2))]
    separated = [synthetic(f"lns_s{s}", "lns", loss=loss) for s, loss in ((1, 4.8), (2, 4.9))]
    overlapping = [synthetic(f"lns_s{s}", "lns", loss=loss) for s, loss in ((1, 4.7), (2, 5.1))]
    result = by_id(by_scheme(pre + separated))["lns_lowers_loss"]
    assert result.holds and result.beyond_seed_spread is True and result.seeds == 2
    assert (result.subject.mean, result.subject.minimum, result.subject.maximum) == pytest.approx((4.85, 4.8, 4.9))
    assert result.subject.std == pytest.approx(0.0707107, rel=1e-5) and result.reference.mean == pytest.approx(5.1)
    result = by_id(by_scheme(pre + overlapping))["lns_lowers_loss"]
    assert result.holds and result.beyond_seed_spread is False  # means 4.9 < 5.1, but 5.1 > 5.0
    assert len(result.runs) == 4
    grows = by_id(by_scheme([synthetic("a", "pre_ln", variance=(1, 1, 1, 1, 3)),
                             synthetic("b", "pre_ln", variance=(1, 1, 1, 1, 0.9))]))["pre_ln_variance_grows"]
    assert grows.holds and grows.beyond_seed_spread is False  # mean 1.95 > 1, one seed below
    reversed_ = by_id(by_scheme(pre + separated))["lns_deep_layers_matter_more"]
    assert reversed_.verdict == "tie" and reversed_.beyond_seed_spread is None
    worse = [synthetic(f"lns_s{s}", "lns", loss=loss) for s, loss in ((1, 5.3), (2, 5.4))]
    result = by_id(by_scheme(pre + worse))["lns_lowers_loss"]
    assert result.verdict == "does not hold" and result.beyond_seed_spread is True  # every seed the other way


def test_missing_schemes_and_lns_variants():
    only_lns = evaluate_claims([synthetic("lns", "lns")])
    assert {r.id for r in only_lns} == {c.id for c in CLAIMS if c.subject == "lns"}
    assert all(r.holds is None and r.verdict == "not testable: no pre_ln run" for r in only_lns)
    results = evaluate_claims([synthetic("pre", "pre_ln"), synthetic("lns", "lns"), synthetic("gain", "lns_gain_init"),
                               synthetic("post", "post_ln")])
    schemes = {r.scheme for r in results}
    assert schemes == {"pre_ln", "lns", "lns_gain_init"}  # Post-LN is no stand-in for LNS
    assert by_id(results, "lns_gain_init")["lns_lowers_loss"].expected == "gain (lns_gain_init) < pre (pre_ln)"
    against_post = by_id(evaluate_claims([synthetic("post", "post_ln", loss=5.5), synthetic("lns", "lns")],
                                         reference="post_ln"))
    assert against_post["lns_lowers_loss"].expected == "lns < post (post_ln)" and against_post["lns_lowers_loss"].holds
    assert "pre_ln_variance_grows" not in against_post  # claims about Pre-LN alone need a Pre-LN run


def test_report_json_and_tool_carry_the_claims(tmp_path, capsys):
    runs = [synthetic("pre_s1", "pre_ln", loss=5.0), synthetic("pre_s2", "pre_ln", loss=5.1),
            synthetic("lns_s1", "lns", loss=4.8), synthetic("lns_s2", "lns", loss=4.9)]
    for run in runs:
        write_report([run], tmp_path / run.name, plots=False)
    assert analyze_depth(["--compare", *(str(tmp_path / r.name) for r in runs), "--groups", "pre_ln", "pre_ln", "lns",
                          "lns", "--output", str(tmp_path / "all"), "--no-plots"]) == 0
    claims = {c["id"]: c for c in json.loads((tmp_path / "all" / "depth_analysis.json").read_text())["claims"]}
    assert claims["lns_lowers_loss"]["holds"] is True and claims["lns_lowers_loss"]["beyond_seed_spread"] is True
    assert {"pre_ln_variance_grows", "lns_curbs_variance_growth", "lns_lowers_loss",
            "lns_deep_layers_matter_more"} <= set(claims)
    report = (tmp_path / "all" / "report.md").read_text()
    assert "## The paper's claims, checked" in report
    assert "| `lns_lowers_loss` |" in report and "lns: 4.8, 4.9 (mean 4.85); pre_ln: 5, 5.1 (mean 5.05)" in report
    out = capsys.readouterr().out
    assert "  holds          lns_lowers_loss: LNS reaches a lower loss than Pre-LN" in out
    assert "2 seeds, beyond their spread" in out and "holds (2 seeds, beyond their spread)" in report
    assert analyze_depth(["--compare", str(tmp_path / "pre_s1"), str(tmp_path / "pre_s1"),
                          "--output", str(tmp_path / "dup"), "--no-plots"]) == 2
    assert "--names" in capsys.readouterr().err



def test_different_models_are_different_configurations_unless_grouped():
    llama, qwen3 = synthetic("llama", "pre_ln", variance=(1, 1, 2, 3, 4)), synthetic("qwen3", "pre_ln", variance=(1, 1, 1, 1, 0.5))
    lns = synthetic("lns", "lns", variance=(1, 1, 1, 1, 2))
    grows = [r for r in evaluate_claims([llama, qwen3, lns]) if r.id == "pre_ln_variance_grows"]
    assert [(r.configuration, r.expected, r.verdict, r.seeds) for r in grows] == [
        ("llama", "llama (pre_ln) > 1", "holds", 1), ("qwen3", "qwen3 (pre_ln) > 1", "does not hold", 1)]
    curbs = [r for r in evaluate_claims([llama, qwen3, lns]) if r.id == "lns_curbs_variance_growth"]
    assert [(r.reference_configuration, r.verdict) for r in curbs] == [("llama", "holds"), ("qwen3", "does not hold")]
    grouped = by_id(evaluate_claims([llama, qwen3, lns], groups=["pre", "pre", "lns"]))["pre_ln_variance_grows"]
    assert grouped.seeds == 2 and grouped.configuration == "pre" and grouped.beyond_seed_spread is False
    with pytest.raises(ValueError, match="group 'x' holds runs of different norm schemes"):
        configurations([llama, lns], groups=["x", "x"])
    gemma2 = synthetic("gemma2", "sandwich_ln")
    assert not [r for r in evaluate_claims([gemma2]) if r.runs[0].name == "gemma2"]
    assert unclaimed([llama, gemma2]) == [gemma2]


def test_the_tool_refuses_different_windows_and_bad_groups(tmp_path, capsys):
    other = dataclasses.replace(WINDOWS, seq_len=64, count=4, tokens_sha256="d" * 64, tokenizer="the tokenizer of qwen3",
                                tokenizer_sha256="e" * 64)
    runs = [synthetic("llama", "pre_ln"), synthetic("qwen3", "pre_ln", windows=other),
            synthetic("old", "pre_ln", windows=None), synthetic("gemma2", "sandwich_ln")]
    for run in runs:
        write_report([run], tmp_path / run.name, plots=False)
    folders = [str(tmp_path / run.name) for run in runs]
    capsys.readouterr()
    assert analyze_depth(["--compare", *folders[:2], "--output", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "not measured on the same windows" in err and "--allow-different-windows" in err
    assert "window length differs: llama 16; qwen3 64" in err and "number of windows differs: llama 6; qwen3 4" in err
    assert "tokenizer checksum differs: llama bbbbbbbbbbbb (the tokenizer of llama); qwen3 eeeeeeeeeeee" in err
    assert not (tmp_path / "out").exists()
    assert analyze_depth(["--compare", folders[0], folders[2], "--output", str(tmp_path / "out"), "--no-plots"]) == 2
    assert "old records no windows" in capsys.readouterr().err
    assert analyze_depth(["--compare", *folders[:2], "--allow-different-windows", "--output", str(tmp_path / "out"),
                          "--no-plots"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "**The runs were not measured on the same windows**" in report and "window length differs" in report
    assert json.loads((tmp_path / "out" / "depth_analysis.json").read_text())["window_differences"]
    assert analyze_depth(["--compare", folders[0], folders[3], "--groups", "g", "g", "--output", str(tmp_path / "g"),
                          "--no-plots"]) == 2
    assert "group 'g' holds runs of different norm schemes (llama: pre_ln, gemma2: sandwich_ln)" in capsys.readouterr().err
    assert analyze_depth(["--compare", folders[0], folders[3], "--output", str(tmp_path / "g"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "in no claim (the paper's claims are about Pre-LN and LNS): gemma2 (sandwich_ln)" in out
    report = (tmp_path / "g" / "report.md").read_text()
    assert "Each run is its own configuration" in report and "Not in any claim: gemma2 (sandwich_ln)" in report
    assert "sandwich_ln (sandwich: x + norm(f(norm(x))))" in report
