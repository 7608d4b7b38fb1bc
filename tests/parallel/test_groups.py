"""Process-group layout: ours must be DeepSpeed's, and every rank must sit in consistent groups."""

import pytest

from lnstrain.parallel.groups import ParallelGroups, RankLayout, check_matches_deepspeed_topology, layout_problems
from lnstrain.testing.distributed import run_distributed


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 4), (2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 4, 1)])
def test_layout_matches_deepspeed(tp, pp, dp):
    layout = RankLayout(tp_size=tp, pp_size=pp, dp_size=dp)
    check_matches_deepspeed_topology(layout)
    for groups in (layout.tp_groups(), layout.dp_groups(), layout.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(tp * pp * dp))


def test_tensor_groups_are_neighbours():
    assert RankLayout(tp_size=2, pp_size=2, dp_size=2).tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_replica_blocks_are_neighbouring_tensor_ranks():
    layout = RankLayout(tp_size=4, pp_size=1, dp_size=2)
    assert layout.tp_replica_groups(2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.tp_replica_groups(4) == layout.tp_groups()


def test_replica_groups_are_only_built_when_needed():
    no_communication = ParallelGroups(tp_size=4, tp_rank=1)
    assert no_communication.with_tp_replica_groups(2) is no_communication
    assert no_communication.with_tp_replica_groups(4) is no_communication
    with pytest.raises(RuntimeError, match="no group of 2 neighbouring tensor ranks"):
        no_communication.tp_replica_group(2)
    with pytest.raises(ValueError, match="3 copies do not divide tensor size 4"):
        no_communication.with_tp_replica_groups(3)


def test_layout_problems_name_the_fix():
    (problem,) = layout_problems(world_size=6, tensor=4, pipeline=1)
    assert "not divisible" in problem and "parallel.tensor" in problem


def _groups_worker(rank, world_size, tp, pp):
    import torch
    import torch.distributed as dist

    groups = ParallelGroups.build(tensor=tp, pipeline=pp)
    summed = {}
    for name, group in (("tp", groups.tp_group), ("dp", groups.dp_group), ("pp", groups.pp_group)):
        value = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(value, group=group)
        summed[name] = value.item()
    return groups.tp_rank, groups.pp_rank, groups.dp_rank, summed


@pytest.mark.multirank
def test_groups_reduce_over_the_right_ranks():
    results = run_distributed(_groups_worker, 4, 2, 2)
    # tp pairs {0,1},{2,3}; pp pairs {0,2},{1,3}; dp size 1.
    assert [r[:3] for r in results] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [r[3]["tp"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[3]["pp"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert [r[3]["dp"] for r in results] == [0.0, 1.0, 2.0, 3.0]


def _failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


@pytest.mark.multirank
def test_run_distributed_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_distributed(_failing_worker, 2, timeout_s=60)


def _tensor_worker(rank, world_size):
    import torch

    return {"rank": rank, "weights": torch.full((3,), float(rank))}


@pytest.mark.multirank
def test_run_distributed_returns_tensors():
    results = run_distributed(_tensor_worker, 2, timeout_s=60)
    assert [r["weights"].tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def _environment_worker(rank, world_size):
    import os
    import sys

    return os.environ.get("LNSTRAIN_TEST_MARK"), os.getcwd(), os.environ["RANK"], "deepspeed" in sys.modules


@pytest.mark.multirank
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_current_environment_and_directory(tmp_path, monkeypatch, start_method):
    """The fork server keeps the environment it started with: each rank must get the caller's, as now."""
    run_distributed(_tensor_worker, 1, timeout_s=60, start_method=start_method)  # a server started before
    monkeypatch.setenv("LNSTRAIN_TEST_MARK", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    results = run_distributed(_environment_worker, 2, timeout_s=60, start_method=start_method)
    assert [r[:3] for r in results] == [("set after the first launch", str(tmp_path), str(rank)) for rank in (0, 1)]
    assert all(r[3] for r in results) == (start_method == "forkserver")  # preloaded, or imported fresh


@pytest.mark.multirank
def test_ranks_that_cannot_connect_are_started_again_on_a_new_port(monkeypatch, caplog):
    """The first rendezvous port is taken (rank 0's store cannot listen there): the ranks start again on
    a fresh port, fn runs once, and the failed attempt is logged with rank 0's traceback."""
    import socket

    from lnstrain.parallel import local_ranks

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports, fresh_port = [taken.getsockname()[1]], local_ranks.free_port
        monkeypatch.setattr(local_ranks, "free_port", lambda: ports.pop(0) if ports else fresh_port())
        results = run_distributed(_tensor_worker, 2, timeout_s=60)
    assert [r["weights"].tolist() for r in results] == [[0.0] * 3, [1.0] * 3]
    [retry] = [r for r in caplog.records if "could not connect" in r.getMessage()]
    assert "attempt 1 of 3" in retry.getMessage() and "rank 0 of 2" in retry.getMessage()
