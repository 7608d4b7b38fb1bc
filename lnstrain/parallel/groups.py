"""Process groups for 4D parallelism, built once and passed to whatever needs them.

Ranks are laid out with the axes (pipe, data, context, tensor) from slowest to fastest varying::

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

so the ranks of one tensor-parallel group are neighbours (one node, fast links), the ranks of one
context group are the next closest (their ring passes keys and values every layer), and data
parallelism, which communicates once per step, spans the farthest links. DeepSpeed's
``PipeModelDataParallelTopology`` (pipe, data, model) is the same grid with its data axis holding
data × context: DeepSpeed's pipeline engine, which builds its own grid from it, agrees with ours.
``ParallelGroups.build`` creates every group lnstrain communicates over, before any model exists:
building a model creates none (DeepSpeed's ``PipelineModule`` still builds its own grid of the same
groups when constructed).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lnstrain.parallel.config import ParallelConfig, world_size_problems
from lnstrain.parallel.deepspeed_comm import init_deepspeed_comm

logger = logging.getLogger(__name__)

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None when the axis has size 1


@dataclass(frozen=True)
class RankLayout:
    """Where a global rank sits in the (pipe, data, context, tensor) grid: pure arithmetic, no communication."""

    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size * self.cp_size

    def grid_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank."""
        pp_rank, rest = divmod(rank, self.dp_size * self.cp_size * self.tp_size)
        dp_rank, rest = divmod(rest, self.cp_size * self.tp_size)
        cp_rank, tp_rank = divmod(rest, self.tp_size)
        return pp_rank, dp_rank, cp_rank, tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipe, data, model) of a global rank as DeepSpeed's grid sees it: its data index counts data ×
        context ranks, dp_rank * cp_size + cp_rank."""
        pp_rank, dp_rank, cp_rank, tp_rank = self.grid_coords(rank)
        return pp_rank, dp_rank * self.cp_size + cp_rank, tp_rank

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def _groups(self, varying: str) -> list[list[int]]:
        """Every group whose ranks differ only in the ``varying`` axes (``"t"``, ``"c"``, ``"d"``, ``"p"``,
        or ``"dc"``), in rank order inside each group."""
        sizes = {"p": self.pp_size, "d": self.dp_size, "c": self.cp_size, "t": self.tp_size}
        fixed = [axis for axis in "pdct" if axis not in varying]
        groups = []
        for outer in itertools.product(*(range(sizes[axis]) for axis in fixed)):
            ranks = []
            for inner in itertools.product(*(range(sizes[axis]) for axis in "pdct" if axis in varying)):
                coords = dict(zip(fixed, outer)) | dict(zip([a for a in "pdct" if a in varying], inner))
                ranks.append(self.rank(coords["p"], coords["d"], coords["t"], coords["c"]))
            groups.append(sorted(ranks))
        return groups

    def tp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        return self._groups("c")

    def dp_groups(self) -> list[list[int]]:
        return self._groups("d")

    def dcp_groups(self) -> list[list[int]]:
        """Data × context: the ranks holding the same model shard (gradients summed, ZeRO partitioned)."""
        return self._groups("dc")

    def tp_replica_groups(self, copies: int) -> list[list[int]]:
        """Each tensor group cut into blocks of ``copies`` neighbouring ranks (those holding one replicated unit)."""
        return [ranks[start:start + copies] for ranks in self.tp_groups() for start in range(0, self.tp_size, copies)]

    def pp_groups(self) -> list[list[int]]:
        return self._groups("p")


def layout_problems(world_size: int, tensor: int, pipeline: int, context: int = 1) -> list[str]:
    """Problems with a requested layout, found before any process group exists: the config's own rules."""
    own = ParallelConfig(tensor=tensor, pipeline=pipeline, context=context).validate()
    return own + world_size_problems(world_size, tensor, pipeline, context)


def collective_device(group: ProcessGroup = None) -> torch.device:
    """Where a tensor made for a collective on ``group`` must live: the current CUDA device when the
    group's backend is NCCL alone (it refuses CPU tensors, "No backend type associated with device
    type cpu"), else the CPU (gloo, or a ``cpu:gloo,cuda:nccl`` group)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_matches_deepspeed_topology(layout: RankLayout) -> None:
    """Assert that our rank layout is DeepSpeed's (its data axis holding data × context), so its pipeline
    grid and our groups agree."""
    from lnstrain.deepspeed_adapter import pipeline_grid_coords

    deepspeeds = pipeline_grid_coords(layout.tp_size, layout.pp_size, layout.dp_size * layout.cp_size)
    for rank, (pipe, data, model) in enumerate(deepspeeds):
        ours = layout.coords(rank)
        assert (pipe, data, model) == ours, (
            f"rank {rank}: DeepSpeed places it at (pipe={pipe}, data={data}, model={model}), lnstrain at "
            f"(pipe, data, model) = {ours}")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the (tensor, context, pipeline, data) grid and the groups it belongs to.

    Group handles are ``None`` when that axis has size 1: layers then skip communication entirely.
    The ``get_*`` methods make this object usable as DeepSpeed's ``mpu`` argument. DeepSpeed's data
    parallelism is lnstrain's data × context: the ranks holding the same model shard, over which it
    sums gradients and partitions ZeRO state (``get_data_parallel_*`` answer for them; docs/parallelism.md,
    "Context parallelism", says why not DeepSpeed's own sequence-parallel interface).
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: ProcessGroup = None
    pp_group: ProcessGroup = None
    dp_group: ProcessGroup = None
    sequence_parallel: bool = False
    tp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    # Real group handles even for axes of size 1 (DeepSpeed insists on a handle): (tp, pp, data × context).
    mpu_groups: tuple[ProcessGroup, ProcessGroup, ProcessGroup] = (None, None, None)
    # (copies, handle) of this rank's block of `copies` neighbouring tensor ranks, 1 < copies < tp:
    # the ranks holding the same replicated unit (a key/value head); see with_tp_replica_groups.
    tp_replica_handles: tuple[tuple[int, ProcessGroup], ...] = ()
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: ProcessGroup = None
    cp_ranks: tuple[int, ...] = (0,)
    context_method: str = "ring"
    """How attention crosses the context split: ``ring`` or ``all_to_all`` (``parallel.context_method``)."""
    dcp_group: ProcessGroup = None
    """Data × context (None when of size 1): the ranks whose gradients are summed for one model shard."""
    dcp_ranks: tuple[int, ...] = (0,)

    @classmethod
    def single_process(cls) -> "ParallelGroups":
        return cls()

    @classmethod
    def build(cls, tensor: int, pipeline: int, sequence_parallel: bool = False,
              tp_replica_copies: int = 1, context: int = 1, context_method: str = "ring") -> "ParallelGroups":
        """Create every group (all ranks must call this, in the same order) after dist init.

        ``tp_replica_copies``: also the blocks of that many neighbouring tensor ranks that hold one
        replicated unit (``with_tp_replica_groups``; the model's ``kv_head_copies``). DeepSpeed's
        communication layer, which wraps torch.distributed, is started here too, so that nothing a
        model or engine communicates through is created while the model is built. The context and
        data × context groups are created only when ``context`` > 1.
        """
        if not dist.is_initialized():
            if tensor == pipeline == context == 1:
                return cls(sequence_parallel=False)
            raise RuntimeError("torch.distributed must be initialised before building a "
                               f"tensor={tensor} × pipeline={pipeline} × context={context} layout")
        init_deepspeed_comm(dist.get_backend())  # before DeepSpeed is imported below (it names the accelerator)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        problems = layout_problems(world_size, tensor, pipeline, context)
        if problems:
            raise ValueError("; ".join(problems))
        layout = RankLayout(tp_size=tensor, pp_size=pipeline, dp_size=world_size // (tensor * pipeline * context),
                            cp_size=context)
        check_matches_deepspeed_topology(layout)

        def my_group(all_groups: list[list[int]]) -> tuple[ProcessGroup, tuple[int, ...]]:
            mine, handle = None, None
            for ranks in all_groups:  # new_group is collective: every rank creates every group
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine, handle = tuple(ranks), group
            return handle, mine

        tp_handle, tp_ranks = my_group(layout.tp_groups())
        dp_handle, dp_ranks = my_group(layout.dp_groups())
        pp_handle, pp_ranks = my_group(layout.pp_groups())
        if context > 1:
            cp_handle, cp_ranks = my_group(layout.cp_groups())
            dcp_handle, dcp_ranks = my_group(layout.dcp_groups())
        else:  # data × context is the data group itself
            cp_handle, cp_ranks, dcp_handle, dcp_ranks = None, (rank,), dp_handle, dp_ranks
        pp_rank, dp_rank, cp_rank, tp_rank = layout.grid_coords(rank)
        groups = cls(tp_size=tensor, pp_size=pipeline, dp_size=layout.dp_size,
                     tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
                     tp_group=tp_handle if tensor > 1 else None, pp_group=pp_handle if pipeline > 1 else None,
                     dp_group=dp_handle if layout.dp_size > 1 else None,
                     sequence_parallel=sequence_parallel and tensor > 1,
                     tp_ranks=tp_ranks, pp_ranks=pp_ranks, dp_ranks=dp_ranks,
                     mpu_groups=(tp_handle, pp_handle, dcp_handle),
                     cp_size=context, cp_rank=cp_rank, cp_group=cp_handle, cp_ranks=cp_ranks,
                     context_method=context_method,
                     dcp_group=dcp_handle if len(dcp_ranks) > 1 else None, dcp_ranks=dcp_ranks)
        logger.info("rank %d: tensor %d/%d, context %d/%d, pipeline %d/%d, data %d/%d", rank, tp_rank, tensor,
                    cp_rank, context, pp_rank, pipeline, dp_rank, layout.dp_size)
        return groups.with_tp_replica_groups(tp_replica_copies)

    def with_tp_replica_groups(self, copies: int) -> "ParallelGroups":
        """These groups plus this rank's block of ``copies`` neighbouring tensor ranks.

        A unit (key/value head) split over fewer pieces than there are tensor ranks is held by
        ``copies = tp / pieces`` neighbouring ranks, whose gradients must be summed. Collective: every
        rank of the world calls it with the same ``copies``, in the same order (``build`` does).
        Returns ``self`` when nothing is needed: ``copies`` 1 or tp (the tensor group itself),
        groups without communication, or blocks already built.
        """
        if self.tp_size % copies:
            raise ValueError(f"{copies} copies do not divide tensor size {self.tp_size}")
        if not 1 < copies < self.tp_size or self.tp_group is None or copies in dict(self.tp_replica_handles):
            return self
        layout = RankLayout(tp_size=self.tp_size, pp_size=self.pp_size, dp_size=self.dp_size, cp_size=self.cp_size)
        rank, mine = dist.get_rank(), None
        for ranks in layout.tp_replica_groups(copies):  # new_group is collective: every rank creates every group
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return dataclasses.replace(self, tp_replica_handles=(*self.tp_replica_handles, (copies, mine)))

    def tp_replica_group(self, copies: int) -> ProcessGroup:
        """The group of the ``copies`` neighbouring tensor ranks that hold the same unit as this rank."""
        if copies == self.tp_size:
            return self.tp_group
        handles = dict(self.tp_replica_handles)
        if copies not in handles:
            raise RuntimeError(f"no group of {copies} neighbouring tensor ranks: build the groups with "
                               f"ParallelGroups.build(..., tp_replica_copies={copies}) (lnstrain.model.build."
                               "build_groups does, for a config) before the model")
        return handles[copies]

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size * self.cp_size

    @property
    def dcp_size(self) -> int:
        """Data × context ranks: those holding the same model shard."""
        return self.dp_size * self.cp_size

    @property
    def dcp_rank(self) -> int:
        """This rank's index among the data × context ranks (DeepSpeed's data-parallel rank in its files)."""
        return self.dp_rank * self.cp_size + self.cp_rank


    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # The mpu interface DeepSpeed's engine calls (tensor parallel is its "model parallel").
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.mpu_groups[0]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0]

    # DeepSpeed's data parallelism: data × context.
    def get_data_parallel_rank(self) -> int:
        return self.dcp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dcp_size

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.mpu_groups[2]

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dcp_ranks)

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        return self.mpu_groups[1]

