"""LiveTensorBytes counts storages once, follows frees and resizes, and works on fake tensors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lnstrain.benchmark.tensor_memory import LiveTensorBytes

MIB = 2**20


def test_counts_storages_not_views_and_follows_frees():
    tracker = LiveTensorBytes()
    with tracker:
        a = torch.empty(MIB // 4)  # 1 MiB of fp32
        view = a.view(2, -1)[1]
        b = a * 2
        assert tracker.live == 2 * MIB
        del b
        assert tracker.live == MIB and tracker.peak == 2 * MIB
        del a
        assert tracker.live == MIB  # the view keeps the storage alive
        del view
        assert tracker.live == 0
        tracker.reset_peak()
        c = torch.zeros(10, dtype=torch.bfloat16)
        c.resize_(1000)
        assert tracker.live == tracker.peak == 2000
    del c
    assert tracker.live == 0


def test_tensors_saved_for_backward_stay_counted_until_backward_frees_them():
    tracker = LiveTensorBytes()
    x = torch.randn(256, 256, requires_grad=True)
    matrix = 256 * 256 * 4
    with tracker:
        y = torch.sigmoid(x)  # autograd keeps this output for backward
        z = (y * 3).sum()
        del y
        assert tracker.live >= matrix
        z.backward()
        del z
    assert matrix <= tracker.live < matrix + 1024  # x.grad (and scalars) only: the saved output is gone


def test_fake_tensors_are_counted_without_being_allocated():
    tracker = LiveTensorBytes()
    with FakeTensorMode(), tracker:
        huge = torch.empty(2**40, dtype=torch.uint8)  # 1 TiB, never allocated
        assert tracker.live == 2**40
        del huge
    assert tracker.live == 0 and tracker.peak == 2**40


def test_half_matrix_products_run_in_fp32_but_keep_dtype_bytes_and_errors():
    """Faster on CPUs without native bf16 GEMM; only rounding may differ, and the fp32 copies are not counted."""
    a, b, bias = (torch.randn(shape).to(torch.bfloat16) for shape in ((64, 32), (32, 48), (48,)))
    batched = a[None], b[None], bias[None, None]  # views made outside the mode: not counted
    with LiveTensorBytes() as memory:
        products = [torch.mm(a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
                    torch.bmm(batched[0], batched[1]), torch.baddbmm(batched[2], batched[0], batched[1])]
    products = [p.squeeze(0) for p in products]
    assert memory.peak == memory.live == 4 * 64 * 48 * 2  # the four bf16 results, nothing else
    references = [torch.mm(a, b), torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.mm(a, b), bias + torch.mm(a, b)]
    for product, reference in zip(products, references):
        assert product.dtype == torch.bfloat16 and product.shape == (64, 48) and product.is_contiguous()
        torch.testing.assert_close(product.float(), reference.float(), rtol=2e-2, atol=2e-2)
    with LiveTensorBytes(), pytest.raises(RuntimeError):
        torch.mm(a, b.float())  # mixed dtypes stay an error, as without the mode
