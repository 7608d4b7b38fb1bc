"""W&B tracking, read back from the offline run files: every scalar TensorBoard gets, the depth profiles
and the resolved config; a resumed run continues the same W&B run and logs no step twice."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lnstrain.run_files import TENSORBOARD_DIR, WANDB_DIR, WANDB_RUN_FILE
from tests.evaluation.conftest import HAVE_LM_EVAL, HAVE_WANDB, NO_WANDB, TASK
from tests.evaluation.wandb_records import read_offline_runs

pytestmark = pytest.mark.skipif(not HAVE_WANDB, reason=NO_WANDB)


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file: tag -> [(step, value)] in file order."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events_file in sorted((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*")):
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0}).Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return scalars


def test_a_resumed_run_continues_its_wandb_run_without_logging_a_step_twice(tracked_run):
    run_dir = tracked_run.run_dir
    record = json.loads((run_dir / WANDB_RUN_FILE).read_text())
    wandb = read_offline_runs(run_dir / WANDB_DIR)
    assert wandb.ids == {record["id"]}  # both launches wrote the one W&B run the run directory names
    assert len(list((run_dir / WANDB_DIR).glob("offline-run-*"))) == 2
    # step 3 was trained twice (launch 2 resumed from checkpoint 2); TensorBoard has it twice, W&B once
    assert [step for step, _ in wandb.values("train/loss")] == [1, 2, 3, 4]
    board = tensorboard_scalars(run_dir)
    assert [step for step, _ in board["train/loss"]] == [1, 2, 3, 3, 4]
    assert tracked_run.second_losses[3] == pytest.approx(tracked_run.first_losses[3], abs=1e-6)
    assert dict(wandb.values("train/loss"))[3] == pytest.approx(tracked_run.first_losses[3], abs=1e-6)
    # W&B's own step counts rows across both launches, so `wandb sync` uploads them in order
    assert [row["_step"] for row in wandb.rows] == list(range(len(wandb.rows))) == list(range(record["next_row"]))
    assert record["logged_through_step"] == 4


def test_wandb_gets_every_scalar_tensorboard_gets_and_the_config(tracked_run):
    run_dir = tracked_run.run_dir
    wandb = read_offline_runs(run_dir / WANDB_DIR)
    board = tensorboard_scalars(run_dir)
    for tag, points in board.items():
        if tag.startswith("by_tokens/"):  # W&B: the `tokens` field of each row is that x-axis
            continue
        logged = dict(wandb.values(tag))
        assert set(logged) == {step for step, _ in points}, tag
        if tag != "train/tokens_per_s":  # the replayed step 3 ran at another speed; all else is bit-exact
            for step, value in points:
                assert logged[step] == pytest.approx(value, rel=1e-6), (tag, step)
    depth_tags = [tag for tag in board if tag.startswith("depth/")]
    assert len(depth_tags) == 5 * 2 and all(sorted(dict(wandb.values(t))) == [2, 4] for t in depth_tags)
    profile = {part: dict(wandb.values(f"depth_profile/residual_variance/{part}"))[4]  # a wandb.Histogram
               for part in ("_type", "bins", "values")}
    assert profile["_type"] == "histogram" and profile["bins"] == [0.5, 1.5, 2.5]  # bucket l: layer l's value
    assert profile["values"] == pytest.approx([dict(wandb.values(f"depth/residual_variance/layer_0{n}"))[4]
                                               for n in (1, 2)], rel=1e-6)
    assert dict(wandb.values("tokens"))[4] == 4 * 8 * 16  # steps x global batch x sequence length
    assert wandb.config["model"]["hidden_dropout"] == 0.1 and wandb.config["train"]["steps"] == 4
    if HAVE_LM_EVAL:  # train.eval_tasks: launch 1's checkpoints of steps 2 and 3
        assert sorted(dict(wandb.values(f"downstream/{TASK}/acc_norm"))) == [2, 3]


def test_replayed_steps_are_skipped_and_a_fresh_start_is_a_new_wandb_run(tmp_path, offline_in_repo):
    from lnstrain.tracking.config import WandbConfig
    from lnstrain.tracking.wandb_sink import WandbSink

    settings = WandbConfig(mode="offline")
    sink = WandbSink(settings, tmp_path, "run", {"train": {"steps": 4}}, continue_run=False)
    for step in (1, 2, 3, 2, 3, 4):  # a rollback to step 1's checkpoint replays steps 2 and 3
        sink.log_scalars({"train/loss": 10.0 - step}, step, tokens=100 * step)
    sink.log_scalars({"eval/loss": 5.0}, 4, tokens=400)  # several rows at one step are fine
    sink.close()
    first = json.loads((tmp_path / WANDB_RUN_FILE).read_text())
    tool = WandbSink(settings, tmp_path, "run", None, continue_run=True, skip_logged_steps=False)
    tool.log_scalars({"downstream/task/acc": 0.5}, 2)  # an older checkpoint's evaluation, recorded at its step
    tool.close()
    wandb = read_offline_runs(tmp_path / WANDB_DIR, rows=6)
    assert wandb.ids == {first["id"]}
    assert wandb.values("train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0)]
    assert wandb.values("eval/loss") == [(4, 5.0)] and wandb.values("downstream/task/acc") == [(2, 0.5)]
    assert [row["_step"] for row in wandb.rows] == list(range(6))
    fresh = WandbSink(settings, tmp_path, "run", None, continue_run=False)  # training from step 0 again
    fresh.close()
    assert json.loads((tmp_path / WANDB_RUN_FILE).read_text())["id"] != first["id"]
