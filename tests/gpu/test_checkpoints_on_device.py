"""Checkpoints written by a run on the device: resumed there bitwise, resumed on the CPU, exported to
Hugging Face and reproduced by transformers.

The trainer (``pretrain``) runs the tiny config on the session's tiny corpus in one spawned device rank
with deterministic algorithms:

* fp32 with dropout, uninterrupted (twice: the device must be deterministic here) and interrupted at
  step 3 then resumed: with the same kernels on the same inputs the resumed losses must equal the
  uninterrupted run's bit for bit (dropout makes them depend on the restored RNG state too, CUDA's
  generator on a GPU);
* bf16 (ZeRO 1, BF16_Optimizer), uninterrupted, and interrupted at step 3; a CPU rank then resumes
  the step-3 checkpoint: other kernels, so its losses agree within bf16's tolerance (3e-2, as bf16
  against fp32), and it resumes at step 3 with the same data position;
* the uninterrupted bf16 run's last checkpoint goes through ``tools/convert_to_hf.py`` (fp32), and
  ``transformers.LlamaForCausalLM`` loaded from it on the device gives lnstrain's logits, fp32, within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lnstrain.config.run_config import load_config
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.gpu.helpers import run_on
from tests.tool_scripts import load_tool

pytestmark = pytest.mark.gpu

DROPOUT = ("model.hidden_dropout=0.1", "train.compile=false")
BF16 = ("precision.dtype=bf16", "train.compile=false")
CROSS_DEVICE_LOSS_TOLERANCE = 3e-2
LOGIT_TOLERANCE = 1e-4


def _config(corpus: TinyCorpus, root: Path, name: str, world_size: int, *extra: str):
    return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / name) + list(extra), world_size)


def device_runs(rank: int, world_size: int, corpus: TinyCorpus, root: Path, names: tuple[str, ...]) -> dict:
    """Rank function: the runs of ``RUNS`` named ``names`` on the device (``TrainingResult`` per name)."""
    from lnstrain.training.trainer import pretrain

    return {name: pretrain(_config(corpus, root, RUNS[name][0], world_size, *RUNS[name][1]),
                           stop_at_step=RUNS[name][2]) for name in names}


RUNS = {  # name: (run directory, overrides, stop at step)
    "straight": ("straight", DROPOUT, None),
    "straight_again": ("straight_again", DROPOUT, None),
    "interrupted": ("resumed", DROPOUT, 3),
    "resumed": ("resumed", DROPOUT, None),
    "bf16_straight": ("bf16_straight", BF16, None),
    "bf16_interrupted": ("bf16_interrupted", BF16, 3),
}
"""Compilation is off (``train.compile: auto`` would compile on a GPU): these tests are about the trainer
and its checkpoints, and ``test_model_on_device.py`` compares compiled layers with eager ones."""


def cpu_resume(rank: int, world_size: int, corpus: TinyCorpus, root: Path, step_dir: str):
    """Rank function: resume the device's bf16 step-3 checkpoint on the CPU."""
    from lnstrain.training.trainer import pretrain

    return pretrain(_config(corpus, root, "bf16_cpu_resumed", world_size, *BF16, f"checkpoint.resume={step_dir}"))


@pytest.fixture(scope="module")
def runs(device, tiny_corpus, tmp_path_factory) -> dict:
    """The device runs the core tests need, in one spawned rank."""
    root = tmp_path_factory.mktemp("device_runs")
    names = ("straight", "straight_again", "interrupted", "resumed", "bf16_straight")
    return run_on(device.type, device_runs, tiny_corpus, root, names, deterministic=True)


@pytest.fixture(scope="module")
def cpu_resumed(device, tiny_corpus, tmp_path_factory) -> dict:
    """A bf16 run interrupted on the device, resumed on the CPU."""
    root = tmp_path_factory.mktemp("cross_device_runs")
    results = run_on(device.type, device_runs, tiny_corpus, root, ("bf16_straight", "bf16_interrupted"),
                     deterministic=True)
    results["bf16_cpu_resumed"] = run_on("cpu", cpu_resume, tiny_corpus, root, results["bf16_interrupted"].last_checkpoint)
    return results


@pytest.mark.gpu_core
def test_resume_on_the_device_reproduces_the_uninterrupted_run_bitwise(runs, device):
    from lnstrain.checkpoint.metadata import load_rng_state

    straight, interrupted, resumed = runs["straight"], runs["interrupted"], runs["resumed"]
    # first: the same run twice gives the same losses (else a kernel is non-deterministic, not the resume)
    assert runs["straight_again"].losses == straight.losses, (straight.losses, runs["straight_again"].losses)
    assert sorted(interrupted.losses) == [1, 2, 3] and sorted(resumed.losses) == [4, 5, 6]
    assert Path(resumed.resumed_from).name == "global_step3"
    assert interrupted.losses | resumed.losses == straight.losses, (straight.losses, interrupted.losses | resumed.losses)
    assert resumed.eval_losses[6] == straight.eval_losses[6]
    rng = load_rng_state(resumed.resumed_from, 0)
    assert ("cuda" in rng) == (device.type == "cuda")  # dropout on a GPU draws from CUDA's generator


def test_a_device_checkpoint_resumes_on_the_cpu(cpu_resumed):
    runs = cpu_resumed
    straight, on_cpu = runs["bf16_straight"], runs["bf16_cpu_resumed"]
    assert Path(on_cpu.resumed_from) == Path(runs["bf16_interrupted"].last_checkpoint)
    assert sorted(on_cpu.losses) == [4, 5, 6]
    assert on_cpu.position.consumed_samples == straight.position.consumed_samples
    for step in (4, 5, 6):
        assert on_cpu.losses[step] == pytest.approx(straight.losses[step], abs=CROSS_DEVICE_LOSS_TOLERANCE), step
    assert on_cpu.eval_losses[6] == pytest.approx(straight.eval_losses[6], abs=CROSS_DEVICE_LOSS_TOLERANCE)


@pytest.mark.gpu_core
def test_hf_export_of_a_device_run_is_reproduced_by_transformers(runs, device, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lnstrain.checkpoint.layouts import read_full_state, read_step_config
    from lnstrain.checkpoint.sharding import apply_full_state_dict
    from lnstrain.model import Transformer
    from lnstrain.parallel.groups import ParallelGroups

    step_dir = runs["bf16_straight"].last_checkpoint
    assert load_tool("convert_to_hf").main(["--checkpoint", step_dir, "--output", str(tmp_path / "hf"),
                                            "--dtype", "fp32"]) == 0
    config = read_step_config(step_dir)
    state = read_full_state(step_dir, config, with_optimizer=False)
    cfg = config.model
    ours = Transformer(cfg, ParallelGroups.single_process())
    apply_full_state_dict(ours, state.weights)
    ours = ours.to(device).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).to(device).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = ours(tokens)[..., :cfg.vocab_size]
        logits = theirs(tokens).logits
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= LOGIT_TOLERANCE
