"""SLURM: expand node lists, write DeepSpeed hostfiles, render batch scripts.

The batch script builds the hostfile from ``$SLURM_JOB_NODELIST`` at run time (with
``launch/slurm/hostfile.py``), takes the first node as the rendezvous master and derives the port
from the job id (so two jobs sharing a node do not collide), then starts the ranks in one of three
ways (``SlurmOptions.mode``): one DeepSpeed launcher per node (``srun`` + ``--no_ssh``), one srun task
per rank (RANK/LOCAL_RANK/WORLD_SIZE from SLURM), or one DeepSpeed launcher that reaches the other
nodes over ssh. SLURM is asked for a warning signal before the time limit, so every rank saves a
checkpoint and exits 0, and the next submission resumes. With one srun task per rank the ranks get
SIGTERM directly. A DeepSpeed launcher would kill its ranks 30 s after a SIGTERM (too short for a large
checkpoint), so in ``per_node`` mode it runs under ``launch/slurm/preemptible.py`` and SLURM sends
SIGUSR1, which the launcher ignores and the ranks (or the wrapper, which relays it) turn into a save.
In ``ssh`` mode the signal cannot reach the remote ranks; prefer ``per_node`` for preemptible jobs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from lnstrain.study.spec import ClusterProfile

_RANGE = re.compile(r"^(\d+)-(\d+)$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    return parts + [current] if current else parts


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ('gpu[01-03,07],login1') -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            span = _RANGE.match(item)
            if span:
                start, end = span.groups()
                hosts += [f"{prefix}{n:0{len(start)}d}{suffix}" for n in range(int(start), int(end) + 1)]
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def hostfile_text(hosts: list[str], slots: int) -> str:
    """A DeepSpeed hostfile: one 'host slots=N' line per node."""
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def _launch_lines(mode: str, config_path: str, nodes: int, gpus_per_node: int) -> list[str]:
    train = f'"$PYTHON" launch/pretrain.py --config {shlex.quote(config_path)}'
    rendezvous = '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"'
    if mode == "per_rank":
        return [f"srun --ntasks-per-node={gpus_per_node} --kill-on-bad-exit=1 bash -c '"
                f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec {train}'"]
    deepspeed = (f'deepspeed --hostfile "$HOSTFILE" --num_nodes {nodes} --num_gpus {gpus_per_node} {rendezvous} '
                 f"--no_local_rank")
    if mode == "ssh":
        return [f"{deepspeed} --launcher pdsh launch/pretrain.py --config {shlex.quote(config_path)}"]
    # per_node: deepspeed's own python is the one on PATH; the trainer sees LOCAL_RANK etc. from it
    return [f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '"
            f"exec \"$PYTHON\" launch/slurm/preemptible.py -- {deepspeed} --no_ssh --node_rank \"$SLURM_NODEID\" "
            f"launch/pretrain.py --config {shlex.quote(config_path)}'"]


def _warning_signal(mode: str) -> str:
    """The signal SLURM sends before the time limit: what makes every rank of this mode save."""
    return "TERM" if mode == "per_rank" else "USR1"


def render_sbatch(job_name: str, run_dir: Path, config_path: str, gpus: int, cluster: ClusterProfile,
                  repo_root: Path) -> str:
    """The batch script that trains ``config_path`` on ``gpus`` GPUs (whole nodes) of ``cluster``."""
    options = cluster.slurm
    gpus_per_node = min(gpus, cluster.gpus_per_node)
    nodes = -(-gpus // gpus_per_node)
    tasks_per_node = gpus_per_node if options.mode == "per_rank" else 1
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
                  f"--gpus-per-node={gpus_per_node}",
                  f"--cpus-per-task={max(1, options.cpus_per_task // tasks_per_node)}",
                  f"--time={options.time}", f"--output={run_dir}/slurm-%j.out",
                  f"--signal={_warning_signal(options.mode)}@{options.signal_seconds}"]
    directives += [f"--partition={options.partition}"] * bool(options.partition)
    directives += [f"--account={options.account}"] * bool(options.account)
    directives += options.directives
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             f"# Generated by lnstrain.study.slurm for run '{job_name}'. Resubmitting resumes from the latest "
             "checkpoint.", "set -euo pipefail", f"cd {shlex.quote(str(repo_root))}", *options.setup,
             *(f"export {key}={shlex.quote(str(value))}" for key, value in sorted(cluster.env.items())),
             f"export PYTHON=${{PYTHON:-{shlex.quote(cluster.python)}}}",
             'export MASTER_ADDR=$("$PYTHON" launch/slurm/hostfile.py --master)',
             'export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}',
             f'export HOSTFILE={shlex.quote(str(run_dir))}/hostfile.$SLURM_JOB_ID',
             f'"$PYTHON" launch/slurm/hostfile.py --slots {gpus_per_node} > "$HOSTFILE"',
             'echo "nodes: $SLURM_JOB_NODELIST master: $MASTER_ADDR:$MASTER_PORT"',
             *_launch_lines(options.mode, config_path, nodes, gpus_per_node)]
    return "\n".join(lines) + "\n"
