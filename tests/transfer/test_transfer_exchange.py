"""``Mover.exchange`` (a backup and a load queued in turn) and ``Mechanisms``' dispatch.

The CUDA cases are skipped without a GPU; ``scripts/gpu_checks.sh`` runs them on one.
"""

from __future__ import annotations

import pytest
import torch
from test_transfer import assert_same, cuda, geo, make_pools

from kvtier.errors import RequestError
from kvtier.transfer import Mover
from kvtier.transfer import mechanisms as mechanisms_mod
from kvtier.transfer.plan import DIRECT, KERNEL, STAGED
from kvtier.transfer.uploads import Uploads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)], ids=["cpu", "cuda"])
@pytest.mark.parametrize("path", [None, DIRECT, STAGED, KERNEL])
def test_exchange_moves_both_directions_byte_exact(monkeypatch, device, path):
    if path is not None:
        if device == "cpu":
            pytest.skip("CPU copies have one mechanism")
        monkeypatch.setattr(mechanisms_mod, "choose", lambda *a, **k: path)
    dev, host = make_pools("page_first", device)
    mover = Mover(dev, host, staging_bytes=1)  # staged: a page per slice, many chunks each way
    src, hsrc = torch.tensor([7, 2, 3, 19]), torch.tensor([0, 11, 12, 5])
    before = {s.name: host.page_bytes_view(s.name)[:, hsrc].clone() for s in dev.specs}
    dst, hdst = torch.tensor([1, 23, 8, 9]), torch.tensor([4, 6, 7, 10])
    back, load = mover.exchange((src, hdst), (hsrc, dst))
    back.wait()
    load.wait()
    back.complete()
    assert back.direction == "d2h" and load.direction == "h2d"
    assert back.shared_link and load.shared_link  # staged slices may go as single copies
    assert not mover.device_to_host(src, hdst).shared_link  # alone (beside decode): batched
    assert_same(dev, src, host, hdst)  # the backup
    for s in dev.specs:  # the load, of the host pages as they were
        assert torch.equal(dev.page_bytes_view(s.name)[:, dst].cpu(), before[s.name]), s.name
    empty = torch.tensor([], dtype=torch.int64)
    b2, l2 = mover.exchange((empty, empty), (hsrc, torch.tensor([13, 14, 15, 16])))
    l2.wait()
    assert b2.done() and b2.num_pages == 0
    assert_same(dev, torch.tensor([13, 14, 15, 16]), host, hsrc)
    dev.check_integrity()
    host.check_integrity()


def test_exchange_refuses_shared_pages_under_debug_checks():
    dev, host = make_pools("page_first", "cpu")
    mover = Mover(dev, host, debug_checks=True)
    a, b = torch.tensor([1, 2]), torch.tensor([3, 4])
    with pytest.raises(RequestError, match="share device pages"):
        mover.exchange((a, b), (torch.tensor([5, 6]), torch.tensor([2, 7])))
    with pytest.raises(RequestError, match="share host pages"):
        mover.exchange((a, b), (torch.tensor([4, 6]), torch.tensor([8, 7])))
    back, load = mover.exchange((a, b), (torch.tensor([5, 6]), torch.tensor([8, 7])))
    assert back.done() and load.done()


class _FakeRows:
    """A component's rows whose mechanisms only record that they ran (CPU stand-in)."""

    def __init__(self, fail_direct: bool = False) -> None:
        self.geo = geo("page_first", row_bytes=64 << 10, layers=4)
        self.ran: list[str] = []
        self.fail_direct = fail_direct

    def direct(self, direction, pages, stream, layer=None, chunk=0):  # noqa: ANN001, ANN201
        self.ran.append("direct")
        yield 1
        if self.fail_direct:
            from kvtier.transfer import dma

            raise dma.DmaError("refused")

    def staged(self, direction, pages, stream, helper, staging_bytes, op):  # noqa: ANN001, ANN201
        self.ran.append(f"staged {staging_bytes}")
        yield 1

    def kernel(self, direction, pages, op, chunk=0):  # noqa: ANN001, ANN201
        self.ran.append("kernel")
        yield 1


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_stream(self, other: object) -> None:
        self.waited.append(other)


@pytest.mark.parametrize("path", [DIRECT, STAGED, KERNEL])
def test_mechanisms_dispatch_and_fall_back_to_kernels(monkeypatch, path):
    from kvtier.transfer.chunks import queue_all
    from kvtier.transfer.mechanisms import Mechanisms
    from kvtier.transfer.op import TransferOp
    from kvtier.transfer.page_lists import PageLists

    monkeypatch.setattr(mechanisms_mod, "choose", lambda *a, **k: path)
    helper = _FakeStream()
    m = Mechanisms(True, "auto", {"d2h": helper, "h2d": helper}, staging_bytes=7)
    m.dma = True
    pages = PageLists(torch.tensor([1, 2]), torch.tensor([3, 4]))
    r, op = _FakeRows(), TransferOp("h2d", 2, 0)
    queue_all(m.chunks("kv", r, "h2d", pages, _FakeStream(), op))
    assert r.ran == [{DIRECT: "direct", STAGED: "staged 7", KERNEL: "kernel"}[path]]
    assert op.paths == {"kv": path} and m.dma is True
    if path != DIRECT:
        return
    r, op, stream = _FakeRows(fail_direct=True), TransferOp("h2d", 2, 0), _FakeStream()
    queue_all(m.chunks("kv", r, "h2d", pages, stream, op))
    assert r.ran == ["direct", "kernel"] and op.paths == {"kv": KERNEL}
    assert m.dma is False and stream.waited == [helper]  # staging work queued before


@cuda
def test_uploads_reuse_a_pinned_buffer_only_once_its_copy_ran():
    dev = torch.device("cuda")
    ups = Uploads()
    torch.cuda._sleep(200_000_000)  # the stream is busy: the first copy stays in flight
    a = ups.upload(torch.arange(6).reshape(2, 3), dev)
    b = ups.upload(torch.arange(6, 12).reshape(2, 3), dev)
    busy = [buf.data_ptr() for buf, _ in ups._bufs]
    assert busy[0] != busy[1]
    torch.cuda.synchronize()
    c = ups.upload(torch.arange(12, 18).reshape(2, 3), dev)
    assert ups._bufs[-1][0].data_ptr() == busy[0]  # done now: taken again
    torch.cuda.synchronize()
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert b.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert c.tolist() == [[12, 13, 14], [15, 16, 17]]


@cuda
def test_uploads_serve_inference_tensors_in_and_out_of_inference_mode():
    dev = torch.device("cuda")
    ups = Uploads()
    with torch.inference_mode():
        a = ups.upload(torch.arange(4).reshape(2, 2), dev)
    torch.cuda.synchronize()
    with torch.inference_mode():
        lists = torch.arange(4, 8).reshape(2, 2)
    b = ups.upload(lists, dev)  # the buffer made under inference mode, reused outside it
    torch.cuda.synchronize()
    assert a.tolist() == [[0, 1], [2, 3]] and b.tolist() == [[4, 5], [6, 7]]
