"""Page codecs on every model family's pool set, through the engine: after a host restore the
lossy components (the attention KV anchors) hold exactly the codec's decode of the rows first
computed, and every other component (indexer keys and rows, recurrent state, window rows,
draft KV and hidden states) its rows byte for byte, at page sizes 1 and 16 and both host
layouts (on ``KVTIER_TEST_DEVICE``, CPU by default)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_family_oracle import GREEDY, rows_equal, snapshot

from kvtier.config import CacheConfig
from kvtier.engine import LLM
from kvtier.engine.families import preset
from kvtier.pools.codec import get_codec

FAMILIES = ["tiny", "mla", "dsa", "dsa-compressed", "hybrid", "swa", "tiny-mtp"]
PAGE_SIZES = {"dsa-compressed": (4, 16)}
"""Its compressed index groups 4 tokens: a page holds whole groups."""


def _coded(rows: dict[str, torch.Tensor], llm: LLM, codec: str) -> dict[str, torch.Tensor]:
    """``rows`` (``snapshot``'s: ``[layers, pages x rows per page, *row]``) as a restore
    through ``codec`` gives them back: each lossy component encoded and decoded per page and
    layer, the others unchanged."""
    c, ps = get_codec(codec), llm.cache.page_size
    out = dict(rows)
    for spec in llm.cache.specs:
        if not c.codes(spec):
            continue
        t = rows[spec.name]
        r = spec.rows_per_page(ps)
        x = t.reshape(t.shape[0] * (t.shape[1] // r), r, spec.row_numel)
        out[spec.name] = c.decode(*c.encode(x, spec), spec).view(t.shape)
    return out


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize(
    ("family", "ps"), [(f, p) for f in FAMILIES for p in PAGE_SIZES.get(f, (1, 16))]
)
def test_every_family_restores_the_codecs_rows_and_the_rest_exactly(family, ps, layout):
    cfg = CacheConfig(
        page_size=ps,
        device_pages=1536 // ps,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        host_layout=layout,
        kv_codec="int8",
        prefetch_policy="wait_complete",
        debug_checks=True,
    )
    llm = LLM(preset(family), cfg, max_running=1)
    rng = random.Random(7)
    base = [rng.randrange(llm.model_config.vocab_size) for _ in range(96)]
    llm.generate([base], GREEDY)
    llm.cache.drain()
    first = snapshot(llm, base)
    lossy = [s.name for s in llm.cache.specs if s.lossy]
    assert lossy == [llm.cache.specs[0].name]  # the anchor, and only it
    llm.cache.flush(host=False)
    restored = snapshot(llm, base)
    want = _coded(first, llm, "int8")
    for name in lossy:
        n = min(restored[name].shape[1], want[name].shape[1])
        assert n > 0 and torch.equal(restored[name][:, :n], want[name][:, :n]), name
        assert not torch.equal(restored[name][:, :n], first[name][:, :n])  # coded indeed
    exact = {k: v for k, v in restored.items() if k.split(".")[0] not in lossy}
    same, compared = rows_equal(exact, {k: first[k] for k in exact})
    assert same and all(n > 0 for n in compared.values()), compared
    assert llm.generate([base + [5]], GREEDY)[0].cached_host > 0
    llm.cache.check_integrity()
    llm.close()
