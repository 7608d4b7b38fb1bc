"""Export and import back, as a user does it: train an LNS model, export it to Hugging Face in fp32
(tools/convert_to_hf.py), start a new run from the export (``checkpoint.init_from``) and get the source
model's validation loss. The export's config.json records the folded 1/sqrt(l), so init_from unfolds
it by itself; told not to (``checkpoint.init_from_unfold_lns: false``), LNS applies twice."""

from __future__ import annotations

from pathlib import Path

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.tool_scripts import load_tool

TOLERANCE = 1e-6
SOURCE_RUN = ["train.steps=3", "train.eval_interval=0", "checkpoint.interval_steps=0"]


def train_export_and_start_from_it(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import Trainer, pretrain

    source = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root) + SOURCE_RUN, world_size)
    source_loss = pretrain(source).eval_losses[3]
    export = root / "hf"
    assert load_tool("convert_to_hf").main(["--checkpoint", str(source.run.dir), "--output", str(export),
                                            "--dtype", "fp32"]) == 0
    losses = {"source": source_loss}
    for unfold in ("null", "false"):
        overrides = tiny_run_overrides(corpus, root) + [
            f"run.name=from_hf_{unfold}", f"checkpoint.init_from={export}", f"checkpoint.init_from_unfold_lns={unfold}"]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        position, _ = trainer.resume()
        assert position.step == 0
        losses[unfold] = trainer.evaluate()
    return losses


def test_a_run_initialised_from_an_fp32_export_has_the_source_models_loss(tiny_corpus, tmp_path):
    losses = run_distributed(train_export_and_start_from_it, 1, tiny_corpus, tmp_path)[0]
    assert abs(losses["null"] - losses["source"]) <= TOLERANCE, losses
    assert abs(losses["false"] - losses["source"]) > 1e-3, losses  # folded factors times LNS again
