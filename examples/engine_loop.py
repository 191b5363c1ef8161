"""A minimal engine loop over ``TieredCache``, the way an engine of your own would use it.

What it shows:

* the admission call: ``admit`` (match, storage prefetch, lock, load), ``admit_ready`` while a
  prefetch runs, ``alloc`` for the uncached suffix (``abandon`` if that fails),
  ``record_hits``, then ``finish`` and ``poll``;
* K/V written and read through the public accessors ``write_kv``/``read_kv`` (logical slots;
  the cache translates them to physical ones);
* requests that share a system prompt hitting it in the device tier, then in the host tier
  once the device tier was flushed;
* a second cache over the same storage directory (what a restarted process sees) restoring the
  prefix from storage, with the restored bytes equal to those written.

The "model" is a stand-in: each token's K/V rows are a function of its id and position, so the
example runs in a second on a CPU and the restored bytes can be checked exactly.

    python examples/engine_loop.py [--storage-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from kvtier import Admission, CacheConfig, PoolSpec, TieredCache
from kvtier.errors import CapacityError

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8
# The pool set of a model with one K/V pool: per layer and token, (K and V) x heads x head_dim.
SPECS = [PoolSpec("kv", LAYERS, (2, KV_HEADS, HEAD_DIM), torch.float32)]


def compute_kv(tokens: list[int], start: int) -> torch.Tensor:
    """The K/V rows of ``tokens[start:]``: ``[layers, tokens, 2, heads, head_dim]`` (a real
    engine runs its forward pass here, reading the cached prefix's K/V)."""
    ids = torch.tensor(tokens[start:], dtype=torch.float32)
    pos = torch.arange(start, len(tokens), dtype=torch.float32)
    grid = torch.arange(LAYERS * 2 * KV_HEADS * HEAD_DIM, dtype=torch.float32)
    rows = torch.sin(ids[:, None] * 0.37 + pos[:, None] * 0.011 + grid[None, :] * 0.5)
    return rows.reshape(len(ids), LAYERS, 2, KV_HEADS, HEAD_DIM).transpose(0, 1).contiguous()


def admit(cache: TieredCache, tokens: list[int]) -> Admission:
    """Admit ``tokens``: ready once its prefix is locked and loaded into the device tier."""
    adm = cache.admit(tokens)
    while not cache.admit_ready(adm, timeout=0.05):
        pass  # a real engine runs its other requests' steps here instead of waiting
    return adm


def serve(cache: TieredCache, tokens: list[int], name: str) -> Admission:
    """One request through the cache: admit, compute what is not cached, finish."""
    adm = admit(cache, tokens)
    try:
        new = cache.alloc(adm.num_new, at=adm.cached_len)  # whole pages for the suffix
    except CapacityError:
        cache.abandon(adm)  # releases the lock (or the prefetch) the admission holds
        raise
    cache.record_hits(adm.handle)  # once per admitted request: per-tier hit counters
    cache.write_kv(new[: adm.num_new], compute_kv(tokens, adm.cached_len))
    slots = torch.cat([adm.locs, new])  # token i's K/V is at slots[i]
    cache.finish(tokens, slots, prefix_len=adm.cached_len, handle=adm.handle)
    cache.poll()  # once per engine step: completes copies, makes them visible, queues backups
    print(
        f"{name:<28} {len(tokens):>6} tokens: device {adm.device_tokens:>4}, "
        f"host {adm.host_tokens:>4}, storage {adm.storage_tokens:>4}, computed {adm.num_new:>4}"
    )
    return adm


def config(storage_dir: str) -> CacheConfig:
    return CacheConfig(
        page_size=4,
        device_pages=64,
        device="cpu",
        storage="file",
        storage_dir=storage_dir,
        # Every storage key holds the model's identity, so that two models never read each
        # other's bytes: ``LLM`` derives it from the weights; an engine of its own names it.
        model_fingerprint="examples/engine_loop: sin-kv v1",
        prefetch_policy="wait_complete",
    )


def main(storage_dir: str) -> None:
    system = list(range(100, 150))  # a shared "system prompt" of 50 tokens
    questions = [[7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]

    with TieredCache(config(storage_dir), SPECS) as cache:
        serve(cache, system + questions[0], "first request")
        serve(cache, system + questions[1], "same prefix, from device")
        cache.flush(host=False)  # drop every device copy: the host tier still has them
        serve(cache, system + questions[2], "same prefix, from host")
        cache.drain()  # wait for the storage writes in flight (close() would, too)
        print(f"first cache: {cache.stats()['storage_backup_pages']} pages written to storage")

    tokens = system + [22, 23, 24]
    with TieredCache(config(storage_dir), SPECS) as cache:  # what a restarted process sees
        adm = admit(cache, tokens)
        restored = cache.read_kv(adm.locs)
        assert adm.storage_tokens > 0, "nothing came from storage"
        assert torch.equal(restored, compute_kv(tokens, 0)[:, : adm.cached_len])
        print(
            f"{'second cache, same dir':<28} {len(tokens):>6} tokens: device "
            f"{adm.device_tokens:>4}, host {adm.host_tokens:>4}, storage "
            f"{adm.storage_tokens:>4}; the restored K/V equals what was written"
        )
        cache.abandon(adm)  # this request stops here: its lock goes back


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-dir", help="file storage directory (default: a temporary one)")
    args = parser.parse_args()
    if args.storage_dir:
        main(args.storage_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-engine-loop-") as tmp:
            main(tmp)
