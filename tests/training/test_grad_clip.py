"""lnstrain's gradient clipping with foreach kernels against the per-parameter loop it replaced.

The loop summed each gradient's squares; the foreach form takes each gradient's norm
(``torch._foreach_norm``) and sums their squares, as torch's ``clip_grad_norm_`` and DeepSpeed do. So the
norm is bitwise the per-parameter-norm loop's on the CPU (where the foreach norm is the per-tensor norm),
and within fp32 rounding (relative 1e-6) of the old sum of squares; the clipped gradients are bitwise the
loop's products for the same norm, and within that rounding of the old ones.
"""

import math

import pytest
import torch

from lnstrain.training import grad_clip


def _counted(params, tp_rank):
    return [p for p in params if p.grad is not None and grad_clip.counts_on_this_rank(p, tp_rank)]


def _old_norm(params, tp_rank):
    """The implementation the foreach kernels replaced: one sum of squares and one product per parameter."""
    squares = [p.grad.detach().float().pow(2).sum() for p in _counted(params, tp_rank)]
    return math.sqrt(torch.stack(squares).sum().to(torch.float64).item())


def _norm_of_norms(params, tp_rank):
    """The same formula as the foreach form, one norm kernel per parameter."""
    norms = [p.grad.detach().float().norm(2) for p in _counted(params, tp_rank)]
    return math.sqrt(torch.stack(norms).pow(2).sum().to(torch.float64).item())


def _params(dtypes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for index, dtype in enumerate(dtypes):
        param = torch.nn.Parameter(torch.zeros(17 * (index + 1), 5, dtype=dtype))
        param.grad = (torch.randn(param.shape, generator=generator) * 10 ** (index % 3)).to(dtype)
        params.append(param)
    return params


@pytest.mark.parametrize("dtypes", [[torch.float32] * 6, [torch.float32, torch.bfloat16, torch.float32, torch.float16]],
                         ids=["fp32", "mixed"])
def test_the_norm_is_the_per_parameter_loops(dtypes):
    params = _params(dtypes)
    params[1].tensor_model_parallel = True
    params[2].ds_pipe_replicated = True  # a tied copy: counted on its owning stage only
    params.append(torch.nn.Parameter(torch.ones(3)))  # no gradient
    for tp_rank in (0, 1):
        foreach = grad_clip.global_grad_norm(params, tp_rank, None)
        assert foreach == _norm_of_norms(params, tp_rank)
        assert foreach == pytest.approx(_old_norm(params, tp_rank), rel=1e-6)
    assert grad_clip.global_grad_norm(params[2:3], 0, None) == 0.0  # nothing of this rank's to count


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_scales_every_gradient_as_the_loop_did(max_norm):
    params = _params([torch.float32] * 5, seed=1)
    before = [p.grad.clone() for p in params]
    old_norm = _old_norm(params, 0)
    hook = grad_clip.GradClipHook(params, max_norm, tp_rank=0, model_parallel_group=None)
    hook(None, (), {})
    assert (hook.last_norm > max_norm) == (max_norm == 0.5)  # one clips, one does not
    for param, gradient in zip(params, before, strict=True):
        if hook.last_norm <= max_norm:
            assert torch.equal(param.grad, gradient)
            continue
        assert torch.equal(param.grad, gradient.mul(max_norm / (hook.last_norm + 1e-6)))  # the loop's product
        torch.testing.assert_close(param.grad, gradient.mul(max_norm / (old_norm + 1e-6)), rtol=2e-6, atol=0)


def test_sum_of_squares_groups_devices_and_dtypes_and_handles_nothing():
    assert grad_clip.sum_of_squares([]) is None
    tensors = [torch.full((4,), 2.0), torch.full((2,), 3.0, dtype=torch.bfloat16), torch.full((1,), 1.0)]
    assert grad_clip.sum_of_squares(tensors).item() == 16 + 18 + 1
    grad_clip.scale_(tensors, 0.5)
    assert [t.tolist() for t in tensors] == [[1.0] * 4, [1.5] * 2, [0.5]]
