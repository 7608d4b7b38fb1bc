"""Checkpoints across context sizes, through the trainer on the tiny corpus (2 ranks, ZeRO-1, fp32).

Against one uninterrupted run at data 2: a run saved at context 2 resumes at context 1 (data 2: the
same data × context, loaded as saved), a run saved at tensor 2 resumes at context 2 and one saved at
context 2 resumes at tensor 2 (resharded, Adam moments carried); every step's loss and the held-out
losses within TOLERANCE. The weights a context-2 checkpoint exports to Hugging Face are those of the
uninterrupted run's checkpoint of the same step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides

TOLERANCE = 2e-5  # as test_resume_resharded: other layouts round differently
CONTEXT_2 = ["parallel.context=2"]
TENSOR_2 = ["parallel.tensor=2"]
DATA_2: list[str] = []


def resume_across_context_sizes(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    import torch

    from lnstrain.checkpoint.hf_llama import to_hf_state_dict
    from lnstrain.checkpoint.layouts import load_consolidated_state_dict
    from lnstrain.training.trainer import pretrain

    def config(name: str, *extra: str):
        return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / name) + list(extra), world_size)

    runs = {"straight": [pretrain(config("straight", *DATA_2))]}
    for name, before, after in (("context_2_to_1", CONTEXT_2, DATA_2), ("tensor_2_to_context_2", TENSOR_2, CONTEXT_2),
                                ("context_2_to_tensor_2", CONTEXT_2, TENSOR_2)):
        runs[name] = [pretrain(config(name, *before), stop_at_step=3), pretrain(config(name, *after))]
    exported = {}
    if rank == 0:
        for name in ("straight", "context_2_to_1"):
            cfg, state = load_consolidated_state_dict(root / name / "tiny" / "checkpoints" / "global_step3")
            exported[name] = {key: value.detach().clone() for key, value in to_hf_state_dict(state, cfg.model).items()}
    torch.distributed.barrier()
    return {"runs": runs, "exported": exported}


@pytest.mark.multirank
def test_checkpoints_resume_across_context_sizes(tiny_corpus, tmp_path):
    out = run_distributed(resume_across_context_sizes, 2, tiny_corpus, tmp_path, timeout_s=480)[0]
    [straight] = out["runs"].pop("straight")
    assert sorted(straight.losses) == [1, 2, 3, 4, 5, 6] and sorted(straight.eval_losses) == [3, 6]
    for name, (interrupted, resumed) in out["runs"].items():
        assert sorted(interrupted.losses) == [1, 2, 3], name
        assert Path(resumed.resumed_from).name == "global_step3" and sorted(resumed.losses) == [4, 5, 6], name
        for step, loss in (interrupted.losses | resumed.losses).items():
            assert abs(loss - straight.losses[step]) <= TOLERANCE, (name, step, loss, straight.losses[step])
        for step, loss in (interrupted.eval_losses | resumed.eval_losses).items():
            assert abs(loss - straight.eval_losses[step]) <= TOLERANCE, (name, step, loss)
        assert resumed.position.consumed_samples == straight.position.consumed_samples == 48
    exported, reference = out["exported"]["context_2_to_1"], out["exported"]["straight"]
    assert sorted(exported) == sorted(reference)
    for key, value in reference.items():
        assert float((exported[key] - value).norm() / value.norm()) < 1e-5, key
