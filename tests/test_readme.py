"""The README is the front door: what lnstrain is and why, the two quick-start commands and what they do,
the main job, and where to go next, a line each, in at most 160 lines. Measured figures, dated status
and study results live in docs/. CI runs exactly the README's test command. (Running the two commands:
tests/test_quick_start.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
QUICK_SUBSET = 'bash launch/test.sh -m "not multirank and not slow"'
MAX_LINES = 160
SECTIONS = ["## Quick start", "## The main job", "## Where to go next"]


def commands(text: str) -> list[str]:
    lines = (line.split(" #")[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def section(title: str) -> str:
    return README.split(title, 1)[1].split("\n## ", 1)[0]


def without_environment(command: str) -> str:
    """The command with its leading VAR=value assignments left out."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)
    return shlex.join(words)


def test_the_readme_is_a_front_door_of_at_most_160_lines_in_its_order():
    assert len(README.splitlines()) <= MAX_LINES, len(README.splitlines())
    places = [README.index(title) for title in SECTIONS]
    assert places == sorted(places) and README.index("The paper reports") < places[0]  # what and why come first
    assert [line for line in README.splitlines() if line.startswith("## ")] == SECTIONS


def test_quick_start_is_two_commands_first_and_ci_runs_the_second_as_the_readme_gives_it():
    quick_start = section("## Quick start")
    assert commands(quick_start.split("```bash", 1)[1].split("```", 1)[0]) == ["bash launch/train.sh",
                                                                              "bash launch/test.sh"]
    [ci] = commands((REPO / ".ci" / "run").read_text(encoding="utf-8"))
    assert without_environment(ci) == "bash launch/test.sh"
    assert ci.split()[0] == "LNSTRAIN_TEST_INSTALL_SLURM=1" and "LNSTRAIN_TEST_INSTALL_SLURM=1" in quick_start
    for script in ("train.sh", "test.sh"):
        assert (REPO / "launch" / script).is_file()


def test_the_quick_start_says_what_each_command_does_and_what_the_tests_take_and_touch():
    text = " ".join(section("## Quick start").split())
    for said in ("`bash launch/train.sh` builds", "100 steps", "`demo_workdir/`", "Ctrl-C saves",
                 "`bash launch/test.sh` runs the whole suite", "minutes on a 2-core machine",
                 "changes nothing outside the clone's `.venv`", "SLURM tests run only where SLURM is installed",
                 f"`{QUICK_SUBSET}` is the quick subset"):
        assert said in text, said


def test_the_main_job_is_the_7b_run_with_a_dry_run_first():
    main_job = commands(section("## The main job").split("```bash", 1)[1].split("```", 1)[0])
    assert main_job[0].startswith("python launch/pretrain.py --config configs/7b_lns.yaml --dry-run")
    assert main_job[1] == "deepspeed launch/pretrain.py --config configs/7b_lns.yaml"
    assert (REPO / "configs" / "7b_lns.yaml").is_file()


def test_where_to_go_next_is_a_line_per_page_and_every_link_leads_somewhere():
    lines = [line for line in section("## Where to go next").splitlines() if line.strip()]
    assert all(re.fullmatch(r"- \[docs/\w+\.md\]\(docs/\w+\.md\): .+", line) for line in lines), lines
    for target, anchor in re.findall(r"\]\((docs/[\w./-]+\.md)(?:#([\w-]+))?\)", README):
        page = REPO / target
        assert page.is_file(), target
        if anchor:
            headings = [re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)]
            assert anchor in headings, (target, anchor)


def test_measured_figures_dated_status_and_study_results_live_in_docs():
    text = " ".join(README.split())
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)  # no date
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text)  # no commit
    assert not re.search(r"\d+(\.\d+)? ?% MFU|MFU [\d.]+ ?%|\d+ passed", text)  # no measured speed, no test counts
    for status in ("await", "next GPU", "not yet measured", "nats", "tokens per parameter"):
        assert status not in text, status


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


def test_the_readme_says_what_the_paper_claims_and_what_lnstrain_measured():
    text = " ".join(README.split())
    assert "keeps the deep layers useful" not in text and "deep layers useful" not in text
    assert "The paper reports" in text and "matter*less* than Pre-LN's" not in text
    assert "mattering *less* than Pre-LN's" in text
    link = "docs/depth_analysis.md#where-the-pruning-claim-turns-the-depth-study"
    assert text.count(link) == 1
    assert "## Where the pruning claim turns: the depth study" in (REPO / "docs" / "depth_analysis.md").read_text()
