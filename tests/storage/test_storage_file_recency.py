"""Read recency of the file backend across restarts: one journal record per ``batch_get``,
applied to mtimes on start-up and when it grows, never making a newer file older."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import file_recency
from kvtier.storage.file import FileBackend
from kvtier.storage.file_recency import JOURNAL, RecencyJournal, parse

NS = Namespace("ns0")
OLD = 10**18  # ns: older than any read, whatever the clock's resolution


def keys(*names: str) -> list[PageKey]:
    return [PageKey(n) for n in names]


def page(seed: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed))


def obj_path(be: FileBackend, key: str) -> Path:
    return Path(be.dir) / key[:2] / key


def stored(tmp_path: Path, names: tuple[str, ...] = ("k0", "k1", "k2", "k3")) -> FileBackend:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(keys(*names), [page(i) for i in range(len(names))]) == len(names)
    for i, k in enumerate(names):
        os.utime(obj_path(be, k), ns=(OLD + i, OLD + i))
    return be


def test_reads_set_the_restart_order_without_touching_files(tmp_path: Path) -> None:
    be = stored(tmp_path)
    out = [torch.empty(64) for _ in range(2)]
    assert be.batch_get(keys("k1", "k0"), out) == 2
    assert be.keys() == ["k2", "k3", "k1", "k0"]
    # The read itself leaves mtimes alone: one journal record instead.
    assert obj_path(be, "k0").stat().st_mtime_ns == OLD
    journal = Path(be.dir) / JOURNAL
    assert set(parse(journal.read_bytes())) == {"k0", "k1"}
    be.close()
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert fresh.keys() == ["k2", "k3", "k1", "k0"]
    assert journal.stat().st_size == 0  # applied to the mtimes and emptied
    assert obj_path(fresh, "k0").stat().st_mtime_ns > OLD + 3
    fresh.close()
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)  # same order from mtimes alone
    assert again.keys() == ["k2", "k3", "k1", "k0"]


def test_a_failed_read_records_only_the_objects_before_it(tmp_path: Path) -> None:
    be = stored(tmp_path)
    obj_path(be, "k1").write_bytes(b"junk")
    assert be.batch_get(keys("k0", "k1", "k2"), [torch.empty(64) for _ in range(3)]) == 1
    assert set(parse((Path(be.dir) / JOURNAL).read_bytes())) == {"k0"}


def test_a_file_newer_than_its_read_keeps_its_mtime(tmp_path: Path) -> None:
    be = stored(tmp_path)
    assert be.batch_get(keys("k0"), [torch.empty(64)]) == 1
    later = (1 << 62) + 5
    os.utime(obj_path(be, "k0"), ns=(later, later))  # rewritten or touched after the read
    be.close()
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert obj_path(fresh, "k0").stat().st_mtime_ns == later
    assert fresh.keys()[-1] == "k0"


def test_journal_is_applied_once_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    be = stored(tmp_path)
    monkeypatch.setattr(file_recency, "COMPACT_BYTES", 20)  # past it on the second record
    journal = Path(be.dir) / JOURNAL
    assert be.batch_get(keys("k2"), [torch.empty(64)]) == 1
    assert journal.stat().st_size > 0 and obj_path(be, "k2").stat().st_mtime_ns == OLD + 2
    assert be.batch_get(keys("k0", "k1"), [torch.empty(64) for _ in range(2)]) == 2
    assert journal.stat().st_size == 0
    times = {k: obj_path(be, k).stat().st_mtime_ns for k in ("k0", "k1", "k2", "k3")}
    assert times["k3"] == OLD + 3 < times["k2"] < times["k0"] < times["k1"]
    assert be.batch_get(keys("k3"), [torch.empty(64)]) == 1  # appends to the emptied journal
    assert set(parse(journal.read_bytes())) == {"k3"}


def test_a_torn_last_record_is_ignored(tmp_path: Path) -> None:
    be = stored(tmp_path)
    assert be.batch_get(keys("k1"), [torch.empty(64)]) == 1
    be.close()
    journal = Path(be.dir) / JOURNAL
    whole = journal.read_bytes()
    # A crash mid-append: a second record cut inside its key list.
    RecencyJournal(be.dir, be._path).record(keys("k0", "k3"))
    torn = journal.read_bytes()[: len(whole) + 14]
    journal.write_bytes(torn)
    assert parse(torn) == parse(whole) and set(parse(whole)) == {"k1"}
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert fresh.keys() == ["k0", "k2", "k3", "k1"]


def test_unknown_and_invalid_keys_in_the_journal_are_skipped(tmp_path: Path) -> None:
    be = stored(tmp_path, ("k0", "k1"))
    be.close()
    RecencyJournal(be.dir, be._path).record(["gone", ".hidden", "k0"])
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert fresh.keys() == ["k1", "k0"]
