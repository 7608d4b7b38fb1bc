"""One Triton kernel that adds many bf16 (or fp16) gradients into their fp32 buffers: ``fp32 += bf16``.

torch's ``fp32.add_(bf16)`` runs on its mixed-dtype elementwise path, which is not vectorised: on an H100
the same pattern (the bf16 → fp32 copies of DeepSpeed's gradient add) ran at 1.3–1.6 TB/s, about half of
what a vectorised kernel reaches (docs/performance.md). Here each program adds one chunk of one tensor
with 16-byte loads and stores, and one launch covers every tensor of a bucket: the launch reads a table of
(fp32 offset, bf16 offset, element count) rows, one per chunk of at most ``CHUNK`` elements, the offsets
counted in elements from the first pair's tensors (so that the compiler sees typed pointers it can prove
aligned, which addresses cast from integers are not).

Each sum is the fp32 addition of the fp32 value and the bf16 value widened to fp32 (exact), rounded to
nearest even: what torch's ``add_`` computes, bit for bit (tests/training/test_accumulation_kernel.py, in
Triton's CPU interpreter).

Like lnstrain's other Triton kernels it is used on a device only after it has given torch's bits there:
``usable`` checks it once per process, device and dtype (``matches_torch``, with a warning and torch's add
otherwise). Triton is optional: ``supports`` is False without it, and the caller adds with torch.
"""

from __future__ import annotations

import functools
import logging

import torch

from lnstrain.model.triton_common import runs_on, tl, triton

logger = logging.getLogger(__name__)

CHUNK = 1 << 16
"""Elements per program (a table row): 384 KiB read and 256 KiB written."""
_BLOCK = 2048
"""Elements per loop iteration of a program: with 8 warps, 8 consecutive bf16 (16 bytes) per thread."""


def supports(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether the kernel can add ``source`` into ``target``: Triton on their device (CUDA or the interpreter),
    an fp32 target, a bf16 or fp16 source of the same number of elements, both contiguous."""
    return (runs_on(source.device, source.dtype) and target.dtype == torch.float32 and target.device == source.device
            and target.numel() == source.numel() and target.is_contiguous() and source.is_contiguous())


def usable(target: torch.Tensor, source: torch.Tensor) -> bool:
    """``supports``, and the kernel has given torch's sums on this device and dtype (checked once)."""
    return supports(target, source) and matches_torch(source.device, source.dtype)


@functools.lru_cache(maxsize=None)
def matches_torch(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel builds on ``device`` and adds ``dtype`` gradients into fp32 as torch's ``add_`` does,
    bit for bit, on aligned and unaligned tensors, one of them over several chunks, values from 1e-30 to 1e38."""
    generator = torch.Generator().manual_seed(0)
    sizes = [CHUNK + 4096, 2048, 3, 1000, 16]
    scales = torch.tensor([1e-30, 1e-3, 1.0, 1e3, 1e38 if dtype == torch.bfloat16 else 6e4])
    flat = (torch.randn(sum(sizes), generator=generator) * scales[torch.randint(0, 5, (sum(sizes),), generator=generator)])
    flat = flat.to(device)
    targets = list(flat.split(sizes))
    sources = [(torch.randn(size, generator=generator) * 1e2).to(device, dtype) for size in sizes]
    expected = [target.clone().add_(source) for target, source in zip(targets, sources)]
    try:
        add_into_fp32(list(zip(targets, sources)))
    except Exception as error:  # a Triton or driver failure of any kind: torch's add still works
        logger.warning("the Triton gradient-add kernel failed on %s (%s: %s); adding with torch", device,
                       type(error).__name__, error)
        return False
    differing = sum(int((got != want).sum()) for got, want in zip(targets, expected))
    if differing:
        logger.warning("the Triton gradient-add kernel's %s sums on %s differ from torch's in %d of %d elements; "
                       "adding with torch", dtype, device, differing, flat.numel())
    return differing == 0


def chunk_table(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The kernel's table, int64 [chunks, 3], on ``device``: each chunk's target and source as element offsets
    from the first pair's target and source, and its element count; and whether every chunk starts 16-byte
    aligned and holds a multiple of 16 elements (then the kernel is told so, and accesses 16 bytes at a time)."""
    target_base, source_base = pairs[0][0].data_ptr(), pairs[0][1].data_ptr()
    source_size = pairs[0][1].element_size()
    rows = []
    aligned = True
    for target, source in pairs:
        count = target.numel()
        target_offset = (target.data_ptr() - target_base) // 4
        source_offset = (source.data_ptr() - source_base) // source_size
        aligned = aligned and target.data_ptr() % 16 == 0 and source.data_ptr() % 16 == 0 and count % 16 == 0
        for start in range(0, count, CHUNK):
            rows.append((target_offset + start, source_offset + start, min(CHUNK, count - start)))
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table, aligned


def add_into_fp32(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target += source`` for every (fp32 target, 16-bit source) pair (``supports``), in one launch.
    The sources must stay alive until the launch has run (the caller keeps them until the next step)."""
    pairs = [(target, source) for target, source in pairs if target.numel()]
    if not pairs:
        return
    dtypes = {source.dtype for _, source in pairs}
    if len(dtypes) != 1:
        raise ValueError(f"add_into_fp32 takes one source dtype per launch, got {sorted(map(str, dtypes))}")
    table, aligned = chunk_table(pairs, pairs[0][0].device)
    _add_into_fp32_kernel[(table.shape[0],)](table, pairs[0][0], pairs[0][1], CHUNK=CHUNK, BLOCK=_BLOCK,
                                             ALIGNED=aligned, num_warps=8)


if triton is not None:
    @triton.jit
    def _add_into_fp32_kernel(table, target, source, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                              ALIGNED: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 3
        target_offset = tl.load(row)
        source_offset = tl.load(row + 1)
        count = tl.load(row + 2)
        if ALIGNED:
            target_offset = tl.multiple_of(target_offset, 16)
            source_offset = tl.multiple_of(source_offset, 16)
            count = tl.multiple_of(count, 16)
        for start in range(0, CHUNK, BLOCK):
            at = start + tl.arange(0, BLOCK)
            inside = at < count
            total = (tl.load(target + target_offset + at, mask=inside)
                     + tl.load(source + source_offset + at, mask=inside).to(tl.float32))
            tl.store(target + target_offset + at, total, mask=inside)
