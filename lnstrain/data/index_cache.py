"""Cache of sample-index arrays: built by one rank, awaited by the others through the filesystem.

Waiting ranks poll for a completion marker instead of joining a collective, so an index that takes
minutes to build cannot trip an NCCL/gloo timeout. Every file is written under a temporary name and
moved into place with ``os.replace``; the marker (``<name>.json``) is written last.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)


class CacheWaitTimeout(TimeoutError):
    """The rank that builds the cache did not finish in time."""


@dataclass
class IndexCache:
    """A folder of cached index arrays.

    Fields:
        directory: where the files live (must be shared by all ranks that use it).
        builds: True on exactly one rank (it builds missing entries); the others wait for them.
        timeout_s: how long a waiting rank waits before failing.
        poll_s: polling interval of waiting ranks.
    """

    directory: str
    builds: bool
    timeout_s: float = 7200.0
    poll_s: float = 0.5

    def _paths(self, name: str, keys: list[str]) -> dict[str, str]:
        return {k: os.path.join(self.directory, f"{name}.{k}.npy") for k in keys}

    def marker(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def get_or_build(self, name: str, description: dict,
                     build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Memory-mapped arrays of entry ``name``, building (or awaiting) them when absent."""
        loaded = self._load(name)
        if loaded is not None:
            return loaded
        if not self.builds:
            return self._wait(name)
        logger.info("building index %s", self.marker(name))
        t0 = time.perf_counter()
        arrays = build()
        self._save(name, description, arrays)
        seconds = time.perf_counter() - t0
        logger.log(logging.INFO if seconds >= 1 else logging.DEBUG, "built index %s in %.2fs", self.marker(name), seconds)
        loaded = self._load(name)
        assert loaded is not None
        return loaded

    def _load(self, name: str) -> dict[str, np.ndarray] | None:
        try:
            with open(self.marker(name)) as f:
                keys = json.load(f)["arrays"]
        except (OSError, ValueError, KeyError):
            return None
        paths = self._paths(name, keys)
        if not all(os.path.isfile(p) for p in paths.values()):
            return None
        # plain ndarray views of the maps (indexing an np.memmap subclass is several times slower)
        return {k: np.load(p, mmap_mode="r", allow_pickle=False).view(np.ndarray) for k, p in paths.items()}

    def _save(self, name: str, description: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            for key, path in self._paths(name, list(arrays)).items():
                tmp = f"{path}.tmp-{os.getpid()}.npy"
                np.save(tmp, np.ascontiguousarray(arrays[key]), allow_pickle=False)
                os.replace(tmp, path)
            tmp = f"{self.marker(name)}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"arrays": list(arrays), "description": description}, f, indent=1, default=str)
            os.replace(tmp, self.marker(name))
        except OSError as e:
            raise OSError(f"cannot write the index cache in {self.directory} ({e}); "
                          "set data.cache_dir to a writable folder shared by all ranks") from e

    def _wait(self, name: str) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + self.timeout_s
        logger.info("waiting for index %s to be built by the cache-building rank", self.marker(name))
        while time.monotonic() < deadline:
            loaded = self._load(name)
            if loaded is not None:
                return loaded
            time.sleep(self.poll_s)
        raise CacheWaitTimeout(
            f"timed out after {self.timeout_s:.0f}s waiting for {self.marker(name)}, which the cache-building "
            "rank (global rank 0) should write; check its log for an error, make sure data.cache_dir is shared "
            "by all ranks, or raise data.cache_wait_timeout_s")
