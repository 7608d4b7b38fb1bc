"""What every test session keeps: nothing is left inside the checkout (tests write under temporary
directories only; the checkout's .venv and Python's and pytest's caches aside), and nothing outside
pytest's own temporary directory: ``$TMPDIR`` points into it for the session and every process the
tests start, so what lnstrain keeps in the system's temporary directory between runs (the data
index's check records, ``<tmp>/lnstrain-<uid>``) and torch's compile caches go with the session."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHES = ("__pycache__/", ".pytest_cache/", ".egg-info/")


def checkout_entries() -> set[str] | None:
    """Untracked and ignored entries of the checkout as ``git status`` lists them (an ignored or new
    directory as one entry), or None outside a git checkout."""
    try:
        listed = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode:
        return None
    entries = {line[3:] for line in listed.stdout.splitlines() if line[:2] in ("??", "!!")}
    return {entry for entry in entries if not entry.endswith(CACHES)}


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_checkout():
    before = checkout_entries()
    yield
    after = checkout_entries()
    if before is None or after is None:
        return
    left = sorted(after - before)
    assert not left, (f"the tests left {', '.join(left)} in the checkout {REPO}: a test must write under its "
                      "tmp_path (or run its subprocess with cwd=tmp_path)")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytests_directory(tmp_path_factory):
    session_tmp = tmp_path_factory.mktemp("session_tmpdir")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(session_tmp)
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
