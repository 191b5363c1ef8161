"""Paced backups: chunks are queued at pumps within share x rate x interval, in order.

The CPU cases drive :class:`Pacer` with marks and a clock the test sets; the CUDA cases run
paced backups through ``Mover`` and compare bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.transfer import Mover
from kvtier.transfer import mechanisms as mechanisms_mod
from kvtier.transfer.op import TransferOp
from kvtier.transfer.pacer import Pacer
from kvtier.transfer.plan import DIRECT, KERNEL, STAGED

cuda = pytest.mark.gpu


class FakeMark:
    """Passed once the test gives it a time."""

    def __init__(self) -> None:
        self.at: float | None = None

    def query(self) -> bool:
        return self.at is not None

    def seconds_to(self, end: FakeMark) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


class Rig:
    def __init__(self, share: float) -> None:
        self.now = 0.0
        self.marks: list[FakeMark] = []
        self.log: list[tuple[str, object]] = []
        self.pacer = Pacer(share, self.mark, clock=lambda: self.now)

    def mark(self) -> FakeMark:
        self.marks.append(FakeMark())
        return self.marks[-1]

    def chunks(self, name: str, sizes: list[int], fail_at: int = -1) -> Iterator[int]:
        self.log.append((name, "setup"))
        for i, n in enumerate(sizes):
            yield n
            if i == fail_at:
                raise OSError(f"{name} chunk {i} refused")
            self.log.append((name, i))

    def submit(self, name: str, sizes: list[int], fail_at: int = -1) -> TransferOp:
        op = TransferOp("d2h", 1, sum(sizes))
        self.pacer.submit(op, self.chunks(name, sizes, fail_at))
        return op

    def pump_at(self, t: float) -> list[tuple[str, object]]:
        self.now = t
        before = len(self.log)
        self.pacer.pump()
        self.pacer.check_integrity()
        return self.log[before:]


def test_one_chunk_in_flight_until_rate_and_interval_are_measured():
    rig = Rig(share=0.5)
    op = rig.submit("a", [100, 100, 100, 100])
    assert rig.log == [("a", "setup")] and not op.done()
    assert rig.pump_at(0.0) == [("a", 0)]  # nothing measured: one chunk
    assert rig.pump_at(1.0) == []  # still unfinished
    start, end = rig.marks
    start.at, end.at = 1.0, 1.25  # 100 bytes in 0.25 s: 400 B/s
    # Budget 0.5 x 400 B/s x 1 s = 200 bytes: two chunks fit, the third would not.
    assert rig.pump_at(2.0) == [("a", 1), ("a", 2)]
    assert rig.pacer.budget() == 200.0
    assert rig.pacer.queued_bytes == 300 and not op.done()
    for m in rig.marks:
        m.at = m.at if m.at is not None else 2.0
    assert rig.pump_at(3.0) == [("a", 3)]
    assert op.done() and op.pending is None and rig.pacer.pending() == 0


def test_flush_queues_every_job_up_to_the_op_in_order():
    rig = Rig(share=1.0)
    a = rig.submit("a", [10, 10])
    b = rig.submit("b", [5])
    c = rig.submit("c", [7, 7])
    b.wait()  # flushes a then b, never c
    assert rig.log == [("a", "setup"), ("b", "setup"), ("c", "setup"), ("a", 0), ("a", 1), ("b", 0)]
    assert a.done() and b.done() and not c.done()
    rig.pacer.flush()
    assert rig.log[-2:] == [("c", 0), ("c", 1)] and c.done()
    rig.pacer.flush(a)  # nothing waiting: a no-op
    assert rig.pacer.queued_bytes == 39


def test_a_failing_chunk_fails_its_op_only():
    rig = Rig(share=1.0)
    bad = rig.submit("bad", [10, 10, 10], fail_at=1)
    good = rig.submit("good", [10])
    rig.pacer.flush()
    assert rig.log[-2:] == [("bad", 0), ("good", 0)]
    with pytest.raises(RuntimeError, match="d2h transfer failed") as info:
        bad.done()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="d2h transfer failed"):
        bad.wait()
    assert good.done()


def test_setup_errors_raise_at_submit_and_empty_jobs_are_born_done():
    rig = Rig(share=1.0)

    def broken() -> Iterator[int]:
        raise ValueError("no such page")
        yield 0  # pragma: no cover

    with pytest.raises(ValueError, match="no such page"):
        rig.pacer.submit(TransferOp("d2h", 1, 8), broken())
    op = TransferOp("d2h", 0, 0)
    rig.pacer.submit(op, iter(()))
    assert op.done() and rig.pacer.pending() == 0


@pytest.mark.parametrize("share", [0.0, 1.5, -1.0])
def test_share_must_lie_in_0_1(share):
    with pytest.raises(ValueError, match=f"share={share}"):
        Pacer(share, FakeMark)


def test_budget_takes_medians_of_recent_rates_and_poll_intervals():
    rig = Rig(share=1.0)
    rig.submit("a", [100] * 50)
    chunks = rig.pacer._chunks  # noqa: SLF001 - unfinished chunks, oldest first

    def finish(seconds: list[float], at: float) -> None:
        for c, s in zip(list(chunks), seconds, strict=False):
            c.start.at, c.end.at = at, at + s
            at += s

    rig.pump_at(0.0)
    finish([0.25], at=0.0)  # 400 B/s
    assert len(rig.pump_at(1.0)) == 4  # budget 1 x 400 B/s x 1 s: four chunks of 100
    assert rig.pacer.budget() == 400.0
    # Chunks queued back to back share marks: each one's start is the one before's end.
    assert all(chunks[i].start is chunks[i - 1].end for i in range(1, 4))
    finish([0.25, 0.25, 0.025, 0.25], at=1.0)  # one outlier at 4000 B/s
    rig.pump_at(11.0)  # intervals 1 s and 10 s
    assert rig.pacer.budget() == 400.0 * 5.5
    finish([0.25] * len(chunks), at=11.0)
    rig.pump_at(12.0)  # intervals 1, 10, 1: median 1 s
    assert rig.pacer.budget() == 400.0


@cuda
@pytest.mark.parametrize("path", [DIRECT, STAGED, KERNEL])
def test_paced_backups_land_byte_exact(monkeypatch, path):
    from test_transfer import assert_same, make_pools

    monkeypatch.setattr(mechanisms_mod, "choose", lambda *a, **k: path)
    dev, host = make_pools("page_first", "cuda")
    # One page per staging slice, one block per copy-engine chunk: many paced chunks.
    mover = Mover(dev, host, staging_bytes=1, backup_share=0.5)
    assert mover.pacer is not None
    mover.device_to_host(torch.tensor([0]), torch.tensor([0])).wait()  # compile kernels
    pairs = [
        (torch.tensor([7, 2, 3]), torch.tensor([0, 11, 12])),
        (torch.tensor([4, 19]), torch.tensor([5, 6])),
    ]
    ops = [mover.device_to_host(dp, hp) for dp, hp in pairs]
    assert not any(op.done() for op in ops)  # nothing queued before a pump
    while not all(op.done() for op in ops):
        mover.pump()
        mover.pacer.check_integrity()
    for op in ops:
        op.complete()
        assert set(op.paths.values()) == {path}
    for dp, hp in pairs:
        assert_same(dev, dp, host, hp)
    assert mover.pacer.budget() > 0  # rate and interval were measured
