"""SLURM: expand node lists, write DeepSpeed hostfiles, render and submit batch scripts.

The batch script builds the hostfile from ``$SLURM_JOB_NODELIST`` at run time (with
``launch/slurm/hostfile.py``), takes the first node as the rendezvous master and derives the port
from the job id (so two jobs sharing a node do not collide), then starts the ranks in one of three
ways (``SlurmOptions.mode``): one DeepSpeed launcher per node (``srun`` + ``--no_ssh``), one srun task
per rank (RANK/LOCAL_RANK/WORLD_SIZE from SLURM), or one DeepSpeed launcher that reaches the other
nodes over ssh.

A run outlives its jobs: SLURM sends a warning signal before the time limit, every rank saves after
the same step and ``launch/pretrain.py`` exits 75 (stopped to be resumed); the script then requeues
its own job (``scontrol requeue``, ``--requeue``), which runs the same script again and resumes from
``latest``. Exit 0 (finished), a crash, a bad config (2) or non-finite losses (3) end the job with that
status and are never requeued. Which signal: with one srun task per rank the ranks get SIGTERM
directly. A DeepSpeed launcher would kill its ranks 30 s after a SIGTERM (too short for a large
checkpoint), so in ``per_node`` mode it runs under ``launch/slurm/preemptible.py`` and SLURM sends
SIGUSR1, which the launcher ignores and the ranks (or the wrapper, which relays it) turn into a save.
In ``ssh`` mode only the batch shell runs on the first node: it gets the signal (``B:USR1``) and the
wrapper relays it to that node's ranks, which is enough (the ranks agree through an all-reduce).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from lnstrain.run_files import CHECKPOINTS_DIR, HOSTFILE_PREFIX, LATEST_FILE, SLURM_JOBS_LOG, SLURM_OUTPUT
from lnstrain.study.spec import ClusterProfile, SlurmOptions
from lnstrain.training.outcome import EXIT_STOPPED

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


def _launch_command(mode: str, config_path: str, nodes: int, gpus_per_node: int) -> str:
    train = f'"$PYTHON" launch/pretrain.py --config {shlex.quote(config_path)}'
    rendezvous = '--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"'
    if mode == "per_rank":
        return (f"srun --ntasks-per-node={gpus_per_node} --kill-on-bad-exit=1 bash -c '"
                f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec {train}'")
    deepspeed = (f'deepspeed --hostfile "$HOSTFILE" --num_nodes {nodes} --num_gpus {gpus_per_node} {rendezvous} '
                 f"--no_local_rank")
    if mode == "ssh":
        return (f'"$PYTHON" launch/slurm/preemptible.py -- {deepspeed} --launcher pdsh launch/pretrain.py '
                f"--config {shlex.quote(config_path)}")
    # per_node: deepspeed's own python is the one on PATH; the trainer sees LOCAL_RANK etc. from it
    return (f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '"
            f"exec \"$PYTHON\" launch/slurm/preemptible.py -- {deepspeed} --no_ssh --node_rank \"$SLURM_NODEID\" "
            f"launch/pretrain.py --config {shlex.quote(config_path)}'")


def _train_function(mode: str, config_path: str, nodes: int, gpus_per_node: int) -> list[str]:
    """``train``: the launch, in the background so that a signal to the batch shell (``B:`` signals,
    ``scancel --batch``, a preemption's SIGTERM) is relayed to the ranks instead of killing the shell
    before it can requeue. In ``ssh`` mode the wrapper on this node relays it to its ranks; otherwise
    ``scancel`` hands it to every task of the job's steps."""
    relay = 'kill -USR1 "$pid"' if mode == "ssh" else 'scancel --signal=USR1 "$SLURM_JOB_ID"'
    return ["train() {",
            f"  {_launch_command(mode, config_path, nodes, gpus_per_node)} &",
            "  local pid=$! status=0",
            f"  trap 'echo \"lnstrain: the batch shell got a signal: asking every rank to save and stop\"; {relay}' "
            "USR1 TERM",
            '  while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done',
            "  trap - USR1 TERM",
            '  wait "$pid" || status=$?',
            '  return "$status"',
            "}"]


def _warning_signal(mode: str) -> str:
    """The signal SLURM sends before the time limit: what makes every rank of this mode save. One rank
    getting it is enough (the ranks agree through an all-reduce), so in ``ssh`` mode the batch shell
    relays it to the first node's ranks."""
    return {"per_rank": "TERM", "ssh": "B:USR1"}.get(mode, "USR1")


def _resume_lines(job_name: str, run_dir: Path, checkpoint_dir: Path, options: SlurmOptions) -> list[str]:
    """Bash around the launch: one line when the job (re)starts, the run's outcome after it, and the
    requeue (exit 75: stopped before the last step) or, in a chain, the refusal to go on after a failure."""
    jobs_log = shlex.quote(str(run_dir / SLURM_JOBS_LOG))
    latest = shlex.quote(str(checkpoint_dir / LATEST_FILE))
    job = 'job $SLURM_JOB_ID restart $RESTARTS${LNSTRAIN_CHAIN_LINK:+ (chain link $LNSTRAIN_CHAIN_LINK)}'
    stopped = EXIT_STOPPED
    if options.requeue:
        on_stop = [
            f"if (( status == {stopped} && RESTARTS < {options.max_requeues} )); then",
            f'  echo "lnstrain: {job}: run stopped before its last step; requeueing it (restart $((RESTARTS + 1)) '
            f'of at most {options.max_requeues})"',
            f'  scontrol requeue "$SLURM_JOB_ID" && exit {stopped}',
            '  echo "lnstrain: scontrol requeue failed; submit this script again to resume"',
            f"elif (( status == {stopped} )); then",
            f'  echo "lnstrain: {job}: not requeued: slurm.max_requeues ({options.max_requeues}) reached; submit this '
            'script again to resume"',
            "fi"]
    else:
        on_stop = [f'(( status != {stopped} )) || echo "lnstrain: {job}: run stopped before its last step; '
                   f'submit this script again (or the next chain link will) to resume"']
    return [
        "RESTARTS=${SLURM_RESTART_COUNT:-0}",
        # appended by lnstrain.no_follow, which refuses a link planted there (>> would write through it)
        f'log_job() {{ "$PYTHON" -m lnstrain.no_follow append {jobs_log} "$1"; }}',
        # only a plain global_step<N> is echoed: `latest` is the run directory's, not the job log's, to trust
        f"tag=$( [[ -f {latest} && ! -L {latest} ]] && head -c 64 {latest} | tr -d '[:space:]' || true)",
        'if [[ "$tag" =~ ^global_step[0-9]+$ ]]; then',
        f'  echo "lnstrain: {job}: run \'{job_name}\' resumes from $tag"',
        f"elif [[ -e {latest} || -L {latest} ]]; then",
        f'  echo "lnstrain: {job}: run \'{job_name}\' resumes where its checkpoints allow (\'latest\' is not a plain '
        'global_step<N>; the run\'s log says which)"',
        f'else echo "lnstrain: {job}: run \'{job_name}\' starts (no checkpoint yet)"; fi',
        'if [[ -n "${LNSTRAIN_CHAIN_LINK:-}" ]]; then  # a chain does not resume a run that failed',
        f"  last_exit=$(tail -n 1 {jobs_log} 2>/dev/null | sed -n 's/.* exit=//p' || true)",
        f'  if [[ -n "$last_exit" && "$last_exit" != 0 && "$last_exit" != {stopped} ]]; then',
        f'    echo "lnstrain: {job}: the run\'s last job failed (exit $last_exit); not resuming it: fix the cause, '
        'then submit again"',
        f'    log_job "$SLURM_JOB_ID restart=$RESTARTS exit=$last_exit"',
        '    exit "$last_exit"',
        "  fi",
        "fi",
        "status=0",
        "train || status=$?",
        f'log_job "$SLURM_JOB_ID restart=$RESTARTS exit=$status"',
        *on_stop,
        'exit "$status"']


def render_sbatch(job_name: str, run_dir: Path, config_path: str, gpus: int, cluster: ClusterProfile,
                  repo_root: Path, checkpoint_dir: Path | None = None) -> str:
    """The batch script that trains ``config_path`` on ``gpus`` GPUs (whole nodes) of ``cluster``;
    ``checkpoint_dir`` (default ``<run_dir>/checkpoints``) is only read, to say where a job resumes."""
    options = cluster.slurm
    gpus_per_node = min(gpus, cluster.gpus_per_node)
    nodes = -(-gpus // gpus_per_node)
    tasks_per_node = gpus_per_node if options.mode == "per_rank" else 1
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
                  f"--gpus-per-node={gpus_per_node}",
                  f"--cpus-per-task={max(1, options.cpus_per_task // tasks_per_node)}",
                  f"--time={options.time}", f"--output={run_dir / SLURM_OUTPUT}", "--open-mode=append",
                  f"--signal={_warning_signal(options.mode)}@{options.signal_seconds}",
                  "--requeue" if options.requeue else "--no-requeue"]
    directives += [f"--partition={options.partition}"] * bool(options.partition)
    directives += [f"--account={options.account}"] * bool(options.account)
    directives += options.directives
    how = (f"the job requeues itself, at most {options.max_requeues} times" if options.requeue
           else "submit the script again, or chain it: slurm.chain_jobs")
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             f"# Generated by lnstrain.study.slurm for run '{job_name}'. Exit status: 0 the run finished (or had "
             "already finished);",
             f"# {EXIT_STOPPED} it stopped before its last step, to be resumed ({how}); anything else: "
             "it failed.",
             f"# Each job appends '<job id> restart=<n> exit=<status>' to {run_dir / SLURM_JOBS_LOG}.",
             "set -euo pipefail", f"cd {shlex.quote(str(repo_root))}", *options.setup,
             *(f"export {key}={shlex.quote(str(value))}" for key, value in sorted(cluster.env.items())),
             f"export PYTHON=${{PYTHON:-{shlex.quote(cluster.python)}}}",
             'export MASTER_ADDR=$("$PYTHON" launch/slurm/hostfile.py --master)',
             'export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}',
             f'export HOSTFILE={shlex.quote(str(run_dir))}/{HOSTFILE_PREFIX}$SLURM_JOB_ID',
             # a new file (noclobber opens it with O_EXCL): a link planted under that name is removed first
             f'rm -f "$HOSTFILE" && (set -o noclobber; "$PYTHON" launch/slurm/hostfile.py --slots {gpus_per_node} '
             '> "$HOSTFILE")',
             'echo "nodes: $SLURM_JOB_NODELIST master: $MASTER_ADDR:$MASTER_PORT"',
             *_train_function(options.mode, config_path, nodes, gpus_per_node),
             *_resume_lines(job_name, run_dir, checkpoint_dir or run_dir / CHECKPOINTS_DIR, options)]
    return "\n".join(lines) + "\n"


def submit(script: Path, chain_jobs: int = 1, env: dict[str, str] | None = None) -> list[str]:
    """``sbatch`` the script and return the job id; with ``chain_jobs`` > 1, that many jobs, each
    starting when the one before has ended (``afterany``). Raises RuntimeError with sbatch's message."""
    job_ids: list[str] = []
    for link in range(1, chain_jobs + 1):
        command = ["sbatch", "--parsable"]
        if chain_jobs > 1:
            command.append(f"--export=ALL,LNSTRAIN_CHAIN_LINK={link}/{chain_jobs}")
        if job_ids:
            command.append(f"--dependency=afterany:{job_ids[-1]}")
        done = subprocess.run([*command, str(script)], capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip() or done.stdout.strip()}"
                               + (f" (jobs {', '.join(job_ids)} were submitted)" if job_ids else ""))
        job_ids.append(done.stdout.strip().split(";")[0])
    return job_ids
