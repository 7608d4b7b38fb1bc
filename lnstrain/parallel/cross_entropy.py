"""Cross-entropy over vocabulary-sharded logits, without gathering the full logits.

Each rank holds the logits of a contiguous vocabulary range; a max and a sum over the vocabulary,
all-reduced over the tensor-parallel group, give the exact loss, and the gradient, softmax - one_hot,
is computed locally. Vocabulary entries past the true vocabulary (padding) are excluded: their
probability is exactly 0. Two implementations (``model.cross_entropy``):

- ``chunked`` (the default): fp32 arithmetic over 16-bit logits without an fp32 copy of them. The
  forward keeps the logits themselves and one fp32 log-sum-exp per token, and walks the tokens in
  chunks of at most ``CHUNK_BYTES`` of fp32, one chunk alive at a time; the backward recomputes each chunk's softmax from them
  and writes the gradient, rounded once to the logits' dtype, into the logits' own storage where
  nothing else can see it (``_ChunkedCrossEntropy``). Two all-reduces under tensor parallelism.
- ``fp32_logits``: the reference it replaced. With one tensor rank torch's ``log_softmax(dtype=float32)``,
  which for bf16 logits first makes an fp32 copy of them (on CUDA as on the CPU: ATen's fused
  half-to-float path takes fp16 only) and keeps fp32 log-probabilities for backward; with several, an
  fp32 softmax kept for backward and three all-reduces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups

IMPLEMENTATIONS = ("chunked", "fp32_logits")
CHUNK_BYTES = 1 << 27
"""fp32 bytes of one chunk of the chunked loss (128 MiB: 1,048 tokens at vocabulary 32,000)."""


def _all_reduce(x: torch.Tensor, groups: ParallelGroups, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if groups.tp_size > 1:
        dist.all_reduce(x, op=op, group=groups.tp_group)
    return x


def chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk of the chunked loss: ``CHUNK_BYTES`` of fp32 over this rank's vocabulary."""
    return max(1, CHUNK_BYTES // (4 * max(local_vocab, 1)))


def _mask_padded_columns(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """-inf in the columns past the true vocabulary (decided from ints: no host-device sync)."""
    real_columns = vocab_size - vocab_start
    if real_columns >= logits.shape[-1]:
        return logits
    padded_columns = torch.arange(logits.shape[-1], device=logits.device) >= real_columns
    return logits.masked_fill(padded_columns, float("-inf"))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_v exp(z_v)) - z_label from 16-bit logits z, in fp32 (or the logits'
    dtype, if wider), chunk by chunk; any tensor-parallel size."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, groups: ParallelGroups, vocab_size: int):
        local_vocab = logits.shape[-1]
        vocab_start = groups.tp_rank * local_vocab
        real = min(max(vocab_size - vocab_start, 0), local_vocab)
        compute = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, local_vocab)
        tokens = flat.shape[0]
        real_logits = flat[:, :real]

        # The max is exact in the logits' own dtype: no copy of them is made for it.
        if real:
            logits_max = real_logits.amax(dim=-1).to(compute)
        else:
            logits_max = flat.new_full((tokens,), float("-inf"), dtype=compute)
        logits_max = _all_reduce(logits_max, groups, dist.ReduceOp.MAX)

        local_labels = labels.reshape(-1) - vocab_start
        here = (local_labels >= 0) & (local_labels < local_vocab)
        local_labels = local_labels.masked_fill(~here, 0)
        target = flat.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).to(compute).masked_fill_(~here, 0.0)

        sum_exp = torch.zeros(tokens, dtype=compute, device=logits.device)
        step = chunk_tokens(local_vocab)
        for start in range(0, tokens if real else 0, step):
            rows = slice(start, start + step)
            shifted = torch.sub(real_logits[rows], logits_max[rows].unsqueeze(-1))  # one read, an fp32 chunk
            torch.sum(shifted.exp_(), dim=-1, out=sum_exp[rows])
            del shifted  # before the next chunk's is allocated
        if groups.tp_size > 1:
            sums = _all_reduce(torch.stack([sum_exp, target]), groups)
            sum_exp, target = sums[0], sums[1]
        log_sum_exp = logits_max + sum_exp.log()

        # The gradient may overwrite the logits only where no one else can hold them: an intermediate
        # result, not a view of another tensor (a leaf is the caller's own).
        ctx.in_place = not logits.is_leaf and logits._base is None and logits.is_contiguous()
        ctx.real, ctx.compute = real, compute
        ctx.save_for_backward(logits, local_labels, here, log_sum_exp)
        return (log_sum_exp - target).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, local_labels, here, log_sum_exp = ctx.saved_tensors
        real, compute = ctx.real, ctx.compute
        flat = logits.reshape(-1, logits.shape[-1])
        grad = flat if ctx.in_place else torch.empty_like(flat)
        grad_loss = grad_loss.reshape(-1, 1).to(compute)
        target_here = here.to(compute).neg_().unsqueeze(-1)
        step = chunk_tokens(flat.shape[-1])
        for start in range(0, flat.shape[0] if real else 0, step):
            rows = slice(start, start + step)
            softmax = torch.sub(flat[rows, :real], log_sum_exp[rows].unsqueeze(-1)).exp_()
            softmax.scatter_add_(-1, local_labels[rows].unsqueeze(-1), target_here[rows])
            grad[rows, :real] = softmax.mul_(grad_loss[rows])
            del softmax
        if real < flat.shape[-1]:
            grad[:, real:] = 0
        return grad.view_as(logits), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``fp32_logits``, tensor-parallel: max, target logit and sum of exponentials all-reduced; the
    logits upcast to fp32, one new buffer (the softmax, kept for backward), the other passes in place."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, groups: ParallelGroups, vocab_size: int):
        local_vocab = logits.shape[-1]
        vocab_start = groups.tp_rank * local_vocab
        logits = _mask_padded_columns(logits.float(), vocab_start, vocab_size)
        logits_max = _all_reduce(logits.max(dim=-1).values, groups, dist.ReduceOp.MAX)

        local_labels = labels - vocab_start
        not_here = (local_labels < 0) | (local_labels >= local_vocab)
        local_labels = local_labels.masked_fill(not_here, 0)
        target_logit = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1) - logits_max
        target_logit = _all_reduce(target_logit.masked_fill(not_here, 0.0), groups)

        exp_shifted = torch.sub(logits, logits_max.unsqueeze(-1)).exp_()
        sum_exp = _all_reduce(exp_shifted.sum(dim=-1), groups)
        loss = sum_exp.log() - target_logit

        softmax = exp_shifted.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, not_here)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_labels, not_here = ctx.saved_tensors
        grad = softmax
        target_here = (~not_here).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -target_here)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """``fp32_logits``, one rank: torch's fused log-softmax into fp32 (for bf16 logits, after an fp32
    copy of them), one fp32 buffer kept for backward, where it becomes the softmax in place."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int):
        log_probs = torch.log_softmax(_mask_padded_columns(logits, 0, vocab_size), dim=-1, dtype=torch.float32)
        ctx.save_for_backward(log_probs, labels)
        return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1).neg()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, labels = ctx.saved_tensors
        grad = log_probs.exp_()
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad.new_full((*labels.shape, 1), -1.0))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, groups: ParallelGroups,
                                 vocab_size: int, implementation: str = "chunked") -> torch.Tensor:
    """Per-token loss [batch, seq] (fp32) from this rank's logits [batch, seq, local_vocab].

    `vocab_size` is the true vocabulary: logits of padded entries beyond it are ignored.
    `implementation`: ``chunked`` or ``fp32_logits`` (the module docstring). ``chunked`` may write the
    logits' gradient into the logits tensor itself during backward when they are an intermediate result
    (not a leaf, not a view): read them before backward, not after.
    """
    if implementation == "chunked":
        return _ChunkedCrossEntropy.apply(logits, labels, groups, vocab_size)
    if implementation != "fp32_logits":
        raise ValueError(f"cross-entropy implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if groups.tp_size == 1:
        return _CrossEntropy.apply(logits, labels, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits, labels, groups, vocab_size)
