"""MFU arithmetic, the peak table and the paired statistics of lnstrain.benchmark."""

import math

import pytest

from lnstrain.benchmark.peak import detect_peak_tflops, resolve_peak
from lnstrain.benchmark.throughput import throughput
from lnstrain.benchmark.timing import paired_ratio, summarize
from lnstrain.estimate.flops import FlopsPerToken, flops_per_token
from lnstrain.model.presets import model_preset


def test_throughput_and_mfu_by_hand():
    flops = FlopsPerToken(matmul_params=1_000_000, dense=6_000_000, attention_noncausal=2_000_000,
                          attention_causal=1_000_000)
    rate = throughput(step_seconds=0.5, tokens_per_step=8192, flops=flops, num_devices=4, peak_tflops=100.0)
    assert rate.tokens_per_s == pytest.approx(16384.0)
    assert rate.tokens_per_s_per_device == pytest.approx(4096.0)
    assert rate.tflops_per_device == pytest.approx(8e6 * 4096 / 1e12)      # (6N + 12Lhs) per token
    assert rate.tflops_per_device_causal == pytest.approx(7e6 * 4096 / 1e12)
    assert rate.mfu == pytest.approx(rate.tflops_per_device / 100.0)
    assert throughput(0.5, 8192, flops, 4, None).mfu is None
    with pytest.raises(ValueError, match="step_seconds > 0"):
        throughput(0.0, 8192, flops, 1, None)


def test_mfu_of_the_1b_config_uses_the_estimates_formula():
    model = model_preset("1b", max_seq_len=2048)
    flops = flops_per_token(model, 2048)
    # 6N + 12·L·h·s with N = non-embedding parameters + V·h (the head)
    n = model.num_parameters(include_embeddings=False) + model.vocab_size * model.hidden_size
    assert flops.noncausal == 6 * n + 12 * 24 * 2048 * 2048
    # 45% MFU on a 989 TFLOP/s GPU is this many tokens/s
    tokens_per_s = 0.45 * 989e12 / flops.noncausal
    rate = throughput(8192 / tokens_per_s, 8192, flops, 1, 989.0)
    assert rate.mfu == pytest.approx(0.45)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA GeForce RTX 3090", None), ("cpu", None)])
def test_peak_table(name, tflops):
    assert detect_peak_tflops(name) == tflops


def test_peak_override_and_unknown_device():
    assert resolve_peak("NVIDIA H100 PCIe", None).source == "table:H100 PCIE"
    assert resolve_peak("NVIDIA H100 PCIe", 500.0).tflops == 500.0
    unknown = resolve_peak("Some GPU", None)
    assert unknown.tflops is None and "--peak-tflops" in unknown.source
    with pytest.raises(ValueError, match="--peak-tflops must be positive"):
        resolve_peak("NVIDIA H200", 0.0)


def test_fp8_mfu_is_counted_against_the_bf16_peak():
    """torchtitan's convention: float8 linears do the same model FLOPs and MFU keeps the dense bf16 peak, so
    an FP8 step 1.2x faster shows as 1.2x the MFU."""
    from lnstrain.benchmark.report import peak_section

    h100 = resolve_peak("NVIDIA H100 80GB HBM3", None)
    assert peak_section(h100, "none") == {"tflops": 989.0, "dtype": "bf16 dense", "source": "table:H100"}
    section = peak_section(h100, "rowwise")
    assert section["tflops"] == 989.0 and section["dtype"] == "bf16 dense"
    assert "precision.fp8 rowwise" in section["note"] and "bf16 peak" in section["note"]
    flops = flops_per_token(model_preset("1b_fast", max_seq_len=2048), 2048)
    bf16, fp8 = (throughput(seconds, 65536, flops, 1, section["tflops"]) for seconds in (1.2, 1.0))
    assert fp8.mfu / bf16.mfu == pytest.approx(1.2)


def test_summary_and_paired_ratio():
    summary = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (summary.median, summary.min, summary.max) == (3.0, 1.0, 100.0)
    reference = [1.0, 2.0, 4.0, 1.5, 3.0, 2.5] * 5          # a drifting machine...
    runner = [t * 1.02 for t in reference]                   # ...and a runner 2% slower at every step
    ratio = paired_ratio("b", runner, "a", reference)
    assert ratio.median_ratio == pytest.approx(1.02)
    assert ratio.ci95[0] == pytest.approx(1.02) and ratio.ci95[1] == pytest.approx(1.02)
    noisy = paired_ratio("b", [t * (1.0 + 0.05 * math.sin(i)) for i, t in enumerate(reference)], "a", reference)
    assert noisy.ci95[0] < noisy.median_ratio < noisy.ci95[1] and noisy.pairs == 30
    with pytest.raises(ValueError, match="equally many steps"):
        paired_ratio("b", [1.0], "a", [1.0, 2.0])
