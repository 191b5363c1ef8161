"""Device memory of a sliding-window model with and without a window pool, in one run.

The ``swa`` family runs one request of ``context`` prompt tokens that decodes
``output_tokens`` tokens, twice on the same weights: with every layer's K/V kept for every
token (``window_pool=False``, one anchor pool) and with the sliding layers' K/V in a window
pool (``window_pool=True``, a unified arena). Measured per side, from ``stats()``:

* ``decode_bytes``: device bytes in use at the last decode step (the request running, its
  whole context computed), and that divided by the context length (``bytes_per_token``);
* ``cached_bytes``: device bytes in use once the request finished and was cached.

The result holds both sides, their ratio (``window / full``) and the ratio the window math
predicts: ``(full layers + sliding layers x rows kept / context) / all layers``. Both sides'
greedy tokens must agree (same weights, same math): ``tokens_equal``.
"""

from __future__ import annotations

import sys
from typing import Any

from kvtier.config import CacheConfig


def _side(
    window_pool: bool, context: int, output_tokens: int, window: int, page: int, device: str | None
) -> dict[str, Any]:
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.families import preset

    cfg = preset(
        "swa",
        sliding_window=window,
        window_pool=window_pool,
        max_position=context + output_tokens + page,
    )
    pages = -(-(context + output_tokens) // page) + 4
    cache = CacheConfig(page_size=page, device_pages=pages, device=device, enable_host=False)
    llm = LLM(cfg, cache, max_running=1)
    tokens = [(i * 7919) % cfg.vocab_size for i in range(context)]
    llm.add_request(tokens, SamplingParams(max_tokens=output_tokens, ignore_eos=True))
    decode_bytes, out = 0, None
    while llm.has_unfinished():
        outs = llm.step()
        if llm.has_unfinished():
            decode_bytes = llm.stats()["device_bytes_used"]
        out = outs[0] if outs else out
    stats = llm.stats()
    llm.close()
    return {
        "window_pool": window_pool,
        "decode_bytes": decode_bytes,
        "bytes_per_token": decode_bytes / context,
        "cached_bytes": stats["device_bytes_used"],
        "device_bytes_total": stats["device_bytes_total"],
        "tokens": out.output_ids if out is not None else [],
        "layers": {"full": len(cfg.full_layers), "sliding": len(cfg.swa_layers)},
    }


def run(
    context: int = 8192,
    output_tokens: int = 8,
    window: int = 512,
    page_size: int = 16,
    device: str | None = None,
) -> dict[str, Any]:
    """Both sides and their ratios (module docstring); progress goes to stderr."""
    sides = {}
    for wp in (False, True):
        print(f"bench window: window_pool={wp}, {context} tokens", file=sys.stderr, flush=True)
        sides["window" if wp else "full"] = _side(
            wp, context, output_tokens, window, page_size, device
        )
    full, win = sides["full"], sides["window"]
    layers = full["layers"]
    # rows a running request keeps: the window's pages plus the page in progress
    kept = min(context, (-(-(window - 1) // page_size) + 1) * page_size)
    predicted = (layers["full"] + layers["sliding"] * kept / context) / (
        layers["full"] + layers["sliding"]
    )
    return {
        "bench": "window_memory",
        "context": context,
        "window": window,
        "page_size": page_size,
        "full": {k: v for k, v in full.items() if k != "tokens"},
        "window_pool": {k: v for k, v in win.items() if k != "tokens"},
        "ratio_decode_bytes": win["decode_bytes"] / full["decode_bytes"],
        "ratio_cached_bytes": win["cached_bytes"] / full["cached_bytes"],
        "ratio_predicted": predicted,
        "tokens_equal": full["tokens"] == win["tokens"],
    }
