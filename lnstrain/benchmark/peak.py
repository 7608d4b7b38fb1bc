"""Peak dense bf16 matrix rate per accelerator, detected from the device name.

The figures are the vendors' dense (no 2:4 sparsity) bf16 tensor-core peaks, in TFLOP/s. A device
that is not in the table gets no MFU unless ``--peak-tflops`` gives one; a CPU has no entry (its
achievable rate depends on the ISA, the clock and the core count, so MFU on a CPU is left out).
"""

from __future__ import annotations

from dataclasses import dataclass

# (substring of torch.cuda.get_device_name(), TFLOP/s), most specific first: "H100 PCIe" must win
# over "H100", "GH200" over "H200".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),      # SXM5 (names like "NVIDIA H100 80GB HBM3")
    ("A100", 312.0),      # SXM4 and PCIe share the dense bf16 peak
)


@dataclass(frozen=True)
class PeakRate:
    """The peak used for MFU and where it came from (``table:<entry>``, ``--peak-tflops`` or ``none``)."""

    tflops: float | None
    source: str


def detect_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a device name (case-insensitive), or None when it is not listed."""
    name = device_name.upper()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def resolve_peak(device_name: str, override: float | None) -> PeakRate:
    """``override`` when given, else the table's entry for ``device_name``."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"--peak-tflops must be positive (got {override})")
        return PeakRate(override, "--peak-tflops")
    detected = detect_peak_tflops(device_name)
    if detected is None:
        return PeakRate(None, f"none: {device_name!r} is not in lnstrain.benchmark.peak; pass --peak-tflops")
    key = next(key for key, _ in PEAK_BF16_TFLOPS if key in device_name.upper())
    return PeakRate(detected, f"table:{key}")
