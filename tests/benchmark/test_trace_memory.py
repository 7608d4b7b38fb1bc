"""tools/trace_memory.py: the traced per-layer bytes match the estimate's formula, for every
checkpointing mode, and bad configs stop with exit status 2 before anything is traced."""

import json
from pathlib import Path

import pytest

from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_traced_layers_match_the_formula(mode, tmp_path, capsys):
    tool = load_tool("trace_memory")
    out = tmp_path / "trace.json"
    status = tool.main(["--config", str(ROOT / "configs/bench/1b_seq2048.yaml"), "--set", "model.num_layers=4",
                        "--set", f"train.activation_checkpointing={mode}", "--json", str(out)])
    assert status == 0
    doc = json.loads(out.read_text())
    assert len(doc["kept_per_layer_bytes"]) == 4 and doc["activation_checkpointing"] == mode
    for kept in doc["kept_per_layer_bytes"]:
        assert kept / doc["estimate"]["per_layer"] == pytest.approx(1.0, abs=0.02)
    assert doc["forward_peak_bytes"] >= doc["kept_after_forward_bytes"] > 0
    assert doc["estimate"]["kept_after_forward"] / doc["kept_after_forward_bytes"] == pytest.approx(1.0, abs=0.03)
    assert doc["estimate"]["forward_peak_cpu"] / doc["forward_peak_bytes"] == pytest.approx(1.0, abs=0.05)
    assert "kept per layer (median)" in capsys.readouterr().out


def test_7b_width_at_sequence_4096_matches_the_estimate(tmp_path):
    """The 7B-width shape (hidden 4096, 32 heads, FFN 11008) the GPU check projects the 7B config from."""
    tool = load_tool("trace_memory")
    out = tmp_path / "trace.json"
    assert tool.main(["--config", str(ROOT / "configs/bench/7b_width_seq4096.yaml"), "--set", "model.num_layers=2",
                      "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert all(kept / doc["estimate"]["per_layer"] == pytest.approx(1.0, abs=0.01) for kept in doc["kept_per_layer_bytes"])
    assert doc["estimate"]["forward_peak_cpu"] / doc["forward_peak_bytes"] == pytest.approx(1.0, abs=0.05)


def test_bad_config_stops_before_tracing(capsys):
    tool = load_tool("trace_memory")
    status = tool.main(["--config", str(ROOT / "configs/bench/1b_seq2048.yaml"), "--set", "model.hiden_size=8"])
    assert status == 2 and "did you mean 'hidden_size'" in capsys.readouterr().err
