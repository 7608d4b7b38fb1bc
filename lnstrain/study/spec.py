"""The study file (``configs/studies/*.yaml``) and the cluster profile it names, as typed dataclasses."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from lnstrain.config.loader import ConfigError, from_dict


@dataclass
class SlurmOptions:
    """How SLURM batch scripts are written and submitted.

    Attributes:
        mode: ``per_node`` (srun starts one DeepSpeed launcher per node, ``--no_ssh``), ``per_rank``
            (srun starts every rank; RANK/LOCAL_RANK/WORLD_SIZE from SLURM) or ``ssh`` (one DeepSpeed
            launcher on the first node reaches the others over ssh/pdsh with the hostfile).
        partition, account: ``#SBATCH`` partition and account (left out when unset).
        time: wall-clock limit of one job.
        signal_seconds: SLURM sends the warning signal (``per_rank``: SIGTERM, else SIGUSR1) this long
            before ``time``; it must cover the slowest step plus a checkpoint save (SLURM may send it up
            to a minute early).
        requeue: a job whose run stopped before its last step (exit 75) puts itself back in the queue
            (``scontrol requeue``) and the same script resumes the run; false: it ends FAILED with
            exit 75, to be resubmitted (by hand or by ``chain_jobs``).
        max_requeues: with ``requeue``: a job that has been requeued this many times
            (``$SLURM_RESTART_COUNT``) is not requeued again.
        chain_jobs: for clusters that forbid requeueing (``requeue: false``): submit this many jobs,
            each starting when the one before ends (``--dependency=afterany``); links after the run
            finished exit at once, and a link after a failed job (exit other than 0 and 75) does not
            resume it.
        cpus_per_task: CPUs per SLURM task.
        directives: extra ``#SBATCH`` lines, e.g. ``--exclusive`` or ``--qos=high``.
        setup: shell lines run before launching (``module load``, ``source venv/bin/activate``).
        submit: ``run`` submits with ``sbatch``; false only writes the scripts.
    """

    mode: Literal["per_node", "per_rank", "ssh"] = "per_node"
    partition: str | None = None
    account: str | None = None
    time: str = "24:00:00"
    signal_seconds: int = 180
    requeue: bool = True
    max_requeues: int = 50
    chain_jobs: int = 1
    cpus_per_task: int = 8
    directives: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    submit: bool = True

    def validate(self) -> list[str]:
        problems = []
        if self.signal_seconds < 1:
            problems.append(f"slurm.signal_seconds must be >= 1 (got {self.signal_seconds})")
        if self.max_requeues < 0:
            problems.append(f"slurm.max_requeues must be >= 0 (got {self.max_requeues})")
        if self.chain_jobs < 1:
            problems.append(f"slurm.chain_jobs must be >= 1 (got {self.chain_jobs})")
        elif self.chain_jobs > 1 and self.requeue:
            problems.append("slurm.chain_jobs > 1 is for clusters that forbid requeueing: set slurm.requeue: false "
                            "(or chain_jobs: 1 to let the job requeue itself)")
        return problems


@dataclass
class ClusterProfile:
    """The machines a study runs on.

    Attributes:
        name: label in plans.
        launcher: ``local`` (runs one after another on this machine), ``deepspeed`` (the DeepSpeed
            launcher with ``hostfile``) or ``slurm`` (batch scripts).
        gpus_per_node: accelerators per node (1 for CPU-only test runs).
        gpu_memory_gib: memory per accelerator.
        memory_margin: fraction of ``gpu_memory_gib`` a layout may use (the estimate leaves out
            the CUDA context, fragmentation and communication buffers).
        peak_tflops: dense bf16 peak per accelerator (A100 312, H100 SXM 989).
        mfu: model FLOPs utilisation assumed for GPU-hour estimates.
        hostfile: DeepSpeed hostfile (``launcher: deepspeed``).
        master_addr, master_port: rendezvous for ``launcher: deepspeed``.
        python: interpreter that runs ``launch/pretrain.py``.
        env: environment for every launch (NCCL settings, ...).
        slurm: options for ``launcher: slurm``.
    """

    name: str = "local"
    launcher: Literal["local", "deepspeed", "slurm"] = "local"
    gpus_per_node: int = 1
    gpu_memory_gib: float = 80.0
    memory_margin: float = 0.9
    peak_tflops: float = 312.0
    mfu: float = 0.4
    hostfile: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    python: str = "python"
    env: dict[str, str] = field(default_factory=dict)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)


SIZE_AXES = {"depth": "num_layers", "width": "hidden_size"}
"""A size axis of ``DepthCollection.size_axes`` and the model field that varies along it."""


@dataclass
class DepthCollection:
    """What ``collect`` measures with the depth analysis (docs/depth_analysis.md) on each run.

    Attributes:
        data: validation token-file prefix (``<prefix>.bin/.idx``) every checkpoint is measured on.
        steps: the checkpoints (``global_step<N>``) to analyse in each run; empty: the final one only.
            Runs shorter than a step skip it. Keep them with ``checkpoint.interval_steps`` dividing
            each step and ``checkpoint.keep_last`` unset.
        num_samples, batch_size: validation windows of ``seq_len + 1`` tokens, and their batching.
        reference: the scheme the others are compared with (the paper's baseline).
        archive: a directory kept with the study (committed) that receives every checkpoint's
            analysis with hashes of the run and data it came from; ``collect`` reads analyses back
            from it when their checkpoints are gone (``study.depth_archive``). Empty: no archive.
        size_axes: the claims' statistics against model size (``study.size_trends``): ``depth`` and/or
            ``width`` → the sizes along that axis, which differ only in ``num_layers`` (``depth``) or
            ``hidden_size`` (``width``, with heads and FFN scaled alike); each run is taken at its last
            step. Empty: no size trends.
        beside: other studies shown beside an axis's trend and not fitted: axis → study files (relative
            to this study's file). Each of their runs' last-step analyses (from their archive when their
            checkpoints are not here) gives one point per claim, at its model's value on that axis, set
            against this study's fitted line there; for points trained differently (another shape, recipe
            or length), which the report says.
    """

    data: str
    steps: list[int] = field(default_factory=list)
    num_samples: int = 64
    batch_size: int = 8
    reference: str = "pre_ln"
    archive: str = ""
    size_axes: dict[str, list[str]] = field(default_factory=dict)
    beside: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class StudySpec:
    """A scaling study: every size × scheme × seed is one run.

    Attributes:
        name: the study's name (plan and result files carry it).
        sizes, schemes: names of ``<sizes_dir>/<size>.yaml`` and ``<schemes_dir>/<scheme>.yaml``.
        seeds: each seeds both the weights (``model.init_seed``) and the data order (``train.seed``).
        recipe: the shared recipe every run starts from; paths are relative to the study file.
        data_prefix: the training corpus (``<prefix>.bin/.idx``), replacing the recipe's sources.
        tokenizer: sentencepiece model of the corpus (optional).
        output_dir: run directories go to ``<output_dir>/<size>_<scheme>_s<seed>``.
        cluster: path to a cluster profile YAML (relative to the study file) or the profile inline.
        gpus_per_run: accelerators per run: ``default`` and optional per-size entries.
        search_layout: choose tensor/pipeline/ZeRO/micro-batch/recomputation to fit memory; false keeps
            each config's own layout (and refuses it if it does not fit).
        set: ``section.key=value`` overrides applied to every run.
        variants: named sets of overrides, another axis of the study (e.g. learning rates or training
            lengths): every size × variant × scheme × seed is one run, named
            ``<size>_<scheme>_<variant>_s<seed>``, with the variant's overrides applied after ``set``.
            Empty (the default): one run per size × scheme × seed, as without this key.
        size_set: ``section.key=value`` overrides for the runs of one size (``size name`` → overrides),
            applied after ``set`` and before the variant's, e.g. a learning rate per width.
        tokens_per_parameter: when set, every run trains ``round(tokens_per_parameter × non-embedding
            parameters / tokens per step)`` steps, so that every size sees the same tokens per
            parameter (``train.steps`` and ``train.tokens`` may then not be set by the overrides).
        depth: depth analysis of the runs' checkpoints at ``collect`` (``DepthCollection``); none when unset.
    """

    name: str
    sizes: list[str]
    schemes: list[str]
    data_prefix: str
    seeds: list[int] = field(default_factory=lambda: [1234])
    recipe: str = "../recipes/paper.yaml"
    sizes_dir: str = "../sizes"
    schemes_dir: str = "../schemes"
    tokenizer: str = ""
    output_dir: str = "runs/study"
    cluster: str | ClusterProfile = field(default_factory=ClusterProfile)
    gpus_per_run: dict[str, int] = field(default_factory=lambda: {"default": 8})
    search_layout: bool = True
    set: list[str] = field(default_factory=list)
    variants: dict[str, list[str]] = field(default_factory=dict)
    size_set: dict[str, list[str]] = field(default_factory=dict)
    tokens_per_parameter: float | None = None
    depth: DepthCollection | None = None

    def gpus_for(self, size: str) -> int:
        return self.gpus_per_run.get(size, self.gpus_per_run.get("default", 1))


@dataclass
class Study:
    """A loaded study: the spec, its resolved cluster profile and the folder its paths are relative to."""

    spec: StudySpec
    cluster: ClusterProfile
    root: Path

    def path(self, relative: str) -> Path:
        return (self.root / relative) if not Path(relative).is_absolute() else Path(relative)

    @property
    def output_dir(self) -> Path:
        return Path(self.spec.output_dir)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError([f"file not found: {path}"], str(path))
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be a mapping"], str(path))
    return data


def load_study(path: str | Path) -> Study:
    """Read and check a study file and its cluster profile; every problem is reported together."""
    path = Path(path)
    spec, problems = from_dict(StudySpec, _read_yaml(path))
    if problems:
        raise ConfigError(problems, str(path))
    cluster = spec.cluster
    if isinstance(cluster, str):
        cluster_path = path.parent / cluster
        cluster, cluster_problems = from_dict(ClusterProfile, _read_yaml(cluster_path))
        if cluster_problems:
            raise ConfigError(cluster_problems, str(cluster_path))
    study = Study(spec=spec, cluster=cluster, root=path.parent)
    problems = []
    for key, names, folder in (("sizes", spec.sizes, spec.sizes_dir), ("schemes", spec.schemes, spec.schemes_dir)):
        if not names:
            problems.append(f"{key} is empty")
        problems += [f"{key}: {name!r} has no {study.path(folder) / (name + '.yaml')}"
                     for name in names if not (study.path(folder) / f"{name}.yaml").is_file()]
    if not study.path(spec.recipe).is_file():
        problems.append(f"recipe: file not found: {study.path(spec.recipe)}")
    if not spec.seeds:
        problems.append("seeds is empty")
    problems += [f"variants: name {name!r} may hold only letters, digits, '.', '-' and '+'"
                 for name in spec.variants if not re.fullmatch(r"[A-Za-z0-9.+-]+", name)]
    problems += [f"size_set: {size!r} is not one of the sizes {spec.sizes}" for size in spec.size_set
                 if size not in spec.sizes]
    if spec.tokens_per_parameter is not None:
        if spec.tokens_per_parameter <= 0:
            problems.append(f"tokens_per_parameter must be positive (got {spec.tokens_per_parameter})")
        overrides = spec.set + [o for group in (*spec.size_set.values(), *spec.variants.values()) for o in group]
        problems += [f"override {o!r}: tokens_per_parameter sets every run's train.steps; remove the override "
                     "(or tokens_per_parameter)" for o in overrides
                     if o.split("=", 1)[0].strip() in ("train.steps", "train.tokens")]
    if spec.depth is not None:
        for axis, sizes in spec.depth.size_axes.items():
            if axis not in SIZE_AXES:
                problems.append(f"depth.size_axes: axis {axis!r} must be one of {list(SIZE_AXES)}")
            problems += [f"depth.size_axes.{axis}: {size!r} is not one of the sizes {spec.sizes}" for size in sizes
                         if size not in spec.sizes]
            if len(set(sizes)) < 2:
                problems.append(f"depth.size_axes.{axis}: a trend needs at least two sizes (got {sizes})")
        for axis, files in spec.depth.beside.items():
            if axis not in spec.depth.size_axes:
                problems.append(f"depth.beside: axis {axis!r} is not one of depth.size_axes {list(spec.depth.size_axes)}")
            problems += [f"depth.beside.{axis}: study file not found: {study.path(file)}" for file in files
                         if not study.path(file).is_file()]
        if spec.depth.reference not in spec.schemes:
            problems.append(f"depth.reference: {spec.depth.reference!r} is not one of the schemes {spec.schemes}")
        if any(step < 1 for step in spec.depth.steps):
            problems.append(f"depth.steps must be positive (got {spec.depth.steps})")
    if not 0 < cluster.mfu <= 1 or not 0 < cluster.memory_margin <= 1:
        problems.append("cluster.mfu and cluster.memory_margin must be in (0, 1]")
    if cluster.launcher == "deepspeed" and not cluster.hostfile:
        problems.append("cluster.launcher 'deepspeed' needs cluster.hostfile (see launch/hostfile.example)")
    problems += [f"cluster.{problem}" for problem in cluster.slurm.validate()]
    if problems:
        raise ConfigError(problems, str(path))
    return study
