"""Micro-batch weighting: DeepSpeed's average of weighted micro-batch losses is the token mean."""

from __future__ import annotations

import pytest
import torch

from lnstrain.model import Transformer, model_preset
from lnstrain.model.loss import weighted_token_loss
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training.batches import split_tokens, weigh_micro_batches

SINGLE = ParallelGroups.single_process()


def _micro_batches():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (6, 9), generator=generator)
    mask = torch.ones(6, 8)
    mask[0, 2:] = 0
    mask[3, 5:] = 0
    mask[5] = 0
    return [{"tokens": tokens[i:i + 2], "loss_mask": mask[i:i + 2]} for i in (0, 2, 4)], tokens, mask


def test_average_of_weighted_micro_losses_is_the_token_mean():
    cfg = model_preset("tiny", norm_scheme="lns")
    model = Transformer(cfg, SINGLE)
    micro_batches, tokens, mask = _micro_batches()
    weighted, counted = weigh_micro_batches(micro_batches, SINGLE)
    assert counted == mask.sum().item()
    deepspeed_average = sum(weighted_token_loss(model(m.inputs), m.labels, m.weights, cfg, SINGLE)
                            for m in weighted) / len(weighted)
    expected = model.loss(tokens[:, :-1], tokens[:, 1:], mask)
    torch.testing.assert_close(deepspeed_average, expected)
    plain_mean_of_means = sum(model.loss(m.inputs, m.labels, m.weights > 0) for m in weighted) / 3
    assert not torch.allclose(plain_mean_of_means, expected)  # the weighting matters here


def test_missing_mask_counts_every_token_and_bad_shapes_are_errors():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    inputs, labels, mask = split_tokens({"tokens": tokens})
    assert inputs.shape == labels.shape == mask.shape == (2, 4) and mask.sum() == 8
    with pytest.raises(ValueError, match="loss_mask has shape"):
        split_tokens({"tokens": tokens, "loss_mask": torch.ones(2, 5)})
    with pytest.raises(KeyError, match="needs 'tokens'"):
        split_tokens({"input_ids": tokens})


def test_fully_masked_batch_has_zero_weight():
    batch = {"tokens": torch.zeros(1, 4, dtype=torch.long), "loss_mask": torch.zeros(1, 3)}
    weighted, counted = weigh_micro_batches([batch], SINGLE)
    assert counted == 0 and weighted[0].weights.abs().sum() == 0
