"""The README's quick start is one block that works top-down, and CI runs exactly its test command."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commands(text: str) -> list[str]:
    lines = (line.split(" #")[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_quick_start_installs_cpu_torch_before_lnstrain_and_ends_with_the_ci_test_command():
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = commands(section.split("```bash", 1)[1].split("```", 1)[0])
    torch_cpu = next(i for i, c in enumerate(block) if c.startswith("pip install torch") and "whl/cpu" in c)
    lnstrain = next(i for i, c in enumerate(block) if c.startswith("pip install -e"))
    assert torch_cpu < lnstrain < block.index("bash launch/demo.sh")
    ci = commands((REPO / ".ci" / "run").read_text(encoding="utf-8"))
    assert block[-1] == ci[-1] == "python -m pytest -q"
