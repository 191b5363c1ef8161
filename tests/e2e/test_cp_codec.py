"""Page codecs under context parallelism, in real processes (gloo on 127.0.0.1).

At CP=2 with ``kv_codec``, each rank codes the pages it owns: a host restore gives every rank
exactly the decoded codes of the rows it first wrote (the codec applied to them on the CPU, byte
for byte), the greedy tokens of a CP=1 cold run, and logits within the codec's measured
tolerance (``test_kv_codec_oracle``). A CP=1 process reading what CP=2 wrote decodes the same
rows and gives the same tokens; a process under another codec finds nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from cp_oracle_child import PAGE, cold, live, restore_solo
from test_kv_codec_oracle import TOLERANCE

from kvtier.engine.families import preset
from kvtier.parallel.launch import launch, results
from kvtier.pools.codec import get_codec


def coded(rows: dict, family: str, codec: str) -> dict:
    """``rows`` (``{page: {component: [layers, rows, *shape]}}``) as a restore through
    ``codec`` gives them back: each lossy component encoded and decoded, the rest unchanged."""
    from kvtier.engine.families import build_model

    specs = {s.name: s for s in build_model(preset(family)).pool_specs()}
    c = get_codec(codec)
    out: dict = {}
    for page, comps in rows.items():
        out[page] = {}
        for name, t in comps.items():
            spec = specs[name]
            if not c.codes(spec):
                out[page][name] = t
                continue
            x = t.reshape(t.shape[0], t.shape[1], spec.row_numel)
            codes, scale = c.encode(x, spec)
            out[page][name] = c.decode(codes, scale, spec).view(t.shape)
    return out


def _close(outs: list[dict], ref: list[dict], codec: str, what: str) -> None:
    for k, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o["tokens"] == r["tokens"], f"{what}: prompt {k} tokens differ"
        diff = float((o["logits"] - r["logits"]).abs().max())
        assert diff <= TOLERANCE[codec], f"{what}: prompt {k} logits differ by {diff}"


def _equal(got: dict, want: dict) -> int:
    for page, comps in got.items():
        for name, t in comps.items():
            assert torch.equal(t, want[page][name]), f"page {page} {name} differs"
    return len(got)


@pytest.mark.parametrize(("family", "codec"), [("tiny", "fp8_e4m3"), ("mla", "int8")])
def test_cp2_codes_its_own_pages_and_cp1_reads_them(tmp_path, family, codec):
    rng = random.Random(3)
    vocab = preset(family).vocab_size
    base = [rng.randrange(vocab) for _ in range(100)]
    prompts = [base[:cut] + [5, cut % vocab] for cut in (37, 64, 100)]
    ref = cold(family, prompts)
    follow = [p + r["tokens"] + [7] for p, r in zip(prompts, ref, strict=True)]
    ref_follow = cold(family, follow)
    store = str(tmp_path / "l3")
    ranks = results(launch(2, live, family, store, prompts, base, follow, codec, timeout=30))
    written: dict = {}
    for r in ranks:
        assert not set(r["rows"]) & set(written), "two ranks hold the same page"
        written.update(r["rows"])
    assert sorted(written) == list(range(100 // PAGE))
    want = coded(written, family, codec)
    assert any(not torch.equal(want[p][n], written[p][n]) for p in want for n in want[p])
    for r in ranks:
        _close(r["host"], ref, codec, "host restore")
        assert all(o["cached"][1] > 0 for o in r["host"])
        _close(r["follow"], ref_follow, codec, "follow-up from a host tail")
        assert _equal(r["restored"], want) == len(r["rows"]) > 0
    solo = restore_solo(family, store, prompts, base, follow, codec)
    assert _equal(solo["rows"], want) == len(written)
    _close(solo["outs"], ref, codec, "CP=1 from CP=2 storage")
    assert solo["follow"][0]["cached"][2] > 0
    other = "int8" if codec != "int8" else "fp8_e4m3"
    blind = restore_solo(family, store, prompts, base, follow, other)
    assert blind["rows"] == {} and all(o["cached"][2] == 0 for o in blind["outs"])
