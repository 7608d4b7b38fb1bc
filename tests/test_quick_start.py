"""The README's two commands in a scratch clone, with what they can do offline: ``launch/test.sh``
installs lnstrain from the clone into the environment and runs pytest in it (on one test file here: the whole suite is what
CI's fresh clone runs), ``launch/train.sh`` reuses that environment and trains the demo, and a Ctrl-C
saves after the step and prints the exact command that resumes (that rerunning resumes is
tests/training/test_resume.py's).

To stay fast and offline the scripts get an environment that already has every package (a venv that
sees this test's site-packages, ``LNSTRAIN_VENV``): what they install there is lnstrain itself, from
the clone; choosing and installing torch and the rest is not exercised here (CI's fresh clone does that).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def scratch_clone(target: Path) -> Path:
    """A git clone of this checkout, with its uncommitted changes laid over it."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(target)], check=True)
    changed = subprocess.run(["git", "ls-files", "--modified", "--others", "--exclude-standard"], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout.splitlines()
    deleted = set(subprocess.run(["git", "ls-files", "--deleted"], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout.splitlines())
    for name in changed:
        if name in deleted:
            (target / name).unlink(missing_ok=True)
        elif (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    return target


def run(command: str, cwd: Path, env: dict[str, str], interrupt_after: str | None = None) -> tuple[int, str]:
    """Run ``command`` in bash as a terminal would (its own process group); with ``interrupt_after``,
    press Ctrl-C (SIGINT to the group) once a line matching it has been printed."""
    process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if interrupt_after and re.search(interrupt_after, line):
                os.killpg(process.pid, signal.SIGINT)
                interrupt_after = None
        return process.wait(timeout=300), "".join(lines)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def environment_with_every_package(venv: Path) -> Path:
    """A new venv that sees this test's packages (its site-packages, by a ``.pth`` file: whether this is
    a venv itself or not) but not their ``.pth`` files, so the clone's editable install is the lnstrain."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    own = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    seen = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()])
    (Path(own) / "test_packages.pth").write_text("".join(f"{path}\n" for path in seen))
    return venv


@pytest.mark.slow
def test_in_a_clone_with_its_packages_at_hand_test_sh_runs_pytest_and_train_sh_trains_and_ctrl_c_says_how_to_resume(
        tmp_path):
    clone = scratch_clone(tmp_path / "clone")
    venv = environment_with_every_package(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env |= {"LNSTRAIN_VENV": str(venv), "DEMO_WORKDIR": str(tmp_path / "demo")}

    code, output = run("bash launch/test.sh tests/test_readme.py", clone, env)
    assert code == 0, output[-3000:]
    assert "installing lnstrain" in output and re.search(r"^\d+ passed", output, re.M), output[-3000:]
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import lnstrain; print(lnstrain.__file__)"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(imported.strip()).is_relative_to(clone)  # the clone's code, not this checkout's

    args = ["--set", "train.steps=12", "--set", "logging.interval=1", "--set", "run.name=my run"]
    code, output = run(f"bash launch/train.sh {shlex.join(args)}", clone, env, interrupt_after=r"step 1/12 \|")
    assert code == 75, output[-3000:]
    assert "is up to date" in output and "installing" not in output  # set up once, for both commands
    assert "== 1/4 building the demo corpus" in output and "Traceback" not in output, output[-3000:]
    stopped = re.search(r"lnstrain: stopped to be resumed after step (\d+) of 12 \(received SIGINT\); checkpoint "
                        r"(.*?); to continue, rerun: (.*)", output)
    assert stopped, output[-3000:]
    assert 1 <= int(stopped.group(1)) < 12
    assert Path(stopped.group(2)).name == f"global_step{stopped.group(1)}" and Path(stopped.group(2)).is_dir()
    assert shlex.split(stopped.group(3)) == [f"LNSTRAIN_VENV={venv}", f"DEMO_WORKDIR={tmp_path / 'demo'}", "bash",
                                             "launch/train.sh", *args]  # the command as typed, ready to paste
