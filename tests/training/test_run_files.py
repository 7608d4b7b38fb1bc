"""``final_metrics.json`` is the finished-run marker: it counts only when it names the run's last step,
and a damaged one reads as "not finished", never as an error."""

from __future__ import annotations

import json
import math

import pytest

from lnstrain.run_files import FINAL_METRICS_FILE, FinalMetrics, read_final_metrics
from lnstrain.study.results import final_metrics
from lnstrain.training.outcome import finished_step


def write(run_dir, text: str) -> None:
    (run_dir / FINAL_METRICS_FILE).write_text(text, encoding="utf-8")


def test_a_run_is_finished_when_its_final_metrics_name_the_last_step(tmp_path):
    write(tmp_path, json.dumps(FinalMetrics(step=6, tokens=768, eval_loss=2.0, eval_ppl=math.exp(2.0))))
    assert finished_step(tmp_path, 6) == 6
    assert finished_step(tmp_path, 8) is None  # a shorter run, being extended
    assert final_metrics(tmp_path, 6) == {"step": 6, "tokens": 768, "eval_loss": 2.0, "eval_ppl": math.exp(2.0),
                                          "source": FINAL_METRICS_FILE}
    assert final_metrics(tmp_path, 8) is None


@pytest.mark.parametrize("text", ["", "{not json", "[6]", '{"tokens": 768}', '{"step": "six"}', '{"step": null}'])
def test_damaged_final_metrics_mean_not_finished(text, tmp_path):
    write(tmp_path, text)
    assert finished_step(tmp_path, 6) is None
    assert final_metrics(tmp_path, 6) is None  # no TensorBoard fallback here either


def test_read_final_metrics(tmp_path):
    assert read_final_metrics(tmp_path) is None
    write(tmp_path, '{"step": 6, "eval_loss": null}')
    assert read_final_metrics(tmp_path) == {"step": 6, "eval_loss": None}
    write(tmp_path, "[6]")
    assert read_final_metrics(tmp_path) is None
