"""The README's quick start is two commands, CI runs exactly its test command, and the README says
what the paper claims beside what lnstrain measured. (Running the two commands: tests/test_quick_start.py.)"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
QUICK_SUBSET = 'bash launch/test.sh -m "not multirank and not slow"'


def commands(text: str) -> list[str]:
    lines = (line.split(" #")[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_quick_start_is_two_commands_first_and_ci_runs_the_second():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert commands(section.split("```bash", 1)[1].split("```", 1)[0]) == ["bash launch/train.sh",
                                                                           "bash launch/test.sh"]
    assert commands((REPO / ".ci" / "run").read_text(encoding="utf-8")) == ["bash launch/test.sh"]
    for script in ("train.sh", "test.sh"):
        assert (REPO / "launch" / script).is_file()


def test_every_mention_of_the_quick_subset_gives_the_same_command():
    selector = re.search(r'-m "[^"]+"', QUICK_SUBSET).group(0)
    places = [REPO / "README.md", REPO / "pytest.ini", REPO / "launch" / "test.sh", *(REPO / "docs").glob("*.md")]
    mentions = 0
    for path in places:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for found in re.finditer("quick subset", text):
            mentions += 1
            around = text[max(0, found.start() - 90):found.end() + 60]
            assert selector in around and "-m \"not multirank\"" not in around, f"{path.name}: ...{around}..."
    assert mentions >= 4
    readme = " ".join(README.split())
    assert readme.count("quick subset") == readme.count(f"`{QUICK_SUBSET}` is the quick subset") + readme.count(
        f"`{QUICK_SUBSET}` (the quick subset)")


def test_the_readme_says_what_the_paper_claims_and_what_lnstrain_measured():
    text = " ".join(README.split())
    assert "keeps the deep layers useful" not in text and "deep layers useful" not in text
    assert "The paper reports" in text and "matter *less* than Pre-LN's" in text
    link = "docs/depth_analysis.md#where-the-pruning-claim-turns-the-depth-study"
    assert text.count(link) == 2
    assert "## Where the pruning claim turns: the depth study" in (REPO / "docs" / "depth_analysis.md").read_text()
