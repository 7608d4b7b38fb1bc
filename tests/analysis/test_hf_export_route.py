"""An lnstrain LNS checkpoint and its fp32 Hugging Face export give the same depth analysis.

The run is trained for two steps (so its weights are not the initialisation), exported with
tools/convert_to_hf.py (1/sqrt(l) folded into the norm gains), and both are analysed in one
`--compare`: the checkpoint through lnstrain's model, the export through transformers' LlamaForCausalLM.
"""

from __future__ import annotations

import pytest

from lnstrain.analysis.report import read_analyses
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
from tests.tool_scripts import load_tool

pytest.importorskip("transformers")

TOLERANCE = 1e-5
RUN = ["model.num_layers=3", "train.steps=2", "train.eval_interval=0", "checkpoint.interval_steps=0"]


def train(rank: int, world_size: int, overrides: list[str]) -> str:
    from lnstrain.training.trainer import pretrain

    config = load_config(TINY_RUN_CONFIG, overrides, world_size)
    pretrain(config)
    return str(config.run.dir)


@pytest.mark.slow
def test_a_checkpoint_and_its_fp32_export_agree(tiny_corpus, tmp_path):
    run_dir = run_distributed(train, 1, tiny_run_overrides(tiny_corpus, tmp_path) + RUN)[0]
    assert load_tool("convert_to_hf").main(["--checkpoint", run_dir, "--output", str(tmp_path / "hf"),
                                            "--dtype", "fp32"]) == 0
    assert load_tool("analyze_depth").main([
        "--compare", run_dir, str(tmp_path / "hf"), "--names", "checkpoint", "export",
        "--data", str(tiny_corpus.prefix), "--data-tokenizer", str(tiny_corpus.tokenizer), "--seq-len", "16",
        "--num-samples", "12", "--batch-size", "4", "--output", str(tmp_path / "out"), "--no-plots"]) == 0
    checkpoint, export = read_analyses(tmp_path / "out")
    assert checkpoint.source == "lnstrain checkpoint, fp32" and export.source == "Hugging Face llama, fp32"
    assert checkpoint.norm_scheme == export.norm_scheme == "lns"
    assert checkpoint.num_layers == export.num_layers == 3
    assert checkpoint.validation_tokens == export.validation_tokens == 12 * 16
    assert abs(checkpoint.baseline.loss - export.baseline.loss) <= TOLERANCE
    for ours, theirs in zip(checkpoint.pruning, export.pruning, strict=True):
        assert abs(ours.delta_loss - theirs.delta_loss) <= TOLERANCE
    assert max(abs(p.delta_loss) for p in checkpoint.pruning) > 1e-3  # the comparison can see a wrong layer
    assert export.output_variance == pytest.approx(checkpoint.output_variance, rel=TOLERANCE)
    for ours, theirs in zip(checkpoint.angular_distance, export.angular_distance, strict=True):
        assert theirs == pytest.approx(ours, abs=TOLERANCE)
    flat = [[gain for layer in run.norm_gains for gain in layer] for run in (checkpoint, export)]
    assert flat[1] == pytest.approx(flat[0], rel=TOLERANCE)  # LNS's 1/sqrt(l): applied in one, folded in the other
    assert checkpoint.summary == export.summary
