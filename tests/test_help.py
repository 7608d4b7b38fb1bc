"""Every command line's ``--help`` states each option's default, once (tools/, launch/)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("tools", "launch", "launch/slurm") for p in (REPO / folder).glob("*.py"))


class _Parsed(Exception):
    pass


def parsers_of(script: Path, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers a script's ``main([])`` builds (captured at ``parse_args``), subcommands' included."""
    captured: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):
        captured.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    spec = importlib.util.spec_from_file_location(f"help_test_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(_Parsed):
        module.main(*([[]] if inspect.signature(module.main).parameters else []))
    parsers = list(captured)
    for parser in captured:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return parsers


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_help_states_every_default_once(script, monkeypatch):
    problems = []
    for parser in parsers_of(script, monkeypatch):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            text = " ".join(formatter._format_action(action).split())  # as --help prints it
            name = "/".join(action.option_strings)
            if text.lower().count("default:") > 1:
                problems.append(f"{name}: default stated twice: {text!r}")
            has_default = action.default not in (None, argparse.SUPPRESS, [], ()) and action.nargs != 0
            if has_default and not action.required and "default" not in text.lower():
                problems.append(f"{name} (default {action.default!r}) does not say so: {text!r}")
    assert not problems, "\n".join(problems)
