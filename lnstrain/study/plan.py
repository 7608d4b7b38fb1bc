"""``plan``: every run's size, budget, FLOPs, layout, memory per GPU and GPU-hours, before launching."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lnstrain.config.loader import ConfigError
from lnstrain.estimate.flops import flops_per_token
from lnstrain.estimate.memory import GIB
from lnstrain.study.layout import LayoutChoice, LayoutError, check_layout, choose_layout
from lnstrain.study.runs import StudyRun, study_runs
from lnstrain.study.spec import Study


@dataclass(frozen=True)
class SpeedAssumption:
    """The model FLOPs utilisation GPU-hours are computed with, and where it comes from."""

    mfu: float
    source: str


def assumed_speed(study: Study) -> SpeedAssumption:
    return SpeedAssumption(study.cluster.mfu, "assumed (the study's cluster.mfu), not measured: measure it with "
                           "`python tools/benchmark.py --config <a run's config> --json bench.json` on the cluster's "
                           "GPU and plan with `--mfu-from bench.json`")


def measured_speed(path: str | Path) -> SpeedAssumption:
    """The MFU of the first runner of a ``tools/benchmark.py --json`` file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        runner = doc["runners"][0]
        mfu = runner["throughput"]["mfu"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ConfigError([f"--mfu-from {path}: not a tools/benchmark.py --json file ({error})"]) from None
    if mfu is None:
        raise ConfigError([f"--mfu-from {path}: the benchmark knew no peak TFLOP/s for its device, so it has no MFU; "
                           "rerun it on the cluster's GPU (or pass --peak-tflops)"])
    if not 0 < mfu <= 1:
        raise ConfigError([f"--mfu-from {path}: MFU {mfu} is outside (0, 1]"])
    device = doc.get("environment", {}).get("device_name") or "an unnamed device"
    shape = doc.get("shape", {})
    model = shape.get("model", {})
    where = ", ".join(f"{label} {value}" for label, value in (("hidden", model.get("hidden_size")),
                                                               ("layers", model.get("num_layers")),
                                                               ("seq", shape.get("seq_len"))) if value)
    return SpeedAssumption(float(mfu), f"measured by tools/benchmark.py ({runner.get('name')} on {device}"
                           + (f", {where}" if where else "") + f"; {path}), applied to every size")


@dataclass
class PlannedRun:
    """One row of the plan. ``layout`` is None (and ``error`` says why) when nothing fits."""

    run: StudyRun
    parameters: int
    non_embedding_parameters: int
    tokens: int
    flops: float
    gpus: int
    choice: LayoutChoice | None
    gpu_hours: float
    error: str = ""
    mfu: float = 0.0

    @property
    def config(self):
        return self.choice.config if self.choice else self.run.config

    def row(self) -> dict:
        """Flat, JSON-able description."""
        row = {"run": self.run.name, "size": self.run.size, "scheme": self.run.scheme, "variant": self.run.variant,
               "seed": self.run.seed,
               "parameters": self.parameters, "non_embedding_parameters": self.non_embedding_parameters,
               "tokens": self.tokens, "flops": self.flops, "gpus": self.gpus,
               "gpu_hours": round(self.gpu_hours, 2), "mfu": self.mfu, "error": self.error}
        if self.choice:
            cfg, gpus = self.choice.config, self.choice.gpus
            row.update(tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                       data=cfg.data_parallel_size(gpus), context=cfg.parallel.context,
                       zero_stage=cfg.parallel.zero_stage,
                       micro_batch=cfg.train.micro_batch_size, accumulation=cfg.grad_accumulation_steps(gpus),
                       recompute=cfg.train.activation_checkpointing,
                       memory_gib=round(self.choice.memory.total / GIB, 2),
                       snapshot_host_gib=round(self.choice.memory.snapshot / GIB, 2), notes=self.choice.notes)
        return row


def plan_run(study: Study, run: StudyRun, speed: SpeedAssumption | None = None) -> PlannedRun:
    config, cluster = run.config, study.cluster
    speed = speed or assumed_speed(study)
    gpus = study.spec.gpus_for(run.size)
    tokens = config.total_steps * config.tokens_per_step
    flops = flops_per_token(config.model, config.data.seq_len).noncausal * tokens
    gpu_hours = flops / (cluster.peak_tflops * 1e12 * speed.mfu) / 3600
    choice, error = None, ""
    try:
        choice = (choose_layout if study.spec.search_layout else check_layout)(config, gpus, cluster)
    except LayoutError as failure:
        error = str(failure)
    return PlannedRun(run=run, parameters=config.model.num_parameters(),
                      non_embedding_parameters=config.model.num_parameters(include_embeddings=False),
                      tokens=tokens, flops=flops, gpus=gpus, choice=choice, gpu_hours=gpu_hours, error=error,
                      mfu=speed.mfu)


def plan_study(study: Study, speed: SpeedAssumption | None = None) -> list[PlannedRun]:
    return [plan_run(study, run, speed) for run in study_runs(study)]


def _short(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def format_plan(study: Study, planned: list[PlannedRun], speed: SpeedAssumption | None = None) -> str:
    """A Markdown table of the plan, the assumptions, and every refusal."""
    cluster, speed = study.cluster, speed or assumed_speed(study)
    header = ("| run | params | non-emb | tokens | FLOPs | GPUs | nodes | tp×pp×dp | ZeRO | micro×acc | recompute "
              "| mem/GPU GiB | snapshot host GiB/node | GPU-h |")
    lines = [f"# Plan of study '{study.spec.name}' on '{cluster.name}'", "",
             f"GPU-hours = FLOPs / ({cluster.peak_tflops:g} TFLOP/s × MFU {speed.mfu:.1%}); FLOPs = tokens × "
             f"(6N + 12·L·h·s). Memory must stay under {cluster.memory_margin:.0%} of "
             f"{cluster.gpu_memory_gib:g} GiB per GPU. A checkpoint written in the background (checkpoint.async_save) "
             "first copies each rank's weights and optimizer state into host memory, kept between saves: "
             "'snapshot host GiB/node' is that for one node's ranks.", "", f"Speed: MFU {speed.mfu:.1%}, {speed.source}.", "", header, "|" + "---|" * (header.count("|") - 1)]
    for p in planned:
        nodes = math.ceil(p.gpus / cluster.gpus_per_node)
        if p.choice:
            r = p.row()
            per_node = r["snapshot_host_gib"] * min(p.gpus, cluster.gpus_per_node)
            context = f", context {r['context']}" if r["context"] > 1 else ""
            layout = (f"{r['tensor']}×{r['pipeline']}×{r['data']}{context} | {r['zero_stage']} | "
                      f"{r['micro_batch']}×{r['accumulation']} | {r['recompute']} | {r['memory_gib']:.1f} | "
                      f"{per_node:.1f}")
        else:
            layout = "— | — | — | — | does not fit | —"
        lines.append(f"| {p.run.name} | {_short(p.parameters)} | {_short(p.non_embedding_parameters)} | "
                     f"{_short(p.tokens)} | {p.flops:.2e} | {p.gpus} | {nodes} | {layout} | {p.gpu_hours:,.1f} |")
    total = sum(p.gpu_hours for p in planned)
    lines += ["", f"Total: {len(planned)} runs, {total:,.1f} GPU-hours at {speed.mfu:.1%} MFU ("
              f"{'measured' if speed.source.startswith('measured') else 'assumed'})."]
    sizes_by_note: dict[str, list[str]] = {}
    for p in planned:
        for note in p.choice.notes if p.choice else []:
            sizes = sizes_by_note.setdefault(note, [])
            if p.run.size not in sizes:
                sizes.append(p.run.size)
    if sizes_by_note:
        lines += ["", "Layout notes (the layouts the search skipped, by model size):",
                  *(f"- {', '.join(sizes)}: {note}" for note, sizes in sizes_by_note.items())]
    refused = [p for p in planned if p.error]
    if refused:
        lines += ["", "Refused (no layout fits):", *(f"- {p.run.name}: {p.error}" for p in refused)]
    return "\n".join(lines)


def plan_rows(planned: list[PlannedRun]) -> list[dict]:
    return [p.row() for p in planned]


__all__ = ["PlannedRun", "SpeedAssumption", "assumed_speed", "format_plan", "measured_speed", "plan_rows", "plan_run",
           "plan_study"]
