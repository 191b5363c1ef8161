"""Pool sets of the model families at production-like sizes, for the transfer benchmark.

Shapes follow the engine families' layouts (``kvtier.engine.families``) scaled to the sizes
serving fleets run: a Llama-8B-like dense model, a DeepSeek-V3-like MLA latent cache (512 + 64
per token, 61 layers) with its indexer sidecars, a Mamba-hybrid with a few attention layers and
large recurrent states, and sliding-window models (all layers' KV in the anchor pool).
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError
from kvtier.pools.spec import PoolSpec

FAMILIES = ("dense", "mla", "dsa", "dsa-compressed", "hybrid", "swa")


def family_pool_set(family: str, dtype: torch.dtype = torch.bfloat16) -> list[PoolSpec]:
    """The pool set of ``family`` (anchor first). The attention KV is ``lossy`` as the engine's
    families mark it (a page codec may hold it coded; one scale per KV head, per 64-element
    latent block for MLA)."""
    mla = PoolSpec("kv", 61, (512 + 64,), dtype, lossy=True, scale_block=64)
    gqa = PoolSpec("kv", 32, (2, 8, 128), dtype, lossy=True)
    sets = {
        "dense": [gqa],
        "swa": [gqa],
        "mla": [mla],
        "dsa": [mla, PoolSpec("index_k", 61, (128,), dtype, kind="sidecar")],
        "dsa-compressed": [
            mla,
            PoolSpec("index_rows", 61, (128,), dtype, kind="sidecar", tokens_per_row=64),
        ],
        "hybrid": [
            PoolSpec("kv", 8, (2, 8, 128), dtype, lossy=True),
            PoolSpec("state", 24, (4096 * (3 + 16),), dtype, kind="state"),
        ],
    }
    if family not in sets:
        raise ConfigError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    return sets[family]
