"""The chunked cross-entropy (the default) against the fp32-logits implementation it replaced.

Tolerances. fp32 logits: both compute in fp32 and differ only in the order of roundings (the
log-sum-exp formed once here, log-softmax there): per-token losses within 2e-6 of losses of about 4,
gradients within 1e-6. bf16 logits: the losses are fp32 in both, within 2e-6 as in fp32; each gradient
element is one fp32 value rounded once to bf16 in both, and fp32 values a few ulps apart can round to
neighbouring bf16 values, so elements agree within one bf16 step (relative 2^-7). Padded vocabulary
entries get exactly zero gradient in both. Chunks are made small (16 tokens) so every case crosses
several chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

from lnstrain.benchmark.tensor_memory import LiveTensorBytes
from lnstrain.parallel import cross_entropy
from lnstrain.parallel.cross_entropy import chunk_tokens, vocab_parallel_cross_entropy
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed

TOKENS, PADDED_VOCAB = (3, 37), 48
SMALL_CHUNKS = 16 * 4 * PADDED_VOCAB  # CHUNK_BYTES giving 16 tokens per chunk at one tensor rank
TOLERANCES = {torch.float32: dict(rtol=0, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-7)}


def case(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(*TOKENS, PADDED_VOCAB, generator=generator)).to(dtype)
    labels = torch.randint(0, PADDED_VOCAB, TOKENS, generator=generator)
    weights = torch.rand(*TOKENS, generator=generator)
    return logits, labels, weights


def loss_and_grad(logits, labels, weights, groups, vocab_size, implementation):
    """Per-token losses and the logits' gradient of sum(loss * weight), the logits an intermediate result
    (as the head's output is), so the chunked loss writes its gradient in place."""
    leaf = logits.detach().clone().requires_grad_()
    intermediate = leaf * 1
    losses = vocab_parallel_cross_entropy(intermediate, labels, groups, vocab_size, implementation)
    (losses * weights).sum().backward()
    return losses.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [48, 41])  # 41: the last 7 columns are padding
def test_chunked_loss_equals_the_fp32_logits_loss(monkeypatch, dtype, vocab_size):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", SMALL_CHUNKS)
    assert chunk_tokens(PADDED_VOCAB) == 16
    single = ParallelGroups.single_process()
    logits, labels, weights = case(dtype)
    labels = labels % vocab_size
    chunked = loss_and_grad(logits, labels, weights, single, vocab_size, "chunked")
    reference = loss_and_grad(logits, labels, weights, single, vocab_size, "fp32_logits")
    assert chunked[0].dtype == reference[0].dtype == torch.float32
    assert chunked[1].dtype == dtype
    torch.testing.assert_close(chunked[0], reference[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(chunked[1], reference[1], **TOLERANCES[dtype])
    assert torch.all(chunked[1][..., vocab_size:] == 0)


def test_chunked_loss_in_float64_matches_autograd_of_the_formula(monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", SMALL_CHUNKS)
    logits, labels, weights = case(torch.float64)
    labels = labels % 41
    losses, grad = loss_and_grad(logits, labels, weights, ParallelGroups.single_process(), 41, "chunked")
    reference = logits.detach()[..., :41].clone().requires_grad_()
    expected = torch.logsumexp(reference, -1) - reference.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grad[..., :41], reference.grad, rtol=1e-12, atol=1e-14)


def test_the_gradient_overwrites_intermediate_logits_and_never_a_leaf():
    single = ParallelGroups.single_process()
    logits, labels, _ = case(torch.bfloat16)
    leaf = logits.clone().requires_grad_()
    intermediate = leaf * 1
    vocab_parallel_cross_entropy(intermediate, labels, single, PADDED_VOCAB).sum().backward()
    assert torch.equal(intermediate.detach(), leaf.grad)  # the storage now holds the gradient
    leaf.grad = None
    vocab_parallel_cross_entropy(leaf, labels, single, PADDED_VOCAB).sum().backward()
    assert torch.equal(leaf.detach(), logits)  # a leaf is the caller's: left as it was


def test_unknown_implementation_is_refused():
    logits, labels, _ = case(torch.float32)
    with pytest.raises(ValueError, match="chunked"):
        vocab_parallel_cross_entropy(logits, labels, ParallelGroups.single_process(), 48, "fused")


def loss_memory(implementation: str, tokens: int, vocab: int) -> tuple[int, int, int]:
    """(forward peak, kept after the forward, backward peak) bytes of the loss over bf16 logits, beyond the
    logits' producer's own tensors, measured with ``LiveTensorBytes`` on the CPU."""
    hidden = torch.randn(tokens, 16, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(vocab, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    tracker = LiveTensorBytes()
    with tracker:
        base = tracker.live
        logits = hidden @ head.t()
        losses = vocab_parallel_cross_entropy(logits, labels, ParallelGroups.single_process(), vocab, implementation)
        forward_peak = tracker.peak - base
        del logits
        kept = tracker.live - base
        tracker.reset_peak()
        losses.sum().backward()
        backward_peak = tracker.peak - base
    return forward_peak, kept, backward_peak


def test_the_chunked_loss_holds_no_fp32_copy_of_the_logits(monkeypatch):
    """bf16 logits, 8 chunks: the chunked loss keeps the logits (2 bytes each) and holds one fp32 chunk at
    a time; the fp32-logits loss holds an fp32 copy and fp32 log-probabilities in the forward (2 + 4 + 4
    bytes per logit) and keeps the latter."""
    tokens, vocab = 512, 1024
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 64 * 4 * vocab)
    logits_bytes, chunk_bytes = 2 * tokens * vocab, 4 * 64 * vocab
    forward, kept, backward = loss_memory("chunked", tokens, vocab)
    small = 128 * tokens  # per-token vectors (labels, log-sum-exp, masks, the losses): 6% of a row of logits
    assert logits_bytes <= kept <= logits_bytes + small
    assert logits_bytes + chunk_bytes <= forward <= logits_bytes + chunk_bytes + small
    assert logits_bytes + chunk_bytes <= backward <= logits_bytes + chunk_bytes + small
    forward, kept, backward = loss_memory("fp32_logits", tokens, vocab)
    assert forward >= 5 * logits_bytes and kept >= 2 * logits_bytes and backward >= 3 * logits_bytes


def _tensor_parallel_losses(rank: int, world_size: int, vocab_sizes: list[int]) -> dict:
    """Each case's per-token losses and this rank's gradient shard, both implementations, and the number of
    all-reduces each issued."""
    import torch.distributed as dist

    groups = ParallelGroups.build(tensor=world_size, pipeline=1)
    cross_entropy.CHUNK_BYTES = SMALL_CHUNKS // world_size  # 16 tokens a chunk over this rank's vocabulary
    calls = {"n": 0}
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, weights = case(dtype)
        shard = logits.chunk(world_size, dim=-1)[rank]
        for vocab_size in vocab_sizes:
            for implementation in ("chunked", "fp32_logits"):
                calls["n"] = 0
                losses, grad = loss_and_grad(shard, labels % vocab_size, weights, groups, vocab_size, implementation)
                results[(str(dtype), vocab_size, implementation)] = (losses.numpy().copy(), grad.float().numpy().copy(),
                                                                     calls["n"])
    return results


@pytest.mark.multirank
def test_tensor_parallel_chunked_loss_equals_the_single_process_loss(monkeypatch):
    """Two tensor ranks over gloo, each holding half of the 48 columns: the true vocabulary whole (48), with
    padding on the second rank (41), and with the second rank holding padding only (20)."""
    vocab_sizes = [48, 41, 20]
    by_rank = run_distributed(_tensor_parallel_losses, 2, vocab_sizes, timeout_s=240)
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", SMALL_CHUNKS)
    single = ParallelGroups.single_process()
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, weights = case(dtype)
        for vocab_size in vocab_sizes:
            reference = loss_and_grad(logits, labels % vocab_size, weights, single, vocab_size, "chunked")
            for implementation in ("chunked", "fp32_logits"):
                ranks = [result[(str(dtype), vocab_size, implementation)] for result in by_rank]
                for losses, _, _ in ranks:  # every rank of the group has the whole loss
                    torch.testing.assert_close(torch.from_numpy(losses), reference[0], rtol=0, atol=2e-6)
                grad = torch.cat([torch.from_numpy(g) for _, g, _ in ranks], dim=-1)
                torch.testing.assert_close(grad, reference[1].float(), **TOLERANCES[dtype])
                assert torch.all(grad[..., vocab_size:] == 0)
                # chunked: max, then the sums and target logits in one; the reference: three
                assert [n for _, _, n in ranks] == [2, 2] if implementation == "chunked" else [3, 3]
