"""One check of a cached index per node and launch (``check_records``): a second process of the node uses
the first one's verdict, and no record is trusted for files edited since (even keeping size and
modification time), changed just before their check, checked before this process started, or kept in
a directory that someone else could write."""
from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import time

import numpy as np
import pytest

from lnstrain.data import CheckRecords, IndexCache, check_records
from lnstrain.data.index_check import packed_index_problem
from lnstrain.data.sample_index import build_packed_index

SIZES = np.array([5, 0, 9, 3, 7, 4, 6, 2], np.int32)
DOCS = np.arange(8)
SEQ_LEN, SAMPLES = 4, 30


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A cache directory, a records directory, and a way to load the entry as a new process of this node
    would (its own IndexCache and CheckRecords), counting the full checks made."""
    monkeypatch.setattr(check_records, "SETTLED_S", 0.05)
    checks = []

    def check(arrays):
        checks.append(1)
        return packed_index_problem(arrays, SIZES, DOCS, SEQ_LEN, SAMPLES)

    def load(builds: bool = False, records: CheckRecords | None = None):
        records = records or CheckRecords.for_this_node(str(tmp_path / "tmp"))
        cache = IndexCache(str(tmp_path / "cache"), builds, timeout_s=0.3, poll_s=0.05, records=records)
        return cache.get_or_build("entry", {}, lambda: build_packed_index(SIZES, DOCS, SEQ_LEN, SAMPLES, 1), check)

    (tmp_path / "tmp").mkdir(mode=0o700)
    built = {key: np.array(array) for key, array in load(builds=True).items()}  # copies of the maps
    assert checks == []  # the builder only compares what it wrote with what it built
    time.sleep(0.1)  # older than SETTLED_S
    return load, checks, built, tmp_path / "cache"


def test_the_second_process_of_a_node_uses_the_first_ones_check(node):
    load, checks, built, _ = node
    first = load()
    assert len(checks) == 1
    second = load()
    assert len(checks) == 1  # its record was trusted
    assert all(np.array_equal(second[key], built[key]) and np.array_equal(first[key], built[key]) for key in built)


def test_a_process_started_before_the_check_trusts_its_record(node):
    """Real processes: the record's start time (CLOCK_BOOTTIME) and a process's (/proc) compare."""
    load, checks, _, _ = node
    context = multiprocessing.get_context("fork")
    go, counts = context.Event(), context.Queue()

    def rank():
        go.wait(30)
        load()
        counts.put(len(checks))

    peer = context.Process(target=rank)
    peer.start()  # started first, as all ranks of a launch are (seconds before any check)
    time.sleep(0.1)
    load()
    go.set()
    assert checks == [1] and counts.get(timeout=30) == 0  # its own count: it checked nothing
    peer.join(30)
    assert peer.exitcode == 0


def test_a_file_edited_after_its_check_is_checked_again_even_with_its_size_and_mtime_kept(node, caplog):
    load, checks, built, cache = node
    load()
    [shuffle] = cache.glob("*shuffle_idx.npy")
    status = os.stat(shuffle)
    array = np.load(shuffle)
    with open(shuffle, "r+b") as handle:  # in place: same inode, same size
        handle.seek(status.st_size - array.nbytes)
        handle.write(np.full_like(array, array[0]).tobytes())
    os.utime(shuffle, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(shuffle).st_mtime_ns == status.st_mtime_ns and os.stat(shuffle).st_ino == status.st_ino
    with pytest.raises(TimeoutError):  # not trusted: checked, refused, waited for a rebuild
        load()
    assert len(checks) == 2 and "not using the cached index" in caplog.text and "shuffle_idx serves" in caplog.text
    with pytest.raises(TimeoutError):  # the refusal is recorded: the next process waits without checking
        load()
    assert len(checks) == 2
    rebuilt = load(builds=True)
    assert np.array_equal(rebuilt["shuffle_idx"], built["shuffle_idx"])


def test_no_record_is_trusted_for_files_changed_just_before_their_check(node, monkeypatch):
    load, checks, _, _ = node
    monkeypatch.setattr(check_records, "SETTLED_S", 60.0)  # as if the files had changed within a minute
    load()
    load()
    assert len(checks) == 2


def test_no_record_is_trusted_from_before_this_process_started_or_another_boot(node, tmp_path):
    load, checks, _, _ = node
    load()
    later = CheckRecords.for_this_node(str(tmp_path / "tmp"))
    later.process_started = time.clock_gettime(time.CLOCK_BOOTTIME) + 1.0
    load(records=later)
    assert len(checks) == 2
    rebooted = CheckRecords.for_this_node(str(tmp_path / "tmp"))
    rebooted.boot_id = "another boot"
    load(records=rebooted)
    assert len(checks) == 3


def test_records_are_kept_only_where_no_one_else_can_write(tmp_path):
    for mode, private in [(0o700, True), (0o1777, True), (0o777, False)]:
        parent = tmp_path / f"parent{mode:o}"
        parent.mkdir()
        parent.chmod(mode)
        records = CheckRecords.for_this_node(str(parent))
        assert (records is not None) == private, oct(mode)
    mine = tmp_path / "parent700" / f"lnstrain-{os.getuid()}"
    mine.chmod(0o777)  # the records directory itself writable by others
    assert CheckRecords.for_this_node(str(tmp_path / "parent700")) is None
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / f"lnstrain-{os.getuid()}").symlink_to(tmp_path / "parent700")
    assert CheckRecords.for_this_node(str(planted)) is None


def test_a_held_lock_delays_the_check_only_until_the_deadline(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    (tmp_path / "tmp").mkdir(mode=0o700)
    records = CheckRecords.for_this_node(str(tmp_path / "tmp"))
    entry = str(tmp_path / "entry.json")
    lock = os.open(records._path(entry) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process of the node, stuck while it checks
    try:
        started = time.monotonic()
        assert records.checked(entry, (), lambda: "its own verdict", started + 0.2) == "its own verdict"
        assert time.monotonic() - started >= 0.2
    finally:
        os.close(lock)
