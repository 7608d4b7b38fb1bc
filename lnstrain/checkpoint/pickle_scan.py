"""Which classes and functions a torch file's pickles name, read without unpickling any of them.

``torch.load`` reads one of three layouts, and what it unpickles differs:

    zip (``torch.save``'s default)   one pickle, ``data.pkl``; the tensors' bytes are separate records
    legacy (``_use_new_zipfile_serialization=False``; DeepSpeed's ``checkpoint.serialization: false``)
                                     five pickles one after the other (magic number, protocol, system
                                     information, the object, the storage keys), then raw tensor bytes
    legacy .tar                      pickles inside a tar archive; ``weights_only`` refuses the layout

A scan must see every pickle ``torch.load`` would unpickle, or a payload in the one it skips runs
when the file is loaded with ``allow_pickle`` after a scan that named only something harmless. So
the zip layout is scanned by torch's own reader (the same one ``torch.load`` uses, so both see the
same ``data.pkl``), and the legacy layout by ``_pickle_globals``, which walks each of its five
pickles opcode by opcode as the pickle specification (``pickletools``) defines them. A name that
the walk cannot follow (a class looked up through the copyreg extension registry, or named by
values it did not see pushed), an opcode it does not know, a pickle that ends early and the .tar
layout make the file *unscannable*: the verifier then treats it as a file that would run code
(never OK, loaded only with ``allow_pickle``).
"""

from __future__ import annotations

import io
import os
import pickletools
import struct
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

LEGACY_PICKLES = 5
"""The pickles at the start of a legacy-format file (torch/serialization.py, ``_legacy_load``)."""
_MAX_LINE = 1 << 16
MAX_OPCODES = 1 << 24
"""More opcodes than any pickle torch writes for a checkpoint holds (a few per tensor and record):
beyond them a file is unscannable, so a crafted file cannot make the scan run for hours."""
_KEPT_STRING = 1 << 12
"""Strings up to this long are kept (a class's module or name); longer ones are skipped over unread."""
_OPCODES = {op.code.encode("latin-1"): op for op in pickletools.opcodes}
_STRING_PUSHES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_MEMO_STORES = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_LOADS = {"GET", "BINGET", "LONG_BINGET"}
_NO_STACK_EFFECT = _MEMO_STORES | {"FRAME", "PROTO"}
_LENGTHS = {pickletools.TAKEN_FROM_ARGUMENT1: ("<B", 1), pickletools.TAKEN_FROM_ARGUMENT4: ("<i", 4),
            pickletools.TAKEN_FROM_ARGUMENT4U: ("<I", 4), pickletools.TAKEN_FROM_ARGUMENT8U: ("<Q", 8)}


class Unscannable(ValueError):
    """A pickle whose globals cannot all be named without unpickling it."""


@dataclass(frozen=True)
class PickleScan:
    """What a file's pickles name: ``names``, every ``module.name`` beyond an allow-list, and
    ``unscannable``, why the scan could not see them all (None when it could)."""

    names: list[str] = field(default_factory=list)
    unscannable: str | None = None

    @property
    def unsafe(self) -> bool:
        return bool(self.names) or self.unscannable is not None

    def describe(self) -> str:
        """``its pickle names a.b, c.d`` or why it could not be scanned (``escape`` the names for a log)."""
        if self.unscannable is not None:
            return f"its pickles cannot be scanned ({self.unscannable}), so loading it could run code unseen"
        return f"its pickle names {', '.join(self.names)}"


def _read_exactly(handle: io.BufferedIOBase, count: int) -> bytes:
    data = handle.read(count)
    if len(data) != count:
        raise Unscannable("it ends inside a pickle")
    return data


def _skip(handle: io.BufferedIOBase, count: int, size: int) -> None:
    if handle.tell() + count > size:
        raise Unscannable("it ends inside a pickle")
    handle.seek(count, os.SEEK_CUR)


def _line(handle: io.BufferedIOBase) -> bytes:
    line = handle.readline(_MAX_LINE)
    if not line.endswith(b"\n"):
        raise Unscannable("a pickle line longer than the scan reads, or cut short")
    return line[:-1]


def _argument(handle: io.BufferedIOBase, op: pickletools.OpcodeInfo, size: int) -> bytes | None:
    """The opcode's argument bytes (None when skipped over: a long string or byte string)."""
    argument = op.arg
    if argument is None:
        return None
    if argument.n >= 0:
        return _read_exactly(handle, argument.n)
    if argument.n == pickletools.UP_TO_NEWLINE:
        lines = 2 if argument.name == "stringnl_noescape_pair" else 1
        return b"\n".join(_line(handle) for _ in range(lines))
    layout, width = _LENGTHS[argument.n]
    (length,) = struct.unpack(layout, _read_exactly(handle, width))
    if length < 0:
        raise Unscannable("a negative length")
    if op.name in _STRING_PUSHES and length <= _KEPT_STRING:
        return _read_exactly(handle, length)
    _skip(handle, length, size)
    return None


def _pickle_globals(handle: io.BufferedIOBase, size: int) -> set[str]:
    """Every ``module.name`` one pickle (from the handle's position to its STOP) looks up.

    Globals are named by GLOBAL and INST (in the opcode's argument) or by STACK_GLOBAL (the two
    strings on top of the stack). The walk tracks only what it needs for the latter: the strings the
    last two stack-changing opcodes pushed, and the memo's strings. A STACK_GLOBAL whose two operands
    were not pushed just before it as strings it saw, or a lookup through the extension registry,
    raises ``Unscannable``.
    """
    found: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = [None, None]  # what the last two stack-changing opcodes pushed, if strings
    for _ in range(MAX_OPCODES):
        code = handle.read(1)
        if not code:
            raise Unscannable("it ends inside a pickle")
        op = _OPCODES.get(code)
        if op is None:
            raise Unscannable(f"byte 0x{code[0]:02x} at offset {handle.tell() - 1} is not a pickle opcode")
        argument = _argument(handle, op, size)
        name = op.name
        if name == "STOP":
            return found
        if name in ("GLOBAL", "INST"):
            module, _, attribute = argument.decode("utf-8", "backslashreplace").partition("\n")
            found.add(f"{module}.{attribute}")
        elif name == "STACK_GLOBAL":
            if not all(isinstance(value, str) for value in recent):
                raise Unscannable("a class named by values the scan did not see pushed (STACK_GLOBAL)")
            found.add(f"{recent[0]}.{recent[1]}")
        elif name.startswith("EXT"):
            raise Unscannable("a class looked up in the copyreg extension registry")
        if name in _NO_STACK_EFFECT:
            if name in _MEMO_STORES:
                index = len(memo) if name == "MEMOIZE" else int(argument.decode("ascii")) if name == "PUT" else \
                    int.from_bytes(argument, "little")
                memo[index] = recent[-1]
            continue
        pushed = None
        if name in _STRING_PUSHES and argument is not None:
            pushed = (argument.decode("raw_unicode_escape") if name == "UNICODE"
                      else argument.decode("utf-8", "surrogatepass"))
        elif name in _MEMO_LOADS:
            pushed = memo.get(int(argument.decode("ascii")) if name == "GET" else int.from_bytes(argument, "little"))
        recent = [recent[-1], pushed]
    raise Unscannable(f"a pickle of more than {MAX_OPCODES:,} opcodes, more than torch writes for a checkpoint")


def _legacy_globals(handle: io.BufferedIOBase, size: int) -> set[str]:
    found: set[str] = set()
    for _ in range(LEGACY_PICKLES):
        found |= _pickle_globals(handle, size)
    return found


def _is_tar(handle: io.BufferedIOBase) -> bool:
    """Whether ``torch.load`` would read the file as the legacy .tar layout (it tries that first)."""
    try:
        with tarfile.open(fileobj=handle, mode="r:", format=tarfile.PAX_FORMAT):
            return True
    except (tarfile.TarError, OSError, ValueError, EOFError):
        return False
    finally:
        handle.seek(0)


def _allowed_globals(extra: Iterable[type]) -> set[str]:
    """What ``torch.load(weights_only=True)`` accepts with ``extra`` allowed too, as ``module.name``:
    torch's own list is read where ``torch.serialization.get_unsafe_globals_in_checkpoint`` reads it."""
    from torch import _weights_only_unpickler

    with torch.serialization.safe_globals(list(extra)):
        return set(_weights_only_unpickler._get_allowed_globals()) | set(_weights_only_unpickler._get_user_allowed_globals())


def scan_torch_file(descriptor: int, allowed: Iterable[type]) -> PickleScan:
    """Scan the torch file open at ``descriptor`` (read from its start; not closed): the globals its
    pickles name beyond torch's ``weights_only`` list and ``allowed``, or why it cannot be scanned."""
    size = os.fstat(descriptor).st_size
    allowed = list(allowed)
    with os.fdopen(os.dup(descriptor), "rb") as handle:
        handle.seek(0)
        zip_format = handle.read(4) == b"PK\x03\x04"
        handle.seek(0)
        try:
            if zip_format:
                with torch.serialization.safe_globals(allowed):
                    return PickleScan(sorted(torch.serialization.get_unsafe_globals_in_checkpoint(handle)))
            if _is_tar(handle):
                return PickleScan(unscannable="the legacy .tar layout, which only full unpickling loads")
            return PickleScan(sorted(_legacy_globals(handle, size) - _allowed_globals(allowed)))
        except Unscannable as error:
            return PickleScan(unscannable=str(error))
        except Exception as error:  # torch's scan of a damaged or crafted zip: anything it raises
            return PickleScan(unscannable=f"{type(error).__name__}: {error}"[:200])
