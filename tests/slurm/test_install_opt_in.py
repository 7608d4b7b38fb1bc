"""The SLURM tests change nothing on the machine unless asked: apt-get runs only with
LNSTRAIN_TEST_INSTALL_SLURM=1 (CI's .ci/run sets it), and the skip reason says how to ask."""

from __future__ import annotations

import subprocess

import pytest

from lnstrain.testing import local_slurm


@pytest.fixture
def root_without_slurm(monkeypatch):
    """A root user on Linux whose host name resolves and whose SLURM commands are missing; any
    command run is recorded instead of run."""
    ran: list[list[str]] = []
    monkeypatch.setattr(local_slurm.sys, "platform", "linux")
    monkeypatch.setattr(local_slurm.os, "geteuid", lambda: 0)
    monkeypatch.setattr(local_slurm.socket, "gethostbyname", lambda name: "127.0.0.1")
    monkeypatch.setattr(local_slurm, "missing_commands", lambda: ["slurmctld", "sbatch"])
    monkeypatch.setattr(local_slurm.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")

    def record(command, **kwargs):
        ran.append(list(command))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(local_slurm.subprocess, "run", record)
    return ran


def test_without_the_variable_nothing_is_installed_and_the_reason_says_how(root_without_slurm, monkeypatch):
    monkeypatch.delenv(local_slurm.INSTALL_VARIABLE, raising=False)
    reason = local_slurm.unavailable_reason(install=local_slurm.install_requested())
    assert root_without_slurm == []
    assert "SLURM is not installed (slurmctld, sbatch missing)" in reason
    assert f"{local_slurm.INSTALL_VARIABLE}=1" in reason and "apt-get install slurm-wlm munge" in reason


def test_the_variable_lets_the_tests_install_slurm(root_without_slurm, monkeypatch):
    monkeypatch.setenv(local_slurm.INSTALL_VARIABLE, "1")
    local_slurm.unavailable_reason(install=local_slurm.install_requested())
    assert [command[:2] for command in root_without_slurm] == [["apt-get", "update"], ["apt-get", "install"]]

