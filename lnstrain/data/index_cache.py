"""Cache of sample-index arrays: built by one rank, awaited by the others through the filesystem.

Waiting ranks poll for a completion marker instead of joining a collective, so an index that takes
minutes to build cannot trip an NCCL/gloo timeout. Every file is written as a new file under a
temporary name (``no_follow``: never through a link planted there) and moved into place with
``os.replace``; the marker (``<name>.json``) is written last.

The cache lies beside the data, where others may write: an entry is used only when ``check`` (the
invariants of what its build makes, ``index_check``) passes. One that does not (edited, damaged, or
unreadable) is named in a warning and rebuilt by the building rank, and waited for by the others. A
process checks the same files (the same identity, ``check_records``) once; with ``records``, the first
of a node's processes to reach an entry checks it and the others use its verdict.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lnstrain.no_follow import create_exclusively, read_regular_file, write_text_replacing
from lnstrain.report_lines import escaped

from .check_records import CheckRecords, Identity, file_identity

logger = logging.getLogger(__name__)


class CacheWaitTimeout(TimeoutError):
    """The rank that builds the cache did not finish in time."""


_UNREADABLE = (OSError, ValueError, EOFError, IndexError, TypeError)


def _unreadable(error: Exception) -> str:
    return f"an array cannot be read ({escaped(str(error))})"


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def map_array(path: str) -> tuple[np.ndarray, tuple[int, int, int, int, int]] | None:
    """A read-only map of the ``.npy`` file ``path`` and the identity of the very file mapped (so a file
    renamed into its place meanwhile cannot pass for the one checked); None when there is no regular
    file there. Format errors raise ``ValueError`` (a header made up, a shape the file cannot hold)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO would block)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            return None
        version = np.lib.format.read_magic(handle)
        if version not in _NPY_HEADERS:
            raise ValueError(f"npy format version {version}, which this cache never writes")
        shape, fortran_order, dtype = _NPY_HEADERS[version](handle)
        if dtype.hasobject:
            raise ValueError("an array of Python objects")
        with np.errstate(over="ignore"):  # a made-up shape whose size overflows: ValueError, not also a warning
            array = np.memmap(handle, dtype, "r", handle.tell(), shape, "F" if fortran_order else "C")
    # a plain ndarray view of the map (indexing an np.memmap subclass is several times slower)
    return array.view(np.ndarray), file_identity(status)


def _difference(arrays: dict[str, np.ndarray], built: dict[str, np.ndarray]) -> str | None:
    """Why the arrays read back are not the arrays just built, or None."""
    same = set(arrays) == set(built) and all(
        arrays[key].dtype == built[key].dtype and np.array_equal(arrays[key], built[key]) for key in built)
    return None if same else "it does not read back as built"


@dataclass
class IndexCache:
    """A folder of cached index arrays.

    Fields:
        directory: where the files live (must be shared by all ranks that use it).
        builds: True on exactly one rank (it builds missing entries); the others wait for them.
        timeout_s: how long a waiting rank waits before failing.
        poll_s: polling interval of waiting ranks.
        records: where this node's processes share their checks (None: this process checks for itself).
    """

    directory: str
    builds: bool
    timeout_s: float = 7200.0
    poll_s: float = 0.5
    records: CheckRecords | None = None

    def __post_init__(self) -> None:
        self._verdicts: dict[tuple[str, Identity], str | None] = {}  # the checks this process made

    def _paths(self, name: str, keys: list[str]) -> dict[str, str]:
        return {k: os.path.join(self.directory, f"{name}.{k}.npy") for k in keys}

    def marker(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def get_or_build(self, name: str, description: dict, build: Callable[[], dict[str, np.ndarray]],
                     check: Callable[[dict[str, np.ndarray]], str | None]) -> dict[str, np.ndarray]:
        """Memory-mapped arrays of entry ``name``, building (or awaiting) them when absent or when
        ``check(arrays)`` says why they are not what ``build`` makes."""
        loaded = self._load(name, check, report=True)
        if loaded is not None:
            return loaded
        if not self.builds:
            return self._wait(name, check)
        logger.info("building index %s", self.marker(name))
        t0 = time.perf_counter()
        built = build()
        self._save(name, description, built)
        seconds = time.perf_counter() - t0
        logger.log(logging.INFO if seconds >= 1 else logging.DEBUG, "built index %s in %.2fs", self.marker(name), seconds)
        loaded = self._load(name, lambda arrays: _difference(arrays, built), report=True)  # no check: built so
        if loaded is None:
            raise OSError(f"the index {self.marker(name)} just built does not read back as built; something else "
                          "writes in data.cache_dir: set it to a folder only this run writes")
        return loaded

    def _load(self, name: str, check: Callable[[dict[str, np.ndarray]], str | None],
              report: bool = False) -> dict[str, np.ndarray] | None:
        """The entry's arrays if they are all there and pass ``check``, else None (``report``: say why
        an entry that is there is not used)."""
        try:
            keys = json.loads(read_regular_file(self.marker(name), 1 << 16))["arrays"]
            if not isinstance(keys, list) or not all(isinstance(key, str) and key.isidentifier() for key in keys):
                raise ValueError("its marker lists no arrays")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = f"its marker cannot be read ({escaped(str(error))})"
        else:
            try:
                mapped = {key: map_array(path) for key, path in self._paths(name, keys).items()}
                if any(found is None for found in mapped.values()):
                    return None
                arrays = {key: array for key, (array, _) in mapped.items()}
                identity = tuple(sorted((key, found[1]) for key, found in mapped.items()))
                problem = self._verdict(self.marker(name), identity, lambda: check(arrays))
            except _UNREADABLE as error:  # a header or shape made up
                problem = _unreadable(error)
            if problem is None:
                return arrays
        if report:
            logger.warning("not using the cached index %s: %s; %s", escaped(self.marker(name)), problem,
                           "rebuilding it" if self.builds else "waiting for the building rank to rebuild it")
        return None

    def _verdict(self, marker: str, identity: Identity, check: Callable[[], str | None]) -> str | None:
        """``check()`` of the files of ``identity``, made once by this process, or by another of this node
        (``records``) when it may be trusted."""
        def verdict() -> str | None:
            try:
                return check()
            except _UNREADABLE as error:
                return _unreadable(error)

        if (marker, identity) not in self._verdicts:
            deadline = time.monotonic() + self.timeout_s
            self._verdicts[(marker, identity)] = (verdict() if self.records is None
                                                  else self.records.checked(marker, identity, verdict, deadline))
        return self._verdicts[(marker, identity)]

    def _save(self, name: str, description: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            for key, path in self._paths(name, list(arrays)).items():
                tmp = f"{path}.tmp-{os.getpid()}.npy"
                with os.fdopen(create_exclusively(tmp), "wb") as handle:
                    np.save(handle, np.ascontiguousarray(arrays[key]), allow_pickle=False)
                os.replace(tmp, path)
            write_text_replacing(self.marker(name), json.dumps({"arrays": list(arrays), "description": description},
                                                               indent=1, default=str))
        except OSError as e:
            raise OSError(f"cannot write the index cache in {self.directory} ({e}); "
                          "set data.cache_dir to a writable folder shared by all ranks") from e

    def _wait(self, name: str, check: Callable[[dict[str, np.ndarray]], str | None]) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + self.timeout_s
        logger.info("waiting for index %s to be built by the cache-building rank", self.marker(name))
        while time.monotonic() < deadline:
            loaded = self._load(name, check)
            if loaded is not None:
                return loaded
            time.sleep(self.poll_s)
        raise CacheWaitTimeout(
            f"timed out after {self.timeout_s:.0f}s waiting for {self.marker(name)}, which the cache-building "
            "rank (global rank 0) should write; check its log for an error, make sure data.cache_dir is shared "
            "by all ranks, or raise data.cache_wait_timeout_s")
