"""The GIL-free XXH3-64 equals python-xxhash's on every buffer kind and size it is given."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from kvtier.storage import envelope, xxh3

SIZES = [0, 1, 240, xxh3.GIL_FREE_MIN - 1, xxh3.GIL_FREE_MIN, 65535, 65536, 65537, 1 << 20]


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_bound_to_the_library():
    # The file tier's 64 KiB pages rely on it: losing the symbol is a silent slowdown.
    assert xxh3.bound()
    assert envelope.digest is xxh3.digest


@pytest.mark.parametrize("n", SIZES)
def test_equal_to_python_xxhash_for_every_buffer_kind(n):
    raw = _bytes(n)
    want = xxhash.xxh3_64_intdigest(raw)
    buf = bytearray(raw)
    assert xxh3.digest(raw) == want
    assert xxh3.digest(buf) == want
    assert xxh3.digest(memoryview(buf)) == want
    assert xxh3.digest(memoryview(raw)) == want  # read-only: the library's own path
    assert xxh3.digest(np.frombuffer(buf, dtype=np.uint8)) == want
    if n % 8 == 0:
        assert xxh3.digest(memoryview(buf).cast("Q")) == want  # nbytes, not items


def test_slices_of_one_view_digest_their_own_bytes():
    raw = _bytes(4 * 65536, seed=1)
    view = memoryview(bytearray(raw))
    for i in range(4):
        piece = view[i * 65536 : (i + 1) * 65536]
        assert xxh3.digest(piece) == xxhash.xxh3_64_intdigest(raw[i * 65536 : (i + 1) * 65536])


def test_non_contiguous_view_is_refused_like_the_library():
    view = memoryview(bytearray(_bytes(3 * xxh3.GIL_FREE_MIN, seed=2)))[::2]
    with pytest.raises(BufferError):
        xxhash.xxh3_64_intdigest(view)
    with pytest.raises(BufferError):
        xxh3.digest(view)


def test_threads_digest_their_own_buffers():
    bufs = [bytearray(_bytes(65536, seed=10 + i)) for i in range(4)]
    want = [xxhash.xxh3_64_intdigest(b) for b in bufs]
    got: list[list[int]] = [[] for _ in bufs]

    def work(i: int) -> None:
        for _ in range(200):
            got[i].append(xxh3.digest(memoryview(bufs[i])))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[w] * 200 for w in want]
