"""The benchmark's JSON document and its text rendering.

Schema ``lnstrain.benchmark/1`` (``REQUIRED_FIELDS`` lists the keys every document has): the
command, environment and shape, the FLOP convention and peak, then per runner the step-time
summary, rates, phase breakdown and last loss; the paired comparisons against the first runner;
and the memory peak beside the estimate; with ``--profile-steps``, ``profile`` (``lnstrain.benchmark.profile``).
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from lnstrain.benchmark.gpu_summary import triton_kernels_line
from lnstrain.benchmark.peak import PeakRate
from lnstrain.benchmark.profile import format_profile
from lnstrain.config.feasibility import compiles_layers
from lnstrain.config.run_config import Config
from lnstrain.estimate.flops import FLOPS_FORMULA, FlopsPerToken

SCHEMA = "lnstrain.benchmark/1"
REQUIRED_FIELDS = ("schema", "command", "environment", "shape", "flops", "peak", "protocol", "runners",
                   "comparisons", "memory")
RUNNER_FIELDS = ("name", "kind", "norm_scheme", "step_time_s", "cpu_time_s", "throughput", "breakdown_s",
                 "last_loss")


def is_complete(doc: Any) -> bool:
    """Whether ``doc`` (a parsed JSON report) is a whole report of this schema: every required field,
    every runner with its fields. A caller that finds one can take its figures whatever became of the
    process that wrote it."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or any(key not in doc for key in REQUIRED_FIELDS):
        return False
    runners = doc["runners"]
    return isinstance(runners, list) and all(isinstance(run, dict) and all(key in run for key in RUNNER_FIELDS)
                                             for run in runners)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device, world_size: int) -> dict[str, Any]:
    import os

    from lnstrain.benchmark.hf_baseline import transformers_version

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    try:
        import deepspeed
        deepspeed_version = deepspeed.__version__
    except ImportError:
        deepspeed_version = None
    return {
        "device_type": device.type, "device_name": name, "world_size": world_size,
        "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed_version,
        "transformers": transformers_version(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def triton_kernels(device: torch.device, dtype_name: str) -> dict[str, bool] | None:
    """Which of lnstrain's Triton kernels the steps ran on ``device`` in ``dtype_name`` ("bf16", "fp16"):
    each is used only after its once-per-process check against the eager ops passed (the checks' cached
    answers). None where none can run: no Triton, not CUDA, or fp32."""
    from lnstrain.model import triton_common
    from lnstrain.model.build import TRITON_KERNELS

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name)
    if dtype is None or device.type != "cuda" or not triton_common.runs_on(device, dtype):
        return None
    return {name: usable(device, dtype) for name, (_, usable) in TRITON_KERNELS.items()}


def shape(config: Config, world_size: int, device_type: str) -> dict[str, Any]:
    model, train = config.model, config.train
    return {
        "seq_len": config.data.seq_len, "global_batch_size": train.global_batch_size,
        "micro_batch_size": train.micro_batch_size,
        "grad_accumulation_steps": config.grad_accumulation_steps(world_size),
        "tokens_per_step": config.tokens_per_step, "dtype": config.precision.dtype, "fp8": config.precision.fp8,
        "compile": compiles_layers(config, device_type), "compile_setting": train.compile,
        "compile_backend": train.compile_backend, "activation_checkpointing": train.activation_checkpointing,
        "tensor": config.parallel.tensor, "pipeline": config.parallel.pipeline,
        "zero_stage": config.parallel.zero_stage,
        "model": {"hidden_size": model.hidden_size, "num_layers": model.num_layers, "num_heads": model.num_heads,
                  "num_kv_heads": model.kv_heads, "ffn_hidden_size": model.ffn_hidden_size,
                  "vocab_size": model.vocab_size, "padded_vocab_size": model.padded_vocab_size(1),
                  "tie_embeddings": model.tie_embeddings, "parameters": model.num_parameters()},
    }


def flops_section(flops: FlopsPerToken) -> dict[str, Any]:
    return {"formula": FLOPS_FORMULA, "convention_for_mfu": "noncausal", "matmul_params": flops.matmul_params,
            "per_token_noncausal": flops.noncausal, "per_token_causal": flops.causal}


def peak_section(peak: PeakRate, fp8: str) -> dict[str, Any]:
    """The peak MFU is counted against: the dense bf16 rate, with float8 linears too (torchtitan's
    convention: the same model FLOPs over the same peak, so float8's gain shows as a higher MFU)."""
    section: dict[str, Any] = {"tflops": peak.tflops, "dtype": "bf16 dense", "source": peak.source}
    if fp8 != "none":
        section["note"] = (f"precision.fp8 {fp8}: MFU is still counted against the dense bf16 peak, as torchtitan "
                           "reports it (the float8 peak is twice that)")
    return section


def _fp8_words(shape_doc: dict[str, Any]) -> str:
    fp8 = shape_doc.get("fp8", "none")
    return "" if fp8 == "none" else f" with fp8 {fp8} linears (MFU against the bf16 peak)"


def _rate(value: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value * scale)


def format_report(doc: dict[str, Any]) -> str:
    """A few lines for the terminal; the JSON holds everything."""
    env, shp, peak = doc["environment"], doc["shape"], doc["peak"]
    lines = [
        f"device {env['device_name']} ({env['device_type']}) × {env['world_size']}, torch {env['torch']}, "
        f"{env['torch_threads']} threads; {shp['tokens_per_step']:,} tokens/step (batch {shp['global_batch_size']} "
        f"× seq {shp['seq_len']}), {shp['dtype']}{_fp8_words(shp)}, compile {shp['compile']}, checkpointing "
        f"{shp['activation_checkpointing']}; peak {peak['tflops'] or '-'} TFLOP/s ({peak['source']})",
        f"{'runner':<28} {'median s':>9} {'p10-p90 s':>15} {'CPU s':>7} {'tok/s':>10} {'tok/s/dev':>10} "
        f"{'TFLOP/s':>8} {'MFU':>6}  fwd/bwd/opt s",
    ]
    for run in doc["runners"]:
        t, rate, phases = run["step_time_s"], run["throughput"], run["breakdown_s"]
        split = "/".join(f"{phases[p]:.3f}" for p in ("forward", "backward", "optimizer")) if phases else "-"
        cpu = f"{run['cpu_time_s']['median']:7.3f}" if run["cpu_time_s"] else f"{'-':>7}"
        lines.append(f"{run['name']:<28} {t['median']:9.4f} {t['p10']:7.4f}-{t['p90']:<7.4f} {cpu} "
                     f"{rate['tokens_per_s']:10.1f} {rate['tokens_per_s_per_device']:10.1f} "
                     f"{rate['tflops_per_device']:8.3f} {_rate(rate['mfu'], 100, '{:.1f}%'):>6}  {split}")
    for comp in doc["comparisons"]:
        low, high = comp["ci95"]
        line = (f"{comp['runner']} / {comp['reference']}: median step-time ratio {comp['median_ratio']:.4f} "
                f"(95% CI {low:.4f}-{high:.4f}, {comp['pairs']} interleaved pairs)")
        if "cpu_time_median_ratio" in comp:
            low, high = comp["cpu_time_ci95"]
            line += f"; CPU-time ratio {comp['cpu_time_median_ratio']:.4f} (95% CI {low:.4f}-{high:.4f})"
        lines.append(line)
    mem = doc["memory"]
    if mem:
        kind, measured = next((key, mem[key]) for key in ("peak_allocated_bytes", "peak_tensor_bytes", "peak_rss_bytes")
                              if mem.get(key) is not None)
        ratio = mem["estimate_over_measured"]
        lines.append(f"memory: measured {measured / 2**30:.2f} GiB ({kind}), estimate {mem['estimated_bytes'] / 2**30:.2f} GiB"
                     + (f" (estimate/measured {ratio:.3f})" if ratio is not None else f" ({mem['note']})"))
    if doc.get("triton_kernels") is not None:
        lines.append(triton_kernels_line(doc["triton_kernels"]))
    if doc.get("profile"):
        lines += format_profile(doc["profile"])
    lines += [f"note: {note}" for note in doc.get("notes", [])]
    return "\n".join(lines)
