"""A checkpoint saved at (tensor 2, pipeline 2, data 1) resumes at (1,1,4), (2,1,2) and (1,2,2).

One 4-rank spawn: the uninterrupted run trains 6 steps at (2,2,1) and saves at step 3; each target
layout then loads that step-3 checkpoint through ``load_resharded`` and must (a) compute the same
outputs on a fixed batch as the single-process model holding the checkpoint's weights (loss for
every layout, full logits where the layout has no pipeline), within 1e-5; (b) train steps 4-6 on the
same data with the optimizer moments, step count and schedule carried, so its losses equal the
uninterrupted run's within LOSS_TOLERANCE (fp32; only reduction order differs between layouts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TinyCorpus
from tests.checkpoint.reshard_runs import (SAVED_STEP, assert_continues, layout_overrides, reshard_config,
                                          saved_step_dir)

SOURCE_LAYOUT = (2, 2)
TARGET_LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tensor, pipeline); data = 4 / (tensor * pipeline)
OUTPUT_TOLERANCE = 1e-5
LOSS_TOLERANCE = 2e-5


def _config(corpus: TinyCorpus, directory: Path, layout: tuple[int, int], world_size: int, extra=()):
    return reshard_config(corpus, directory, world_size,
                          [f"checkpoint.interval_steps={SAVED_STEP}", *layout_overrides(*layout), *extra])


def _fixed_batch(vocab_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [{"tokens": torch.randint(0, vocab_size, (2, 17), generator=generator)} for _ in range(count)]


def _reference_outputs(step_dir: Path, batch: list[dict]) -> tuple[float, torch.Tensor]:
    """Loss and logits of the single-process model holding the checkpoint's weights."""
    from lnstrain.checkpoint.layouts import load_consolidated_state_dict
    from lnstrain.checkpoint.sharding import apply_full_state_dict
    from lnstrain.model import Transformer
    from lnstrain.parallel.groups import ParallelGroups

    config, weights = load_consolidated_state_dict(step_dir)
    model = Transformer(config.model, ParallelGroups.single_process()).eval()
    apply_full_state_dict(model, weights)
    with torch.no_grad():
        losses = [model.loss(b["tokens"][:, :-1], b["tokens"][:, 1:]) for b in batch]
        logits = model(batch[0]["tokens"][:, :-1])[..., :config.model.vocab_size]
    return float(torch.stack(losses).mean()), logits


def _layout_logits(training_engine, batch: list[dict], vocab_size: int) -> torch.Tensor:
    import torch.distributed as dist

    groups = training_engine.groups
    training_engine.module.eval()
    with torch.no_grad():
        local = training_engine.module(batch[0]["tokens"][:, :-1])
    if groups.tp_size > 1:
        pieces = [torch.empty_like(local) for _ in range(groups.tp_size)]
        dist.all_gather(pieces, local.contiguous(), group=groups.tp_group)
        local = torch.cat(pieces, dim=-1)
    return local[..., :vocab_size]


def reshard_runs(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.checkpoint.reshard import load_resharded
    from lnstrain.training.trainer import Trainer, pretrain

    straight_config = _config(corpus, root / "straight", SOURCE_LAYOUT, world_size)
    straight = pretrain(straight_config)
    step_dir = saved_step_dir(straight_config)

    class ReshardingTrainer(Trainer):
        def resume(self):
            return load_resharded(self.engine, step_dir), step_dir

    results = {"straight": straight.losses, "layouts": {}}
    for layout in TARGET_LAYOUTS:
        name = f"tp{layout[0]}_pp{layout[1]}"
        config = _config(corpus, root / name, layout, world_size,
                         ["checkpoint.interval_steps=0", "checkpoint.save_at_end=false"])
        trainer = ReshardingTrainer(config)
        load_resharded(trainer.engine, step_dir)
        batch = _fixed_batch(config.model.vocab_size, trainer.engine.accumulation_steps)
        reference_loss, reference_logits = _reference_outputs(step_dir, batch)
        outputs = {"loss": trainer.engine.eval_loss(batch), "reference_loss": reference_loss}
        if layout[1] == 1:
            outputs["logits_error"] = float((_layout_logits(trainer.engine, batch, config.model.vocab_size)
                                             - reference_logits).abs().max())
        outputs["losses"] = trainer.train().losses
        results["layouts"][name] = outputs
    return results


@pytest.mark.multirank
def test_reshard_2x2x1_to_other_layouts_keeps_outputs_and_continues_training(tiny_corpus, tmp_path):
    results = run_distributed(reshard_runs, 4, tiny_corpus, tmp_path, timeout_s=900)
    straight = results[0]["straight"]
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    for name, outputs in results[0]["layouts"].items():
        assert abs(outputs["loss"] - outputs["reference_loss"]) <= OUTPUT_TOLERANCE, (name, outputs)
        if "logits_error" in outputs:
            assert outputs["logits_error"] <= OUTPUT_TOLERANCE, (name, outputs["logits_error"])
        assert_continues(outputs["losses"], straight, LOSS_TOLERANCE, name)
