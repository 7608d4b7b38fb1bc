"""Optimizer construction: which parameters decay, the group names, the kernels."""

from __future__ import annotations

import pytest
import torch

from lnstrain.model import Transformer, model_preset
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training.config import OptimConfig
from lnstrain.training.optimizer import DECAY_GROUP, NO_DECAY_GROUP, build_optimizer


def _model(**overrides):
    cfg = model_preset("tiny", norm_scheme="layerscale", **overrides)
    return Transformer(cfg, ParallelGroups.single_process())


def _names(model, optimizer):
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {name_of[id(p)] for p in g["params"]} for g in optimizer.param_groups}


def test_matrices_decay_and_gains_never_do():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="adamw", weight_decay=0.1))
    assert isinstance(optimizer, torch.optim.AdamW)
    groups = _names(model, optimizer)
    assert set(groups) == {DECAY_GROUP, NO_DECAY_GROUP}
    assert all(name.endswith("weight") for name in groups[DECAY_GROUP])
    assert "embedding.word_embeddings.weight" in groups[DECAY_GROUP]
    assert "output.head.weight" in groups[DECAY_GROUP]
    assert any("attention_norm" in name for name in groups[NO_DECAY_GROUP])
    assert any("layerscale" in name for name in groups[NO_DECAY_GROUP])
    assert "output.final_norm.weight" in groups[NO_DECAY_GROUP]
    assert all(p.dim() >= 2 for p in optimizer.param_groups[0]["params"])
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay == {DECAY_GROUP: 0.1, NO_DECAY_GROUP: 0.0}
    every = {n for names in groups.values() for n in names}
    assert every == {n for n, _ in model.named_parameters()}


def test_adam_settings_and_cpu_kernel():
    model = _model(tie_embeddings=True)
    optimizer = build_optimizer(model, OptimConfig(name="adam", lr=3e-4, beta1=0.8, beta2=0.9, eps=1e-6))
    assert type(optimizer) is torch.optim.Adam
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (3e-4, (0.8, 0.9), 1e-6)
    assert group["fused"] is True and not group["foreach"]


def test_decay_only_touches_matrices_in_a_step():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=0.1, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only decay can move a parameter
    optimizer.step()
    for name, param in model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (param.dim() >= 2 and bool(before[name].abs().sum() > 0)), name


def test_unknown_optimizer_is_an_error():
    with pytest.raises(ValueError, match="optim.name must be 'adam' or 'adamw'"):
        build_optimizer(_model(), OptimConfig(name="sgd"))
