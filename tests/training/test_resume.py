"""A run interrupted and resumed reproduces the uninterrupted run's losses, single rank and 2-rank DP."""

from __future__ import annotations

from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED

# Dropout makes the comparison depend on the restored RNG states as well as on weights, optimizer,
# schedule and data position.
WITH_DROPOUT = ["model.hidden_dropout=0.1"]
TOLERANCE = 1e-6
OBSERVED = ["logging.tensorboard=true", "logging.depth_stats_interval=2"]


def straight_and_resumed(rank: int, world_size: int, corpus: TinyCorpus, root: Path, layout: tuple[str, ...] = ()
                         ) -> dict:
    from lnstrain.training.trainer import pretrain

    def config(name: str, *extra: str):
        overrides = tiny_run_overrides(corpus, root / name) + WITH_DROPOUT + list(layout) + list(extra)
        return load_config(TINY_RUN_CONFIG, overrides, world_size)

    # TensorBoard and depth statistics only on the straight run: they must not change its losses.
    straight = pretrain(config("straight", *OBSERVED))
    interrupted = pretrain(config("resumed"), stop_at_step=3)
    not_again = pretrain(config("resumed"), stop_at_step=2)  # already past it: trains nothing, saves nothing
    resumed = pretrain(config("resumed"))  # checkpoint.resume: auto finds latest
    rerun = pretrain(config("resumed"))  # already finished: resumes at the end, trains nothing
    return {"straight": straight, "interrupted": interrupted, "not_again": not_again, "resumed": resumed,
            "rerun": rerun}


def check_resume(results: dict, world_size: int) -> None:
    straight, interrupted, resumed, rerun = (results[k] for k in ("straight", "interrupted", "resumed", "rerun"))
    assert sorted(straight.losses) == [1, 2, 3, 4, 5, 6]
    assert interrupted.stop_reason == "reached stop_at_step 3"
    assert sorted(interrupted.losses) == [1, 2, 3]
    not_again = results["not_again"]
    assert not_again.stop_reason == "already at step 3, stop_at_step 2" and not_again.losses == {}
    assert not_again.exit_code == interrupted.exit_code == EXIT_STOPPED and not_again.last_checkpoint is None
    assert Path(resumed.resumed_from).name == "global_step3"
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in range(1, 7):
        loss = (interrupted.losses | resumed.losses)[step]
        assert abs(loss - straight.losses[step]) <= TOLERANCE, (world_size, step, loss, straight.losses[step])
    assert abs(resumed.eval_losses[6] - straight.eval_losses[6]) <= TOLERANCE
    assert resumed.position.consumed_samples == straight.position.consumed_samples == 6 * 8
    assert Path(rerun.resumed_from).name == "global_step6" and rerun.losses == {}
    assert straight.losses[6] < straight.losses[1]  # it trains at all


def tensorboard_tags(directory: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return set(events.Tags()["scalars"])


def test_resume_matches_uninterrupted_run_single_rank(tiny_corpus, tmp_path):
    [results] = run_distributed(straight_and_resumed, 1, tiny_corpus, tmp_path, timeout_s=240)
    check_resume(results, 1)
    tags = tensorboard_tags(tmp_path / "straight" / "tiny" / "tensorboard")
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/tokens_seen",
                "eval/loss", "eval/perplexity"):
        assert tag in tags and f"by_tokens/{tag}" in tags, (tag, sorted(tags))
    assert "depth/residual_variance/layer_02" in tags, sorted(tags)


@pytest.mark.multirank
def test_resume_matches_uninterrupted_run_two_data_parallel_ranks(tiny_corpus, tmp_path):
    results = run_distributed(straight_and_resumed, 2, tiny_corpus, tmp_path, timeout_s=300)
    check_resume(results[0], 2)
    assert results[0]["straight"].losses == results[1]["straight"].losses  # ranks agree


@pytest.mark.multirank
def test_resume_matches_uninterrupted_run_pipeline_bf16_without_zero(tiny_corpus, tmp_path):
    """DeepSpeed's BF16_Optimizer at ZeRO 0 (what bf16 with pipeline stages uses) keeps its state in
    per-rank partition files that DeepSpeed's own loader does not read at ZeRO 0 (KeyError: 0)."""
    layout = ("parallel.pipeline=2", "precision.dtype=bf16", "parallel.zero_stage=0")
    results = run_distributed(straight_and_resumed, 2, tiny_corpus, tmp_path, layout, timeout_s=400)
    check_resume(results[0], 2)
