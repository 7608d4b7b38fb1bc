"""Ring attention's own forward and backward for N context ranks in one process: one thread per rank,
the point-to-point exchanges replaced by in-memory mailboxes. What the CPU unit tests and the GPU
test (FlashAttention's kernels, one device) run; the multi-rank tests run the real exchanges."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from lnstrain.parallel import ring_attention
from lnstrain.parallel.context import natural_order, split_for_context


def _mailbox_exchange(size: int) -> type:
    """An ``_Exchange`` whose k-th receive a rank posts gets the k-th message its previous rank sent,
    as point-to-point receives are matched in the order they are posted."""
    lock = threading.Condition()
    sent = [0] * size
    posted = [0] * size
    messages: list[dict[int, torch.Tensor]] = [{} for _ in range(size)]

    class MailboxExchange:
        def __init__(self, send: torch.Tensor, groups: SimpleNamespace) -> None:
            target = (groups.cp_rank + 1) % size
            with lock:
                messages[target][sent[target]] = send.clone()
                sent[target] += 1
                self.rank, self.index = groups.cp_rank, posted[groups.cp_rank]
                posted[groups.cp_rank] += 1
                lock.notify_all()

        def wait(self) -> torch.Tensor:
            with lock:
                if not lock.wait_for(lambda: self.index in messages[self.rank], timeout=60):
                    raise TimeoutError(f"virtual rank {self.rank}: message {self.index} never came")
                return messages[self.rank].pop(self.index)

    return MailboxExchange


def virtual_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, size: int,
                 monkeypatch) -> tuple[torch.Tensor, ...]:
    """(output, dq, dk, dv) over the whole sequence, in order, from ``size`` ranks running
    ``ring_attention``'s forward and backward on their chunks ([batch, heads, seq, head_dim] inputs)."""
    monkeypatch.setattr(ring_attention, "_Exchange", _mailbox_exchange(size))
    results: list[list[torch.Tensor] | BaseException] = [[] for _ in range(size)]

    def rank_main(rank: int) -> None:
        try:
            groups = SimpleNamespace(cp_size=size, cp_rank=rank, cp_ranks=tuple(range(size)), cp_group=None)
            local = [split_for_context(t, 2, groups) for t in (q, k, v, grad)]
            out, lse = ring_attention.ring_forward(*local[:3], groups)
            results[rank] = [out, *ring_attention.ring_backward(local[3], *local[:3], out, lse, groups)]
        except BaseException as error:  # re-raised in the caller's thread
            results[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    order = natural_order(size, q.shape[2] // size, q.device)
    return tuple(torch.cat([results[rank][index] for rank in range(size)], dim=2).index_select(2, order)
                 for index in range(4))
