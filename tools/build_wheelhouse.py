#!/usr/bin/env python
"""Build .whl/: the wheels a machine without a package index needs to run lnstrain beside its own torch.

    python tools/build_wheelhouse.py                        # for the lent GPU machine (Python 3.12, x86-64)
    python tools/build_wheelhouse.py --for-this-python --exclude torch --output /tmp/wh   # this interpreter

Writes into --output (default .whl/, git-ignored):

* DeepSpeed (the version installed here, else 0.19.8) built as a pure-Python wheel (``DS_BUILD_OPS=0``:
  lnstrain uses none of its compiled ops);
* every other requirement of DeepSpeed and of lnstrain (``setup.py``'s ``install_requires``) that the
  target is not known to have (``--exclude``; by default the GPU image's list below; never torch), with
  all they require in turn (kept even where the target may have it: its version may be too old), as
  binary wheels for the target Python and platform;
* ``requirements.txt``: what to install there, DeepSpeed pinned.

On the target, ``launch/install_wheelhouse.sh`` installs it with ``pip --no-index``: pip takes from
.whl/ only what the machine lacks and keeps what it has (its torch above all). The wheels are
downloaded from the package index here; nothing is fetched there.
"""

from __future__ import annotations

import argparse
import ast
import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lnstrain.help_formatter import HelpFormatter  # noqa: E402

EXIT_BAD_INPUT = 2
DEFAULT_DEEPSPEED = "0.19.8"
GPU_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
GPU_IMAGE_PACKAGES = (
    "torch", "numpy", "sentencepiece", "tensorboard", "tensorboard-data-server", "pyyaml", "einops", "msgpack",
    "ninja", "packaging", "psutil", "py-cpuinfo", "tqdm", "nvidia-ml-py", "protobuf", "grpcio", "markdown",
    "werkzeug", "absl-py", "six", "setuptools", "typing-extensions", "markupsafe", "filelock", "fsspec",
    "jinja2", "networkx", "sympy", "mpmath", "safetensors", "transformers", "pillow",
)
"""Packages the lent GPU machine's image has (the device tool's list, read 2026-11-17): not carried."""


def normalize(name: str) -> str:
    """A project name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--output", default=str(ROOT / ".whl"), help="the wheelhouse directory (default .whl/)")
    parser.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12, the GPU image's)")
    parser.add_argument("--for-this-python", action="store_true",
                        help="wheels for this interpreter and platform instead of --python-version on x86-64 Linux")
    parser.add_argument("--exclude", default=None,
                        help="comma-separated packages the target has, not carried (default: the GPU image's list; "
                             "torch is never carried)")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed version (default: the one installed here)")
    return parser.parse_args(argv)


def install_requires() -> list[str]:
    """``setup.py``'s ``install_requires``, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(element) for element in node.value.elts]
    raise RuntimeError("setup.py has no install_requires")


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional ``Requires-Dist`` (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(archive.read(metadata))
    return [req for req in message.get_all("Requires-Dist") or [] if "extra ==" not in req]


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def installed_deepspeed() -> str | None:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001  (not installed, or a broken install: build the default)
        return None


def build(args: argparse.Namespace) -> Path:
    out = Path(args.output)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    deepspeed = args.deepspeed or installed_deepspeed() or DEFAULT_DEEPSPEED
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", f"deepspeed=={deepspeed}", "-w", str(out),
        env={**os.environ, "DS_BUILD_OPS": "0"})
    (deepspeed_wheel,) = out.glob("deepspeed-*.whl")
    excluded = {normalize(name) for name in (args.exclude.split(",") if args.exclude is not None else GPU_IMAGE_PACKAGES)
                if name.strip()} | {"torch", "deepspeed"}
    lnstrain_requirements = [req for req in install_requires() if requirement_name(req) not in ("torch", "deepspeed")]
    wanted = [req for req in wheel_requirements(deepspeed_wheel) + lnstrain_requirements
              if requirement_name(req) not in excluded]
    target = [] if args.for_this_python else ["--python-version", args.python_version, "--implementation", "cp",
                                              *[flag for platform in GPU_PLATFORMS for flag in ("--platform", platform)]]
    if wanted:
        pip("download", "-q", "--only-binary=:all:", *target, "-d", str(out), *wanted)
    requirements = [f"deepspeed=={deepspeed}"] + lnstrain_requirements
    (out / "requirements.txt").write_text("\n".join(requirements) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = build(args)
    except (subprocess.CalledProcessError, RuntimeError, ValueError) as error:
        print(f"build_wheelhouse: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    total = sum(path.stat().st_size for path in out.iterdir())
    for path in sorted(out.iterdir()):
        print(f"  {path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    print(f"{out}: {total / 2**20:.1f} MiB; install offline with: bash launch/install_wheelhouse.sh {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
