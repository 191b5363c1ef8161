"""Queueing chunk generators (``kvtier.transfer.chunks``): the order chunks are queued in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvtier.transfer import chunks


def job(name: str, sizes: list[int], log: list[str]) -> Iterator[int]:
    """A chunk generator: yields each chunk's size, then 'queues' it (logs it) when resumed."""
    for i, size in enumerate(sizes):
        yield size
        log.append(f"{name}{i}")


@pytest.fixture(autouse=True)
def no_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks, "on", lambda stream: contextlib.nullcontext())


def test_interleave_takes_one_chunk_of_each_in_turn():
    log: list[str] = []
    chunks.interleave([(job("a", [10, 10, 40], log), None), (job("b", [100, 5], log), None)])
    assert log == ["a0", "b0", "a1", "b1", "a2"]


def test_interleave_leads_each_job_until_it_has_queued_lead_bytes():
    # a's first chunks are small (a small component's only slice): it goes on until 25 bytes
    # are queued before b is set up.
    log: list[str] = []
    jobs = [(job("a", [10, 10, 40, 1], log), None), (job("b", [100, 5], log), None)]
    chunks.interleave(jobs, lead=25)
    assert log == ["a0", "a1", "a2", "b0", "a3", "b1"]


def test_queue_all_calls_after_once_per_chunk():
    log: list[str] = []
    chunks.queue_all(job("a", [1, 2], log), after=lambda: log.append("after"))
    assert log == ["a0", "after", "a1", "after"]
    chunks.queue_all(job("b", [], log))
    assert log[-1] == "after"
