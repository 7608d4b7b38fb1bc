"""A bf16 checkpoint saved at (tensor 1, pipeline 1, data 2) resumes at (2, 1, 1) and (1, 2, 1).

The run is bf16 with ZeRO-1 and fp32 gradient accumulation (the config defaults), so DeepSpeed trains
it with its BF16_Optimizer and writes ``bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt``: each of
the two data ranks holds half of every flat group of fp32 master weights and Adam moments. The
targets hold them whole, split by tensor rank or by pipeline stage. One 2-rank spawn: the
uninterrupted run trains 6 steps; a second run at the source layout stops (and saves) at step 3,
keeping in memory what its engine held; each target resumes that checkpoint through the trainer
(``checkpoint.resume``) and must:

(a) right after the load, hold on every rank exactly (bit for bit) this rank's shards of the source
    engine's fp32 master weights, ``exp_avg`` and ``exp_avg_sq``, with bf16 module weights equal to
    those masters rounded to bf16, and Adam's step count 3. Exact, not approximate: fp32 values only
    travel (engine -> file -> concatenation over data ranks -> this rank's shard -> fp32 buffer)
    and rounding one fp32 value to bf16 has one answer. Rounding anywhere on that path (say masters
    rebuilt from the bf16 weights) would show here, even where the loss curve hides it.
(b) train steps 4-6 with losses within LOSS_TOLERANCE of the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.layouts import MOMENT_KEYS
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TinyCorpus
from tests.checkpoint.reshard_runs import (SAVED_STEP, assert_continues, layout_overrides, reshard_config,
                                          saved_step_dir)

SOURCE_LAYOUT = (1, 1)  # (tensor, pipeline); data 2
TARGET_LAYOUTS = [(2, 1), (1, 2)]  # data 1
BF16_RUN = ["precision.dtype=bf16", "checkpoint.interval_steps=0", "checkpoint.save_at_end=false"]
# bf16 activations: the target layouts round matmul outputs and tensor-parallel partial sums at other
# places than the source, so identical weights give slightly different losses (measured at losses near
# 4.9: <= 2.5e-4 at tensor 2, <= 8.3e-5 at pipeline 2; fp32 runs agree within 2e-5). Masters rebuilt
# from the bf16 weights would move step 5 by about 2e-3, Adam moments dropped on load by about 3e-2.
LOSS_TOLERANCE = 1e-3
WEIGHTS_AND_MOMENTS = ("master", *MOMENT_KEYS)


def _config(corpus: TinyCorpus, directory: Path, layout: tuple[int, int], world_size: int, extra=()):
    return reshard_config(corpus, directory, world_size, [*BF16_RUN, *layout_overrides(*layout), *extra])


def _engine_state(training_engine) -> dict[str, dict[str, torch.Tensor]]:
    """{"master" | "exp_avg" | "exp_avg_sq" | "module": {single-process name: this rank's tensor}}, the
    first three gathered over the data ranks. Collective over the data-parallel group."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from lnstrain.checkpoint.param_names import module_name_mapper

    canonical = module_name_mapper(training_engine.module)
    state: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in (*WEIGHTS_AND_MOMENTS, "module")}
    for name, param in training_engine.module.named_parameters():
        key = canonical(name)
        state["master"][key] = safe_get_full_fp32_param(param).clone()
        state["module"][key] = param.detach().clone()
        for moment in MOMENT_KEYS:
            state[moment][key] = safe_get_full_optimizer_state(param, moment).clone()
    return state


def _adam_steps(training_engine) -> set[int]:
    base = training_engine.base_optimizer
    return {int(group_state["step"]) for group_state in base.state.values()}


def _differences(loaded: dict[str, dict[str, torch.Tensor]], saved: dict[str, dict[str, torch.Tensor]],
                 module: torch.nn.Module) -> dict[str, list]:
    """Where ``loaded`` (this rank, after the resume) is not exactly this rank's shard of ``saved``."""
    from lnstrain.checkpoint.param_names import module_name_mapper
    from lnstrain.checkpoint.sharding import local_shards

    canonical = module_name_mapper(module)
    found: dict[str, list] = {}
    for kind in WEIGHTS_AND_MOMENTS:
        expected = {canonical(name): shard for name, _, shard in local_shards(module, saved[kind])}
        found[kind] = [(name, float((loaded[kind][name] - expected[name]).abs().max()))
                       for name in sorted(loaded[kind]) if not torch.equal(loaded[kind][name], expected[name])]
        found[kind] += [(name, "not in the saved state") for name in sorted(set(loaded[kind]) - set(expected))]
    found["module_not_rounded_master"] = [
        name for name, weight in loaded["module"].items()
        if weight.dtype != torch.bfloat16 or not torch.equal(weight, loaded["master"][name].to(torch.bfloat16))]
    return found


def bf16_reshard_runs(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import Trainer, pretrain

    torch.set_num_threads(1)
    straight = pretrain(_config(corpus, root / "straight", SOURCE_LAYOUT, world_size))
    source_config = _config(corpus, root / "source", SOURCE_LAYOUT, world_size)
    source = Trainer(source_config)
    first_steps = source.train(stop_at_step=SAVED_STEP).losses
    saved = _engine_state(source.engine)
    step_dir = saved_step_dir(source_config)
    results = {"straight": straight.losses, "first_steps": first_steps,
               "source_optimizer": type(source.engine._deepspeed.optimizer).__name__,
               "files": sorted(path.name for path in step_dir.iterdir()), "parameters": sorted(saved["master"]),
               "layouts": {}}

    class InspectedTrainer(Trainer):
        def resume(self):
            resumed = super().resume()
            self.loaded, self.loaded_steps = _engine_state(self.engine), _adam_steps(self.engine)
            return resumed

    for layout in TARGET_LAYOUTS:
        name = f"tp{layout[0]}_pp{layout[1]}"
        trainer = InspectedTrainer(_config(corpus, root / name, layout, world_size,
                                           [f"checkpoint.resume='{step_dir}'"]))
        result = trainer.train()
        results["layouts"][name] = {"resumed_from": result.resumed_from, "losses": result.losses,
                                    "adam_steps": trainer.loaded_steps, "parameters": sorted(trainer.loaded["master"]),
                                    **_differences(trainer.loaded, saved, trainer.engine.module)}
    return results


@pytest.mark.multirank
@pytest.mark.slow
def test_bf16_checkpoint_resumes_at_other_layouts_with_exact_masters_and_moments(tiny_corpus, tmp_path):
    results = run_distributed(bf16_reshard_runs, 2, tiny_corpus, tmp_path, timeout_s=600)
    first = results[0]
    assert first["source_optimizer"] == "BF16_Optimizer"
    assert {f"bf16_zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in (0, 1)} <= set(first["files"]), first["files"]
    straight = first["straight"]
    assert sorted(first["first_steps"]) == [1, 2, 3]
    assert all(abs(first["first_steps"][step] - straight[step]) <= 1e-6 for step in (1, 2, 3)), first
    for name in first["layouts"]:
        held = set().union(*(ranked["layouts"][name]["parameters"] for ranked in results))
        assert held == set(first["parameters"]), (name, sorted(held ^ set(first["parameters"])))
    for rank, ranked in enumerate(results):
        for name, outputs in ranked["layouts"].items():
            label = f"rank {rank}, {name}"
            assert Path(outputs["resumed_from"]).name == f"global_step{SAVED_STEP}", label
            for kind in WEIGHTS_AND_MOMENTS:
                assert outputs[kind] == [], (label, kind, outputs[kind])
            assert outputs["module_not_rounded_master"] == [], (label, outputs["module_not_rounded_master"])
            assert outputs["adam_steps"] == {SAVED_STEP}, (label, outputs["adam_steps"])
            assert_continues(outputs["losses"], straight, LOSS_TOLERANCE, label)
