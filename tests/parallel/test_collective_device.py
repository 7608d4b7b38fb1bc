"""Tensors made for a collective live where the group's backend takes them.

NCCL refuses CPU tensors ("No backend type associated with device type cpu"), so a CPU tensor
all-reduced over a data-parallel group crashed the first step of every multi-GPU data-parallel run
(the token count in ``weigh_micro_batches``), the multi-GPU benchmark's slowest-rank table and the
empty-rank case of the fp32 clipping norm. Everything here runs on the CPU: the backend is faked and
each collective is recorded, and the recorder checks that the tensor lives where ``collective_device``
said (which names CUDA for an NCCL group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lnstrain.parallel.groups import ParallelGroups, collective_device
from tests.tool_scripts import load_tool

DP_GROUP = object()  # stands in for a process-group handle


@pytest.mark.parametrize("backend,device", [("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                            ("NCCL", "cuda")])
def test_collective_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device(DP_GROUP).type == device


class CollectiveRecorder:
    """Stands in for ``collective_device`` (answers the CPU, remembers the group asked about) and for
    ``dist.all_reduce`` (doubles the tensor: two identical ranks summed; checks its device)."""

    def __init__(self) -> None:
        self.groups_asked: list = []
        self.reduced_devices: list[torch.device] = []

    def collective_device(self, group=None) -> torch.device:
        self.groups_asked.append(group)
        return torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op=None, group=None) -> None:
        self.reduced_devices.append(tensor.device)
        if op in (None, dist.ReduceOp.SUM):
            tensor.mul_(2)


@pytest.fixture
def recorder(monkeypatch) -> CollectiveRecorder:
    recorder = CollectiveRecorder()
    monkeypatch.setattr(dist, "all_reduce", recorder.all_reduce)
    return recorder


def test_token_count_is_reduced_on_the_collective_device(monkeypatch, recorder):
    from lnstrain.training import batches

    monkeypatch.setattr(batches, "collective_device", recorder.collective_device)
    two_ranks = ParallelGroups(dp_size=2, dp_group=DP_GROUP)
    micro = {"tokens": torch.zeros(2, 5, dtype=torch.long), "loss_mask": torch.ones(2, 4)}
    weighted, counted = batches.weigh_micro_batches([micro], two_ranks)
    assert counted == 16  # 8 tokens here, 8 on the other rank
    assert recorder.groups_asked == [DP_GROUP] and recorder.reduced_devices == [torch.device("cpu")]
    assert torch.equal(weighted[0].weights, torch.full((2, 4), 2 / 16))


def test_benchmark_slowest_rank_table_is_made_on_the_collective_device(monkeypatch, recorder):
    benchmark = load_tool("benchmark")
    monkeypatch.setattr(benchmark, "collective_device", recorder.collective_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert benchmark.slowest_rank([[0.5, 0.25]]) == [[0.5, 0.25]]  # MAX of two equal ranks
    assert recorder.groups_asked == [None] and recorder.reduced_devices == [torch.device("cpu")]


def test_clipping_norm_of_a_rank_without_gradients_joins_on_the_collective_device(monkeypatch, recorder):
    from lnstrain.training import grad_clip

    monkeypatch.setattr(grad_clip, "collective_device", recorder.collective_device)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model_parallel_group = object()
    assert grad_clip.global_grad_norm([torch.nn.Parameter(torch.ones(3))], 0, model_parallel_group) == 0.0
    assert recorder.groups_asked == [model_parallel_group] and len(recorder.reduced_devices) == 1
