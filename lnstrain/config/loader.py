"""YAML -> typed dataclasses, collecting every problem instead of stopping at the first.

The loader knows nothing about lnstrain's sections: it walks a dataclass's type hints. Supported
field types: bool, int, float, str, ``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``,
``Literal[...]``, ``Enum`` subclasses, ``Any`` and nested dataclasses.

A YAML file may start with ``base: other.yaml`` (or a list of files, relative to it): those are
loaded first and deep-merged, then the file's own keys override them. This is how the model family
shares one recipe without a family of near-identical files.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """Every problem found in a config, one per line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


def suggest(name: str, candidates: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a misspelt name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_UNREADABLE = object()
"""What a conversion returns for a value it could not read (the field then keeps its default)."""


@dataclass
class Typed(Generic[T]):
    """A dataclass read from YAML data, with everything that was wrong in it.

    Attributes:
        value: the object, each unreadable value replaced by its field's default; None when a
            required key is missing or unreadable (nothing can be built).
        problems: every problem, one line each (unknown keys with a suggestion, wrong types, ...).
        unreadable_keys: dotted keys (``train.micro_batch_size``, ``data.sources[0].weight``, and
            the lists, mappings and sections holding them) whose value was replaced by a default;
            checks of ``value`` that mention them would judge the default, not what was written.
    """

    value: T | None
    problems: list[str] = dataclasses.field(default_factory=list)
    unreadable_keys: list[str] = dataclasses.field(default_factory=list)

    def unreadable(self, key: str, problem: str | None = None) -> Any:
        if problem is not None:
            self.problems.append(problem)
        self.unreadable_keys.append(key)
        return _UNREADABLE

    def about_unreadable_keys(self, problem: str) -> bool:
        """Whether ``problem`` (found by a check of ``value``) names one of the unreadable keys."""
        return any(names_key(problem, key) for key in self.unreadable_keys)


def names_key(text: str, key: str) -> bool:
    """``key`` appears in ``text`` as a key: ``train`` matches ``train.steps`` but not ``to train on``."""
    ending = r"(?![\w])" if "." in key or "[" in key else r"\."
    return re.search(r"(?<![\w.])" + re.escape(key) + ending, text) is not None


def _convert(value: Any, tp: Any, path: str, out: Typed) -> Any:
    """Convert a YAML value to ``tp``, or record the problem and return ``_UNREADABLE``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # ``X | None``: X's own, more precise, problems
            return _convert(value, options[0], path, out)
        for option in options:
            trial = Typed(None)
            converted = _convert(value, option, path, trial)
            if not trial.problems:
                return converted
        return out.unreadable(path, f"{path}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        return out.unreadable(path, f"{path}: must be one of {', '.join(map(repr, args))} (got {value!r})"
                                    f"{suggest(str(value), map(str, args))}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            names = [m.value for m in tp]
            return out.unreadable(path, f"{path}: must be one of {', '.join(map(repr, names))} (got {value!r})"
                                        f"{suggest(str(value), map(str, names))}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            return out.unreadable(path, f"{path}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return _build(tp, value, path, out)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return out.unreadable(path, f"{path}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [_convert(v, item_type, f"{path}[{i}]", out) for i, v in enumerate(value)]
        if any(item is _UNREADABLE for item in items):
            return out.unreadable(path)
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            return out.unreadable(path, f"{path}: expected a mapping, got {value!r}")
        value_type = args[1] if len(args) == 2 else Any
        converted = {k: _convert(v, value_type, f"{path}.{k}", out) for k, v in value.items()}
        return out.unreadable(path) if _UNREADABLE in converted.values() else converted
    if tp is bool:
        if isinstance(value, bool):
            return value
        return out.unreadable(path, f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", ""))
                if number.is_integer():
                    return int(number)
            except ValueError:
                pass
        return out.unreadable(path, f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        return out.unreadable(path, f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return out.unreadable(path, f"{path}: expected a string, got {value!r}")
    return value


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _build(cls: type[T], data: dict, path: str, out: Typed) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            out.problems.append(f"unknown key '{where}'{suggest(str(key), fields)}")
            continue
        converted = _convert(value, hints[key], where, out)
        if converted is not _UNREADABLE:
            kwargs[key] = converted
    missing = [name for name, f in fields.items() if name not in kwargs and not _has_default(f)]
    for name in missing:
        if name not in data:
            out.problems.append(f"missing required key '{path + '.' if path else ''}{name}'")
    if missing:
        return out.unreadable(path)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        return out.unreadable(path, f"{path or cls.__name__}: {error}")


def read_dataclass(cls: type[T], data: dict, path: str = "") -> Typed[T]:
    """Build ``cls`` from a nested dict, collecting every problem instead of stopping at the first."""
    out: Typed[T] = Typed(None)
    value = _build(cls, data or {}, path, out)
    out.value = None if value is _UNREADABLE else value
    return out


def from_dict(cls: type[T], data: dict, path: str = "") -> tuple[T, list[str]]:
    """Build ``cls`` from a nested dict; returns the object (None if it cannot be built) and the problems."""
    typed = read_dataclass(cls, data, path)
    return typed.value, typed.problems  # type: ignore[return-value]


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data (enums by value)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``; nested mappings merge, everything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_yaml_with_bases(path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict:
    """Read a YAML file, resolving its ``base:`` files (relative to it) first."""
    path = Path(path)
    resolved = str(path.resolve())
    if resolved in _seen:
        raise ConfigError([f"'base' files form a cycle: {' -> '.join(_seen + (resolved,))}"], str(path))
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"], str(path))
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle) or {}
        except yaml.YAMLError as error:
            raise ConfigError([f"invalid YAML: {error}"], str(path)) from None
        except UnicodeDecodeError as error:
            raise ConfigError([f"{path} is not UTF-8 text (byte {error.start} is 0x{error.object[error.start]:02x}); "
                               "save it as UTF-8"], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {type(data).__name__}"],
                          str(path))
    bases = data.pop("base", None) or []
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged = deep_merge(merged, load_yaml_with_bases(path.parent / base, _seen + (resolved,)))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' -> (['optim', 'lr'], 0.0003); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError([f"override '{text}' must look like section.key=value"], "--set")
    key, raw = text.split("=", 1)
    keys = [part for part in key.strip().split(".") if part]
    if not keys:
        raise ConfigError([f"override '{text}' names no key"], "--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        reason = str(error).splitlines()[0]
        raise ConfigError([f"override '{text}': the value is not valid YAML ({reason}); quote it, "
                           "e.g. --set \"data.sources=[{prefix: path/to/tokens}]\""], "--set") from None
    return keys, value


def add_override_argument(parser: typing.Any, example: str = "optim.lr=3e-4") -> None:
    """The ``--set KEY=VALUE`` option (repeatable, collected in ``overrides``) that ``apply_overrides`` reads;
    ``parser`` is an argparse parser or argument group."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config key, e.g. --set {example} (repeatable; the value is read as YAML)")


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``--set`` overrides to raw config data (before typing, so all checks still run); a
    ``ConfigError`` lists every malformed override."""
    data, problems = apply_readable_overrides(data, overrides)
    if problems:
        raise ConfigError(problems, "--set")
    return data


def apply_readable_overrides(data: dict, overrides: typing.Iterable[str]) -> tuple[dict, list[str]]:
    """(raw config data with every readable ``--set`` override applied, a problem per malformed one):
    a malformed override does not hide the config's other problems."""
    data = dict(data)
    problems = []
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ConfigError as error:
            problems += error.problems
            continue
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[keys[-1]] = value
    return data, [f"--set: {problem}" for problem in problems]
