"""``build_groups`` then ``build_model``: every group exists before the model, building the model
creates none of lnstrain's, and training's modes (activation checkpointing, compilation) are applied
there to every layer.

The multi-rank case (4 ranks, gloo) builds a tensor-4 model whose 2 KV heads are each held by 2
ranks (the one layout that needs a sub-group of the tensor group) and a tensor-2 × pipeline-2 stage,
watching ``torch.distributed.new_group`` and DeepSpeed's ``init_distributed`` while they are built.
That such a model trains like the single-process one on the groups built before it is
test_layout_parity's ``tp4_sp_zero1_kv_shared_by_2``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from pathlib import Path

import pytest

from lnstrain.model import Transformer, TransformerBlock
from lnstrain.model.build import build_model
from lnstrain.model.attention import kv_head_copies
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed
from tests.parallel.layouts import Layout, make_config

SHARED_KV_HEADS = Layout("tp4_two_kv_heads", tensor=4, kv_heads=2, fused_qkv=False)
PIPELINE = Layout("tp2_pp2_tied", tensor=2, pipeline=2, tied=True)
DEEPSPEED_PIPELINE_FILES = {"deepspeed/runtime/pipe/module.py", "deepspeed/runtime/pipe/topology.py"}
"""Where DeepSpeed's ``PipelineModule`` constructor builds its own grid and tied-weight groups."""


@pytest.mark.parametrize("heads, kv_heads, tensor, copies", [
    (4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (4, 2, 4, 2), (8, 2, 8, 4), (8, 8, 4, 1)])
def test_kv_head_copies_counts_the_ranks_holding_one_head(heads, kv_heads, tensor, copies):
    cfg = make_config(Layout("any", kv_heads=kv_heads)).model
    assert kv_head_copies(dataclasses.replace(cfg, num_heads=heads), tensor) == copies


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("compile_blocks", [False, True])
def test_build_model_applies_checkpointing_and_compilation_to_every_layer(mode, compile_blocks):
    config = make_config(Layout("plain", checkpointing=mode))
    config = config.replace(train=dataclasses.replace(config.train, compile=compile_blocks))
    model = build_model(config, ParallelGroups.single_process())
    assert type(model) is Transformer
    blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
    assert len(blocks) == config.model.num_layers
    for block in blocks:
        assert block.checkpoint_activations is (mode == "full")
        assert block.attention.checkpoint_core is (mode == "selective")
        assert (block._compiled_call_impl is not None) is compile_blocks  # nn.Module.compile's wrapper


def test_a_model_whose_kv_head_group_was_not_built_refuses_to_build():
    cfg = make_config(SHARED_KV_HEADS).model
    without_sub_groups = ParallelGroups(tp_size=4, tp_rank=0, tp_group=object())  # communicating, but no blocks
    with pytest.raises(RuntimeError, match=r"no group of 2 neighbouring tensor ranks.*tp_replica_copies=2"):
        Transformer(cfg, without_sub_groups)


def _creator_of_group() -> str:
    """The file that asked for a new group: the innermost caller outside torch.distributed and
    DeepSpeed's comm wrapper, as a path from the package directory (``deepspeed/...``, ``lnstrain/...``)."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # without this function and the recorder
        path = Path(frame.filename).as_posix()
        if "/torch/distributed/" not in path and "/deepspeed/comm/" not in path:
            parts = path.split("/")
            for package in ("deepspeed", "lnstrain", "tests"):
                if package in parts:
                    return "/".join(parts[len(parts) - 1 - parts[::-1].index(package):])
            return path
    return "?"


@contextlib.contextmanager
def _watching_group_creation(creators: list[str]):
    """Record who creates each process group; fail if DeepSpeed's comm layer is (re)started."""
    import deepspeed
    import deepspeed.comm
    import deepspeed.comm.comm
    import torch.distributed as dist

    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        creators.append(_creator_of_group())
        return new_group(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("building the model started DeepSpeed's communication layer")

    patched = [(dist, "new_group", recording_new_group), (deepspeed, "init_distributed", refuse),
               (deepspeed.comm, "init_distributed", refuse), (deepspeed.comm.comm, "init_distributed", refuse)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, replacement in patched:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def build_after_groups_worker(rank: int, world_size: int) -> dict:
    from lnstrain.model.build import build_groups

    shared_kv, pipeline = make_config(SHARED_KV_HEADS), make_config(PIPELINE)
    shared_kv_groups, pipeline_groups = build_groups(shared_kv), build_groups(pipeline)
    plain_creators: list[str] = []
    pipeline_creators: list[str] = []
    with _watching_group_creation(plain_creators):
        build_model(shared_kv, shared_kv_groups)
    with _watching_group_creation(pipeline_creators):
        build_model(pipeline, pipeline_groups)
    return {"plain_creators": plain_creators, "pipeline_creators": pipeline_creators}


@pytest.fixture(scope="module")
def built_after_groups() -> list[dict]:
    return run_distributed(build_after_groups_worker, 4, timeout_s=600)


@pytest.mark.multirank
def test_building_the_model_creates_no_group_of_lnstrains(built_after_groups):
    for rank, result in enumerate(built_after_groups):
        assert result["plain_creators"] == [], f"rank {rank}: the Transformer created groups"
        creators = set(result["pipeline_creators"])
        assert creators and creators <= DEEPSPEED_PIPELINE_FILES, (
            f"rank {rank}: groups created while building the pipeline by {sorted(creators)}; only DeepSpeed's "
            "PipelineModule constructor may create its own grid")
