"""One name for one option across every command line (tools/, launch/), and every option a message names
exists. Each script's argparse is read as ``--help`` builds it (tests/test_help.py's ``parsers_of``)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from tests.test_help import REPO, SCRIPTS, parsers_of

SAME_THING = [{"--out", "--output"}, {"--json-key", "--json-keys", "--column", "--columns"},
              {"--micro-batch", "--micro-batch-size", "--mbs"}, {"--tokenizer", "--tokenizer-model"}]
"""Names other projects give one option: a set of command lines uses at most one of each group."""
DIFFERENT_THINGS = {frozenset({"--name", "--names"}): "analyze_depth: one run's display name; several runs' names",
                    frozenset({"--seq-len", "--seq-lens"}): "one sequence length; benchmark_data's lengths to sweep"}
"""Names alike by the rule below that are different options, each with why."""
EXTERNAL = {
    "deepspeed launcher": "--master_port --master_addr --num_gpus --num_nodes --hostfile --no_local_rank --no_ssh "
                          "--node_rank --launcher --log_level",
    "torchrun": "--master-port",
    "SLURM (sbatch, srun, scancel, scontrol)": "--ntasks-per-node --kill-on-bad-exit --signal --requeue --no-requeue "
                                               "--time --partition --parsable --open-mode --nodes --job-name "
                                               "--gpus-per-node --export --dependency --cpus-per-task --batch "
                                               "--account --qos --exclusive --output --oneliner",
    "munged": "--socket --seed-file --pid-file --log-file --key-file --force",
    "pip": "--no-deps --platform --only-binary --no-index --no-build-isolation --implementation --index-url "
           "--dry-run --ignore-installed --report",
    "pytest": "--junitxml --durations",
    "nvidia-smi": "--query-gpu --format",
    "tensorboard": "--logdir",
    "lm-eval": "--include_path",
    "Megatron-LM (named for comparison)": "--exit-duration-in-mins --override-opt_param-scheduler "
                                          "--use-checkpoint-opt_param-scheduler",
    "python -m lnstrain.testing.local_slurm": "--cpus --install",
    "python -m lnstrain.testing.tiny_hf_models": "--layers --hidden --documents",
    "lnstrain/training/rerun_command.py's docstring (a placeholder)": "--opt",
}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


@pytest.fixture(scope="module")
def every_action() -> dict[str, dict[str, argparse.Action]]:
    """{script: {option string: its action}} for every command line, subcommands and hidden options included."""
    found: dict[str, dict[str, argparse.Action]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for script in SCRIPTS:
            found[str(script.relative_to(REPO))] = {option: action for parser in parsers_of(script, monkeypatch)
                                                    for action in parser._actions for option in action.option_strings}
    return found


@pytest.fixture(scope="module")
def actions(every_action) -> dict[str, dict[str, argparse.Action]]:
    """The options ``--help`` shows (not --help itself, nor what launchers pass and users never type)."""
    return {script: {option: action for option, action in options.items()
                     if action.help != argparse.SUPPRESS and option not in ("-h", "--help")}
            for script, options in every_action.items()}


def _alike(name: str) -> str:
    return name.replace("_", "-").removesuffix("s")


def test_one_thing_has_one_name_across_every_command_line(actions):
    names = {option for options in actions.values() for option in options}
    spelled_twice = [sorted(group & names) for group in SAME_THING if len(group & names) > 1]
    by_form: dict[str, set[str]] = {}
    for name in names:
        by_form.setdefault(_alike(name), set()).add(name)
    spelled_twice += [sorted(alike) for alike in by_form.values()
                      if len(alike) > 1 and frozenset(alike) not in DIFFERENT_THINGS]
    assert not spelled_twice, f"one option, several names: {spelled_twice}"


def test_an_option_several_command_lines_share_takes_the_same_kind_of_value_everywhere(actions):
    shared: dict[str, list[tuple[str, argparse.Action]]] = {}
    for script, options in actions.items():
        for option, action in options.items():
            shared.setdefault(option, []).append((script, action))
    problems = []
    for option, uses in shared.items():
        kinds = {(action.nargs == 0, action.nargs in ("+", "*")) for _, action in uses}
        if len(kinds) > 1:
            problems.append(f"{option}: a flag, one value or a list, differently in {[s for s, _ in uses]}")
        choices = sorted((set(action.choices) for _, action in uses if action.choices), key=len)
        if any(not smaller <= larger for smaller, larger in zip(choices, choices[1:])):
            problems.append(f"{option}: choices spelt differently: {choices}")
    assert not problems, "\n".join(problems)


def test_the_tools_that_read_a_corpus_read_it_with_the_same_options(actions):
    """tools/train_tokenizer.py and tools/preprocess_data.py: the same input, the same key or column."""
    tokenizer, preprocess = actions["tools/train_tokenizer.py"], actions["tools/preprocess_data.py"]
    for option in ("--input", "--json-keys", "--txt-mode"):
        a, b = tokenizer[option], preprocess[option]
        assert (a.option_strings, a.nargs, a.default, a.choices) == (b.option_strings, b.nargs, b.default, b.choices)


def _string_constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_every_option_a_message_or_help_names_exists(every_action):
    """In the command lines and in lnstrain (whose messages the command lines print): an option named
    in a string is an option of an lnstrain command line, or of the external command listed for it."""
    known = {option for options in every_action.values() for option in options}
    known |= {option for options in EXTERNAL.values() for option in options.split()}
    unknown = [f"{path.relative_to(REPO)}:{line}: {option} ({text[:80]!r})"
               for path in [*SCRIPTS, *sorted((REPO / "lnstrain").rglob("*.py"))]
               for line, text in _string_constants(path) for option in OPTION.findall(text) if option not in known]
    assert not unknown, "options named that no command line has:\n" + "\n".join(unknown)
