"""Report files, the JSON round trip, and tools/analyze_depth.py end to end on a token file."""

import csv
import json
import logging

import numpy as np
import pytest
import torch
import yaml

from lnstrain.analysis.depth_analysis import DepthAnalysis, analyze_model
from lnstrain.analysis.eval_data import token_file_windows
from lnstrain.analysis.report import read_analyses, write_report
from lnstrain.data.indexed_writer import IndexedDatasetWriter
from tests.analysis.conftest import silence_layers, tiny_model
from tools.analyze_depth import main as analyze_depth


@pytest.fixture
def two_runs(batches) -> list[DepthAnalysis]:
    silent = analyze_model(silence_layers(tiny_model(num_layers=3)), batches, name="pre_ln")
    active = analyze_model(tiny_model(num_layers=3, norm_scheme="lns"), batches, name="lns")
    return [silent, active]


def test_json_round_trip_and_csvs(two_runs, tmp_path):
    report = write_report(two_runs, tmp_path, plots=False)
    assert read_analyses(tmp_path)[1].to_dict() == two_runs[1].to_dict()
    with open(tmp_path / "lns_pruning.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["layer"]) for r in rows] == [1, 2, 3]
    assert float(rows[1]["delta_loss"]) == pytest.approx(two_runs[1].pruning[1].delta_loss)
    with open(tmp_path / "lns_angular.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 + 2 + 1  # (l, n) with l + n <= L + 1
    with open(tmp_path / "pre_ln_variance.csv") as f:
        assert len(list(csv.DictReader(f))) == 4  # embedding output + 3 layers
    text = report.read_text()
    assert "| | pre_ln | lns |" in text and "3 of 3" in text and "lns ΔP (loss)" in text


def test_plots_when_matplotlib_is_there(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    report = write_report(two_runs, tmp_path)
    for name in ("variance.png", "pruning.png", "angular_pre_ln.png", "angular_lns.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"]({name})" in report.read_text()


def test_near_identity_is_by_absolute_delta_p_and_negative_layers_are_shown(two_runs, tmp_path):
    from lnstrain.analysis.depth_analysis import summarize

    run = two_runs[1]
    for layer, delta in zip(run.pruning, (0.5, -0.05, -0.001)):
        layer.delta_loss = delta
    run.summary = summarize(run.pruning, 0.01)
    assert run.summary.near_identity_layers == [3]  # removing layer 2 lowers the loss by 0.05: not an identity map
    assert run.summary.negative_layers == [2, 3]
    text = write_report([run], tmp_path, plots=False).read_text()
    assert "| layers whose removal lowers the loss (ΔP) | 2 (-0.0500), 3 (-0.0010) |" in text
    assert "| 2 | " in text and "-0.0500 ↓" in text and "near-identity layers (\\|ΔP\\| < 0.01 nats) | 1 of 3" in text
    assert read_analyses(tmp_path)[0].summary == run.summary


def test_plot_axes_count_layers_in_whole_numbers(two_runs, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from lnstrain.analysis import plots

    ticks, save = [], plots._save

    def keep_ticks(plt, fig, out_dir, name):
        for axis in fig.axes[:1]:
            ticks.append((name, list(axis.get_xticks()) + (list(axis.get_yticks()) if name.startswith("angular") else [])))
        return save(plt, fig, out_dir, name)

    monkeypatch.setattr(plots, "_save", keep_ticks)
    plots.write_plots(two_runs, tmp_path)
    assert [name for name, _ in ticks] == ["variance.png", "pruning.png", "angular_pre_ln.png", "angular_lns.png"]
    for name, values in ticks:
        assert values and all(float(v).is_integer() for v in values), (name, values)


def test_the_pruning_plot_leaves_room_above_the_tallest_bar_and_below_the_deepest():
    """The depth demo's ΔP profile: matplotlib's 5 % margin, added in linear units, is invisible on the
    symlog axis, and LNS's layer-1 bar (4 nats) ended at the frame."""
    from types import SimpleNamespace

    from lnstrain.analysis.plots import pruning_figure, pyplot

    if pyplot() is None:
        pytest.skip("matplotlib is not installed")
    profiles = {"pre_ln": [1.3, 0.25, 0.018, 0.006, 0.001, 0.002, 0.02, 0.009],
                "lns": [4.0, 0.04, 0.004, 0.04, 0.003, -0.001, -0.0015, -0.003]}
    runs = [SimpleNamespace(name=name, summary=SimpleNamespace(near_identity_threshold=0.01),
                            pruning=[SimpleNamespace(layer=i + 1, delta_loss=d) for i, d in enumerate(deltas)])
            for name, deltas in profiles.items()]
    plt = pyplot()
    figure = pruning_figure(plt, runs)
    axes = figure.axes[0]
    figure.canvas.draw()
    height = lambda y: axes.transData.transform((0, y))[1]  # display units, as drawn  # noqa: E731
    bottom, top = (height(y) for y in axes.get_ylim())
    bars = [bar.get_height() for container in axes.containers for bar in container]
    assert len(bars) == 16 and axes.get_yscale() == "symlog"
    assert top - height(max(bars)) > 0.05 * (top - bottom)
    assert height(min(bars)) - bottom > 0.05 * (top - bottom)
    plt.close(figure)


def test_run_names_must_differ(two_runs, tmp_path):
    with pytest.raises(ValueError, match="run names must differ"):
        write_report([two_runs[0], two_runs[0]], tmp_path)


def write_tokens(prefix, count: int = 2000, vocab: int = 100) -> None:
    tokens = np.random.default_rng(0).integers(0, vocab, count).astype(np.uint16)
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for document in np.array_split(tokens, 10):
            writer.add_document(document)


def test_validation_windows_are_consecutive_and_recorded(tmp_path, caplog):
    write_tokens(tmp_path / "valid", count=100)
    with caplog.at_level(logging.WARNING):
        windows = token_file_windows(str(tmp_path / "valid"), seq_len=9, num_samples=50, batch_size=4)
    batches = windows.batches
    assert [len(b.tokens) for b in batches] == [4, 4, 2]  # 100 // 10 windows
    assert "holds only 10 windows of 10 tokens; 50 were asked for" in caplog.text
    torch.testing.assert_close(batches[0].labels[0, :-1], batches[0].tokens[0, 1:])
    record = windows.record
    assert (record.seq_len, record.count, record.requested, record.start) == (9, 10, 50, 0)
    assert record.source_kind == "token file" and record.tokenizer == "not recorded"
    assert record.describe() == f"10 windows (of 50 asked) of 9 + 1 tokens from {tmp_path / 'valid'}"
    fewer = token_file_windows(str(tmp_path / "valid"), seq_len=9, num_samples=5, batch_size=4).record
    assert fewer.source_sha256 == record.source_sha256 and fewer.tokens_sha256 != record.tokens_sha256
    with pytest.raises(ValueError, match="token id .* >= the model's vocab_size 50"):
        token_file_windows(str(tmp_path / "valid"), seq_len=9, num_samples=5, batch_size=4, vocab_size=50)


def test_tool_single_runs_then_compare(tmp_path, capsys):
    write_tokens(tmp_path / "valid")
    config = {"model": {"preset": "tiny", "num_layers": 3, "num_kv_heads": 4, "norm_scheme": "pre_ln"},
              "data": {"sources": [{"prefix": str(tmp_path / "valid")}], "seq_len": 16},
              "train": {"steps": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    for scheme in ("pre_ln", "lns"):
        model = tiny_model(num_layers=3, norm_scheme=scheme, init_seed=7)
        torch.save({"module": {f"module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / f"{scheme}.pt")
        assert analyze_depth(["--state-dict", str(tmp_path / f"{scheme}.pt"), "--config", str(tmp_path / "run.yaml"),
                              "--set", f"model.norm_scheme={scheme}", "--data", str(tmp_path / "valid"),
                              "--num-samples", "12", "--batch-size", "4", "--output", str(tmp_path / scheme),
                              "--no-plots"]) == 0
        saved = read_analyses(tmp_path / scheme)[0]
        assert saved.name == scheme and saved.norm_scheme == scheme and saved.validation_tokens == 12 * 16
        batches = token_file_windows(str(tmp_path / "valid"), 16, 12, 4).batches
        assert saved.baseline.loss == pytest.approx(analyze_model(model, batches).baseline.loss, rel=1e-6)
    assert analyze_depth(["--compare", str(tmp_path / "pre_ln"), str(tmp_path / "lns" / "depth_analysis.json"),
                          "--output", str(tmp_path / "compare"), "--no-plots"]) == 0
    data = json.loads((tmp_path / "compare" / "depth_analysis.json").read_text())
    assert [run["name"] for run in data["runs"]] == ["pre_ln", "lns"]
    assert "report:" in capsys.readouterr().out


def test_tool_explains_missing_inputs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        analyze_depth(["--output", str(tmp_path)])
    torch.save({"bogus": torch.zeros(1)}, tmp_path / "bad.pt")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "train": {"steps": 1}}))
    capsys.readouterr()
    assert analyze_depth(["--state-dict", str(tmp_path / "bad.pt"), "--config", str(tmp_path / "run.yaml"),
                          "--data", "x", "--output", str(tmp_path / "out")]) == 2
    assert "--data x: no x.bin and .idx" in capsys.readouterr().err  # found before the weights are read
    write_tokens(tmp_path / "valid")
    assert analyze_depth(["--state-dict", str(tmp_path / "bad.pt"), "--config", str(tmp_path / "run.yaml"),
                          "--data", str(tmp_path / "valid"), "--output", str(tmp_path / "out")]) == 2
    assert "the default window length 256 (set --seq-len) is longer than" in capsys.readouterr().err
    assert analyze_depth(["--state-dict", str(tmp_path / "bad.pt"), "--config", str(tmp_path / "run.yaml"),
                          "--data", str(tmp_path / "valid"), "--seq-len", "8", "--output", str(tmp_path / "out")]) == 2
    assert "parameter names do not match" in capsys.readouterr().err


def test_tool_scores_a_multiple_choice_task(tmp_path):
    from lnstrain.testing.tiny_corpus import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus", vocab_size=200, num_documents=100)
    config = {"model": {"preset": "tiny", "vocab_size": 200, "num_layers": 2, "num_kv_heads": 4},
              "data": {"sources": [{"prefix": str(corpus.prefix)}], "tokenizer": str(corpus.tokenizer), "seq_len": 16},
              "train": {"steps": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    torch.save(tiny_model(num_layers=2, vocab_size=200).state_dict(), tmp_path / "model.pt")
    questions = [{"question": "the model reads", "choices": ["the signal.", "its variance again."], "answer": 0},
                 {"question": "a layer scales", "choices": ["one value", "the loss", "every step"], "answer": "B"}]
    (tmp_path / "task.jsonl").write_text("\n".join(json.dumps(q) for q in questions))
    assert analyze_depth(["--state-dict", str(tmp_path / "model.pt"), "--config", str(tmp_path / "run.yaml"),
                          "--data", str(corpus.prefix), "--num-samples", "4", "--mc-task", str(tmp_path / "task.jsonl"),
                          "--output", str(tmp_path / "out"), "--no-plots"]) == 0
    run = read_analyses(tmp_path / "out")[0]
    assert run.baseline.accuracy in (0.0, 0.5, 1.0)
    assert all(p.delta_accuracy == p.result.accuracy - run.baseline.accuracy for p in run.pruning)
    assert "multiple-choice accuracy" in (tmp_path / "out" / "report.md").read_text()
