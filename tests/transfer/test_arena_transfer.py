"""Transfers of a unified device pool through the ``Mover`` and its ``ArenaTranslator``: each
component's rows move byte-exact between base units and host pages across relocations, window
rows only where a page has them, and every op leases its device pages while bytes are in
flight."""

from __future__ import annotations

import pytest
import torch
from factories import DEVICE, randomise

from kvtier.errors import ConfigError, IntegrityError, RequestError
from kvtier.pools import DevicePool, HostPool, PoolSpec, UnifiedPool
from kvtier.transfer import Mover, PermutationTranslator
from kvtier.transfer.component import ComponentRows

CUDA = DEVICE.startswith("cuda")
MECHANISMS = ["auto", "kernel", "copy_engine"] if CUDA else ["auto"]
PATHS = {"auto": {"kernel", "direct"}, "kernel": {"kernel"}, "copy_engine": {"direct"}}
ROWS = [((2, 2, 8), torch.bfloat16), ((2, 1, 3), torch.uint8)]  # int64 words; byte words


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def pools(ps: int, layout: str, row=ROWS[0], compaction: str = "auto"):  # noqa: ANN001, ANN201
    shape, dtype = row
    specs = [
        PoolSpec("kv", 2, shape, dtype),
        PoolSpec("swa", 3, shape, dtype, kind="window", window=2 * ps),
    ]
    dev = UnifiedPool(specs, 6, ps, torch.device(DEVICE), compaction=compaction)
    host = HostPool(specs, 8, ps, layout, pin=CUDA)
    randomise(dev.arena, 1)
    for i, buf in enumerate(host.buffers.values()):
        randomise(buf, 2 + i)
    return dev, host


def host_rows(host: HostPool, name: str, page: int) -> torch.Tensor:
    """``[layers, words]``: one host page of one component."""
    return host.page_bytes_view(name)[:, page].clone()


def dev_rows(dev: UnifiedPool, name: str, page: int) -> torch.Tensor:
    return dev.component_words(name, t(page))[:, 0]


def finish(op) -> None:  # noqa: ANN001
    op.wait()
    op.complete()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("row", ROWS, ids=["bf16", "u8"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_roundtrip_across_relocation_is_byte_exact(ps, layout, row, mechanism):
    dev, host = pools(ps, layout, row)
    mover = Mover(dev, host, mechanism=mechanism)
    d = dev.alloc_pages(4)
    assert d.tolist() == [0, 1, 2, 3]
    dev.release_window(t(1, 3))
    assert dev.physical(d).tolist() == [0, 5, 10, 15]
    assert dev.physical(d, "swa").tolist() == [2, -1, 12, -1]
    kv = [dev_rows(dev, "kv", p) for p in range(4)]
    swa = {p: dev_rows(dev, "swa", p) for p in (0, 2)}
    h = [5, 2, 7, 0]
    untouched = {p: host_rows(host, "swa", h[p]) for p in (1, 3)}

    op = mover.device_to_host(d, torch.tensor(h))
    assert op.num_pages == 4 and op.nbytes == (4 * 2 + 2 * 3) * dev.unit_bytes
    finish(op)
    assert set(op.paths.values()) <= ({"cpu"} if not CUDA else PATHS[mechanism])
    for p in range(4):
        assert torch.equal(host_rows(host, "kv", h[p]), kv[p]), p
    for p, data in swa.items():
        assert torch.equal(host_rows(host, "swa", h[p]), data), p
    for p, data in untouched.items():  # no window envelope: host window rows stay
        assert torch.equal(host_rows(host, "swa", h[p]), data), p

    # Pages 1 and 3 relocate when 0 and 2 go; fresh pages land where none of them was.
    dev.free_pages(t(0, 2))
    assert dev.compact() == 2
    assert dev.physical(t(1, 3)).tolist() == [0, 2]
    e = dev.alloc_pages(4)
    assert e.tolist() == [4, 5, 6, 7]
    assert dev.physical(e).tolist() == [4, 9, 14, 19]
    assert dev.physical(e, "swa").tolist() == [6, 11, 16, 21]
    dev.release_window(t(6))
    words = dev.unit_words().cpu().clone()
    finish(mover.host_to_device(torch.tensor(h), e))
    for i, p in enumerate(e.tolist()):
        assert torch.equal(dev_rows(dev, "kv", p), kv[i]), p
    host_swa = {i: host_rows(host, "swa", h[i]) for i in range(4)}
    for i in (0, 1, 3):  # page 6 has no window: its host rows are not copied
        assert torch.equal(dev_rows(dev, "swa", int(e[i])), host_swa[i]), i
    written = [
        u
        for b, k in ((4, 2), (9, 2), (14, 2), (19, 2), (6, 3), (11, 3), (21, 3))
        for u in range(b, b + k)
    ]
    rest = torch.ones(dev.units, dtype=torch.bool)
    rest[written] = False
    assert torch.equal(dev.unit_words().cpu()[rest], words[rest])  # nothing else written

    # Back into the relocated, window-less pages: kv only.
    finish(mover.host_to_device(torch.tensor([h[1], h[3]]), t(1, 3)))
    assert torch.equal(dev_rows(dev, "kv", 1), kv[1]) and torch.equal(dev_rows(dev, "kv", 3), kv[3])
    assert dev.leased_pages == 0
    dev.check_integrity()
    host.check_integrity()


def test_eager_compaction_relocates_between_backup_and_load():
    dev, host = pools(4, "page_first", compaction="eager")
    mover = Mover(dev, host)
    a = dev.alloc_pages(3)
    dev.release_window(a[:1])
    kv = {p: dev_rows(dev, "kv", p) for p in a.tolist()}
    swa = {p: dev_rows(dev, "swa", p) for p in (1, 2)}
    finish(mover.device_to_host(a, t(0, 1, 2)))
    dev.free_pages(a[:1])
    before = dev.physical(a[1:]).tolist()
    b = dev.alloc_pages(1)  # eager: pages 1 and 2 slide down first
    assert dev.physical(a[1:]).tolist() != before
    for p in (1, 2):
        assert torch.equal(dev_rows(dev, "kv", p), kv[p])
        assert torch.equal(dev_rows(dev, "swa", p), swa[p])
    finish(mover.host_to_device(t(1), b))
    assert torch.equal(dev_rows(dev, "kv", int(b)), kv[1])
    assert torch.equal(dev_rows(dev, "swa", int(b)), swa[1])
    dev.check_integrity()


def test_compaction_skips_pages_whose_copy_is_in_flight(monkeypatch):
    """A compaction while an op's bytes move (on CPU: run from inside the copy) leaves the
    op's pages where the copy addresses them; everything else slides down."""
    dev, host = pools(1, "layer_first")
    mover = Mover(dev, host)
    a = dev.alloc_pages(4)
    dev.free_pages(a[:2])
    dev.lease(t(3))  # as an op in flight on CUDA holds it
    assert dev.compact() == 2  # page 2's kv and swa; page 3 stays at 15 / 17
    assert dev.physical(t(2, 3)).tolist() == [0, 15]
    dev.unlease(t(3))
    kv = dev_rows(dev, "kv", 3)
    seen = []
    real = ComponentRows.cpu

    def racing(self, direction, pages):  # noqa: ANN001, ANN202
        seen.append((int(dev.lease_count(t(3))), dev.compact()))
        real(self, direction, pages)

    if CUDA:  # the copy is queued on the backup stream: compact while it may still run
        op = mover.device_to_host(t(3), t(6))
        seen.append((int(dev.lease_count(t(3))), dev.compact()))
        seen.append((int(dev.lease_count(t(3))), dev.compact()))
        finish(op)
    else:  # the copy is synchronous: compact from inside it
        monkeypatch.setattr(ComponentRows, "cpu", racing)
        op = mover.device_to_host(t(3), t(6))
        monkeypatch.undo()
    assert seen == [(1, 0), (1, 0)]  # leased while its bytes move: nothing moved
    assert not op.holds_lease and dev.leased_pages == 0
    assert torch.equal(host_rows(host, "kv", 6), kv)
    assert dev.compact() == 2 and dev.physical(t(3)).tolist() == [5]
    dev.check_integrity()


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_failed_transfer_releases_its_lease(monkeypatch, direction):
    dev, host = pools(4, "page_first")
    mover = Mover(dev, host)
    a = dev.alloc_pages(2)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("copy failed")

    name = "_load_chunks" if CUDA and direction == "h2d" else ("_backup" if CUDA else None)
    if name is None:
        monkeypatch.setattr(ComponentRows, "cpu", broken)
    else:
        monkeypatch.setattr(Mover, name, broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        if direction == "d2h":
            mover.device_to_host(a, t(0, 1))
        else:
            mover.host_to_device(t(0, 1), a)
    assert dev.lease_count(a).tolist() == [0, 0]
    dev.check_integrity()


@pytest.mark.skipif(not CUDA, reason="CPU ops are born done and hold no lease")
def test_cuda_op_holds_its_lease_until_complete():
    dev, host = pools(4, "page_first")
    mover = Mover(dev, host)
    a = dev.alloc_pages(2)
    op = mover.device_to_host(a, t(0, 1))
    assert op.holds_lease and dev.lease_count(a).tolist() == [1, 1]
    with pytest.raises(IntegrityError, match="free: page 0 is leased"):
        dev.free_pages(a)
    op.wait()
    op.complete()
    op.complete()
    assert dev.lease_count(a).tolist() == [0, 0]


def test_per_layer_paths_and_foreign_translators_are_refused():
    dev, host = pools(4, "page_first")
    mover = Mover(dev, host)
    a = dev.alloc_pages(1)
    with pytest.raises(IntegrityError, match="per-layer loads are not supported"):
        mover.host_to_device(t(0), a, overlap=True)
    with pytest.raises(IntegrityError, match="per-layer backups are not supported"):
        mover.layered_backup(a, t(0))
    with pytest.raises(ConfigError, match="translator=PermutationTranslator: a unified"):
        Mover(dev, host, translator=PermutationTranslator())
    assert dev.leased_pages == 0


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_copy_of_some_components_leaves_the_others_alone(mechanism):
    dev, host = pools(4, "layer_first")
    mover = Mover(dev, host, mechanism=mechanism)
    a = dev.alloc_pages(2)
    dev.release_window(a[1:])
    kv_host = [host_rows(host, "kv", h) for h in (3, 4)]
    op = mover.device_to_host(a, t(3, 4), components=("swa",))
    finish(op)
    assert op.nbytes == 3 * dev.unit_bytes and set(op.paths) == {"swa"}
    assert torch.equal(host_rows(host, "swa", 3), dev_rows(dev, "swa", 0))
    for h, data in zip((3, 4), kv_host, strict=True):
        assert torch.equal(host_rows(host, "kv", h), data)
    swa_dev = dev_rows(dev, "swa", 0)
    finish(mover.host_to_device(t(5, 6), a, components=["kv"]))
    assert torch.equal(dev_rows(dev, "kv", 1), host_rows(host, "kv", 6))
    assert torch.equal(dev_rows(dev, "swa", 0), swa_dev)
    with pytest.raises(RequestError, match=r"components \['idx'\]: the pools hold kv, swa"):
        mover.device_to_host(a, t(3, 4), components=("idx",))
    assert dev.leased_pages == 0


def test_ordinary_pools_copy_some_components_too():
    specs = [
        PoolSpec("kv", 2, (2, 1, 4), torch.float32),
        PoolSpec("idx", 2, (4,), torch.float32, kind="sidecar"),
    ]
    dev = DevicePool(specs, 4, 2, torch.device(DEVICE))
    host = HostPool(specs, 4, 2, "page_first", pin=CUDA)
    for buf in [*dev.buffers.values(), *host.buffers.values()]:
        randomise(buf, buf.numel())
    before = host.page_bytes_view("kv")[:, 1].clone()
    op = Mover(dev, host).device_to_host(t(2), t(1), components=("idx",))
    finish(op)
    assert op.nbytes == specs[1].page_bytes(2)
    assert torch.equal(host.page_bytes_view("idx")[:, 1], dev.page_bytes_view("idx")[:, 2].cpu())
    assert torch.equal(host.page_bytes_view("kv")[:, 1], before)
