"""The Triton kernel that adds bf16 (fp16) gradients into fp32 buffers, many tensors a launch
(``lnstrain.training.accumulation_kernel``), gives torch's ``fp32.add_(bf16)`` bit for bit.

    TRITON_INTERPRET=1 python -m pytest tests/training/test_accumulation_kernel.py

Skipped where Triton is not installed or neither CUDA nor the interpreter applies. The sums are exact
fp32 additions, so the interpreter's results are the GPU's.
"""

import os

import pytest
import torch

from lnstrain.training import accumulation_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    accumulation_kernel.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton, and CUDA or TRITON_INTERPRET=1")


def _pairs(sizes, source_dtype, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(sizes), generator=generator).to(DEVICE) * 1e3  # one buffer, as DeepSpeed's fp32 gradients
    targets = list(flat.split(sizes))
    sources = [(torch.randn(size, generator=generator) * scale).to(DEVICE, source_dtype) for size in sizes]
    return flat, targets, sources


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sizes", [[2048, 4096, 16], [1, 7, 1000, 3], [accumulation_kernel.CHUNK * 2 + 48, 5]],
                         ids=["aligned", "unaligned", "several chunks"])
@pytest.mark.parametrize("scale", [1.0, 1e-6, 3e4])
def test_one_launch_adds_every_pair_as_torchs_add_does(source_dtype, sizes, scale):
    flat, targets, sources = _pairs(sizes, source_dtype, seed=len(sizes), scale=scale)
    expected = [target.clone().add_(source) for target, source in zip(targets, sources)]
    accumulation_kernel.add_into_fp32(list(zip(targets, sources)))
    for got, want in zip(targets, expected, strict=True):
        assert torch.equal(got, want), int((got != want).sum())


def test_the_table_says_when_every_chunk_is_16_byte_aligned():
    _, targets, sources = _pairs([2048, 4096], torch.bfloat16, seed=0)
    table, aligned = accumulation_kernel.chunk_table(list(zip(targets, sources)), torch.device("cpu"))
    assert aligned and table.tolist() == [[0, 0, 2048], [2048, (sources[1].data_ptr() - sources[0].data_ptr()) // 2, 4096]]
    _, targets, sources = _pairs([3, 4096], torch.bfloat16, seed=0)  # the second target starts 12 bytes in
    assert not accumulation_kernel.chunk_table(list(zip(targets, sources)), torch.device("cpu"))[1]


def test_supports_only_contiguous_fp32_targets_of_16_bit_sources():
    target, source = torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE, dtype=torch.bfloat16)
    assert accumulation_kernel.supports(target, source)
    assert not accumulation_kernel.supports(target, source.float())
    assert not accumulation_kernel.supports(target.double(), source)
    assert not accumulation_kernel.supports(torch.zeros(4, 4, device=DEVICE).t(), source.view(4, 2).repeat(1, 2))
    with pytest.raises(ValueError, match="one source dtype"):
        accumulation_kernel.add_into_fp32([(target, source), (target.clone(), source.half())])


def test_the_kernel_passes_its_own_check_and_a_failing_one_is_not_used(monkeypatch, caplog):
    import logging

    device = torch.device(DEVICE)
    accumulation_kernel.matches_torch.cache_clear()
    try:
        assert accumulation_kernel.matches_torch(device, torch.bfloat16)
        target, source = torch.zeros(32, device=DEVICE), torch.ones(32, device=DEVICE, dtype=torch.bfloat16)
        assert accumulation_kernel.usable(target, source)
        accumulation_kernel.matches_torch.cache_clear()
        real = accumulation_kernel.add_into_fp32

        def off_by_one_ulp(pairs):
            real(pairs)
            pairs[0][0].view(torch.int32)[0] += 1

        monkeypatch.setattr(accumulation_kernel, "add_into_fp32", off_by_one_ulp)
        with caplog.at_level(logging.WARNING, logger="lnstrain.training.accumulation_kernel"):
            assert not accumulation_kernel.usable(target, source)
        assert "differ from torch's in 1 of" in caplog.text
    finally:
        accumulation_kernel.matches_torch.cache_clear()
