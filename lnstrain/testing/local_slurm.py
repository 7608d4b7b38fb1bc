"""A one-node SLURM on this machine, for tests and for trying batch scripts (root only).

    python -m lnstrain.testing.local_slurm start /tmp/slurm   # prints the SLURM_CONF to export (--install: apt-get)
    export SLURM_CONF=/tmp/slurm/slurm.conf; sbatch job.sbatch; squeue
    python -m lnstrain.testing.local_slurm stop /tmp/slurm

Everything lives in one directory: ``slurm.conf`` and ``gres.conf``, a private ``munged`` (own key
and socket, so a system-wide MUNGE or SLURM is left alone), the controller's state, the logs and
``jobcomp.txt`` (one line each time a job ends or is requeued: SLURM's record without a database).
The node is this machine under its host name (batch scripts use node names as rendezvous
addresses). It offers ``cpus`` CPUs and two ``gpu`` GRES entries backed by ``/dev/null`` and ``/dev/zero``
so that scripts asking ``--gpus-per-node`` are accepted. Settings that keep a test short:
``cred_expire=5`` (a requeued job is eligible again 6 s after requeue instead of ~2 minutes),
``sched_interval=1`` (the scheduler notices it at once) and ``KillWait=5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
INSTALL_VARIABLE = "LNSTRAIN_TEST_INSTALL_SLURM"
"""Set to 1 to let the SLURM tests install PACKAGES with apt-get when they are missing (root only);
unset, they run where SLURM is installed and skip elsewhere, changing nothing on the machine.
CI sets it (.ci/run)."""
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def missing_commands() -> list[str]:
    return [name for name in COMMANDS if not shutil.which(name, path=_search_path())]


def _search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def install_requested() -> bool:
    """Whether ``INSTALL_VARIABLE`` asks for SLURM to be installed where it is missing."""
    return os.environ.get(INSTALL_VARIABLE, "") == "1"


def unavailable_reason(install: bool = False) -> str | None:
    """Why a local SLURM cannot be started here (None when it can), installing the packages with
    apt-get first when they are missing, ``install`` is true and we are root."""
    if sys.platform != "linux":
        return "a local SLURM needs Linux"
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd needs root (this user is not)"
    try:
        socket.gethostbyname(_node())
    except OSError:
        return f"this machine's host name {_node()!r} does not resolve (add it to /etc/hosts)"
    if not missing_commands():
        return None
    if not install or not shutil.which("apt-get"):
        return (f"SLURM is not installed ({', '.join(missing_commands())} missing): apt-get install "
                f"{' '.join(PACKAGES)}, or set {INSTALL_VARIABLE}=1 to let the tests install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} did not finish in 15 minutes"
        if done.returncode:
            return f"{' '.join(command)} failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return f"apt-get installed {' '.join(PACKAGES)} but {', '.join(missing_commands())} still missing" \
        if missing_commands() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node() -> str:
    return socket.gethostname().split(".")[0]


def _slurm_conf(root: Path, cpus: int, controller_port: int, node_port: int) -> str:
    host = _node()
    return "\n".join([
        "ClusterName=lnstrain",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={controller_port}",
        f"SlurmdPort={node_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobRequeue=1",
        "GresTypes=gpu",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        "KillWait=5",
        "MinJobAge=3600",
        "SlurmdParameters=config_overrides",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root}/jobcomp.txt",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:2 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ""])


@dataclass
class LocalSlurm:
    """A running one-node SLURM whose files are under ``root``; ``env`` is what its commands need."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _search_path()}

    def run(self, *command: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(list(command), capture_output=True, text=True, env=env or self.env, timeout=timeout)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Requeue, ...); {} once forgotten."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        fields = {}
        for item in text.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Poll until the job's state is one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout
        fields = self.job(job_id)
        while fields.get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f} s: {fields}\n"
                                   + self.log_tail())
            time.sleep(0.5)
            fields = self.job(job_id)
        return fields

    def completions(self) -> list[dict[str, str]]:
        """Each line of jobcomp.txt (a job ended or was requeued) as a dict: JobId, JobState, ExitCode, ..."""
        path = self.root / "jobcomp.txt"
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            fields = {}
            for item in line.split():
                key, _, value = item.partition("=")
                fields[key] = value
            records.append(fields)
        return records

    def log_tail(self, lines: int = 15) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.is_file():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged (by the PIDs they wrote) and wait until they are gone."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            if not pid_file.is_file():
                continue
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (ValueError, IndexError, ProcessLookupError):
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
            pid_file.unlink(missing_ok=True)


def _start_munge(root: Path) -> None:
    munge = root / "munge"
    munge.mkdir(mode=0o700, exist_ok=True)
    key = munge / "munge.key"
    if not key.is_file():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    subprocess.run([shutil.which("munged", path=_search_path()), "--force", f"--socket={munge}/munge.socket",
                    f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed"], check=True, capture_output=True, timeout=30)


def start(root: str | os.PathLike, cpus: int = 2, timeout: float = 60) -> LocalSlurm:
    """Write the configuration under ``root`` and start munged, slurmctld and slurmd; returns once
    the node is idle. Raises RuntimeError (with the daemons' log tails) when it does not come up."""
    root = Path(root).resolve()
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    slurm = LocalSlurm(root)
    slurm.conf.write_text(_slurm_conf(root, cpus, _free_port(), _free_port()))
    (root / "gres.conf").write_text(f"NodeName={_node()} Name=gpu File=/dev/null\n"
                                    f"NodeName={_node()} Name=gpu File=/dev/zero\n")
    _start_munge(root)
    try:
        for daemon, extra in (("slurmctld", ["-i"]), ("slurmd", ["-N", _node()])):
            subprocess.run([shutil.which(daemon, path=_search_path()), "-f", str(slurm.conf), *extra],
                           check=True, capture_output=True, env=slurm.env, timeout=30)
        deadline = time.monotonic() + timeout
        while True:
            state = slurm.run("sinfo", "-h", "-n", _node(), "-o", "%T", check=False).strip()
            if state.startswith("idle"):
                return slurm
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {_node()} is {state or 'unknown'} after {timeout:.0f} s\n{slurm.log_tail()}")
            time.sleep(0.5)
    except BaseException:
        slurm.stop()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("directory", help="where the configuration, state and logs live")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the node (default: this machine's)")
    parser.add_argument("--install", action="store_true",
                        help=f"apt-get install {' '.join(PACKAGES)} when they are missing (root)")
    args = parser.parse_args(argv)
    if args.action == "stop":
        LocalSlurm(Path(args.directory).resolve()).stop()
        return 0
    reason = unavailable_reason(install=args.install or install_requested())
    if reason:
        print(f"cannot start SLURM here: {reason}", file=sys.stderr)
        return 1
    slurm = start(args.directory, args.cpus)
    print(f"export SLURM_CONF={slurm.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
