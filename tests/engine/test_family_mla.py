from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from factories import engine_config

from kvtier.engine import LLM, SamplingParams, SeqSlots
from kvtier.engine.families import build_model, preset
from kvtier.engine.families.mla import MLAModel
from kvtier.engine.families.mla_config import MLAConfig
from kvtier.errors import ConfigError
from kvtier.pools import DevicePool

VARIANTS = ("mla", "dsa", "dsa-compressed")
PAGE = 32  # a multiple of dsa-compressed's group of 32 tokens


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def scattered_locs(n: int, pages: int = 48, seed: int = 0) -> torch.Tensor:
    """Slots of ``n`` tokens on shuffled pages (whole pages, so groups stay aligned)."""
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    need = -(-n // PAGE)
    return (order[:need, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]


def new_pool(model: MLAModel, pages: int = 48) -> DevicePool:
    return DevicePool(model.pool_specs(), pages, PAGE, torch.device("cpu"))


def run(model: MLAModel, pool: DevicePool, ids: list[int], locs: torch.Tensor, start: int = 0):
    """Compute ``ids[start:]`` given that ``ids[:start]`` already sit in ``pool`` at ``locs``."""
    n = len(ids) - start
    seq = SeqSlots(n, locs[start : len(ids)], locs[: len(ids)])
    pos = torch.arange(start, len(ids))
    return model(torch.tensor(ids[start:]), pos, [seq], pool, all_logits=True)


# --- an independent dense reference: whole sequence at once, no pool, selections in Python ---


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # rotate (x[i], x[i + d/2]) pairs as complex numbers
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos.double()[:, None] * inv
    while angle.dim() < x.dim():
        angle = angle.unsqueeze(-2)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * torch.polar(
        torch.ones_like(angle), angle
    )
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def _best(scores: list[float], candidates: list[int], k: int) -> list[int]:
    """The ``k`` best candidates in position order; equal scores go to the lower position."""
    return sorted(sorted(candidates, key=lambda i: (-scores[i], i))[:k])


def reference(model: MLAModel, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """All-position logits and, per query, how many tokens its attention used (layer 0)."""
    c, m = model.config, model.model
    n_tok, heads, nope, rp = len(ids), c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    pos = torch.arange(n_tok)
    x = m.embed_tokens.weight[torch.tensor(ids)]
    counts: list[int] = []
    for layer_no, layer in enumerate(m.layers):
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
        kv_a = h @ a.kv_a_proj_with_mqa.weight.T
        c_kv = _rms(kv_a[:, : c.kv_lora_rank], a.kv_a_layernorm.weight, c.rms_norm_eps)
        k_pe = _rope(kv_a[:, c.kv_lora_rank :], pos, c.rope_theta)
        up = (c_kv @ a.kv_b_proj.weight.T).view(n_tok, heads, nope + c.v_head_dim)
        k = torch.cat((up[..., :nope], k_pe[:, None, :].expand(n_tok, heads, rp)), dim=-1)
        v = up[..., nope:]
        q = (h @ a.q_proj.weight.T).view(n_tok, heads, nope + rp)
        q = torch.cat((q[..., :nope], _rope(q[..., nope:], pos, c.rope_theta)), dim=-1)
        chosen = _reference_selection(model, a, h, torch.cat((c_kv, k_pe), dim=-1))
        allowed = torch.zeros(n_tok, n_tok, dtype=torch.bool)
        rows = [t for t, sel in enumerate(chosen) for _ in sel]
        allowed[rows, [i for sel in chosen for i in sel]] = True
        s = torch.einsum("thd,chd->htc", q, k) / math.sqrt(nope + rp)
        probs = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
        out = torch.einsum("htc,chd->thd", probs, v)
        if layer_no == 0:
            counts = [len(sel) for sel in chosen]
        x = x + out.reshape(n_tok, -1) @ a.o_proj.weight.T
        h2 = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        mlp = layer.mlp
        act = F.silu(h2 @ mlp.gate_proj.weight.T) * (h2 @ mlp.up_proj.weight.T)
        x = x + act @ mlp.down_proj.weight.T
    x = _rms(x, m.norm.weight, c.rms_norm_eps)
    return (x @ model.lm_head.weight.T).float(), counts


def _reference_selection(model: MLAModel, attn, h: torch.Tensor, latent: torch.Tensor):
    c, n_tok = model.config, h.shape[0]
    if c.variant == "mla":
        return [list(range(t + 1)) for t in range(n_tok)]
    ix = attn.indexer
    q = (h @ ix.wq.weight.T).view(n_tok, c.index_n_heads, c.index_head_dim)
    if c.variant == "dsa":
        q = _rope(q, torch.arange(n_tok), c.rope_theta)
    w = (h @ ix.weights_proj.weight.T) / math.sqrt(c.index_n_heads)

    def scores(keys: torch.Tensor) -> list[list[float]]:
        dots = torch.relu(torch.einsum("thd,cd->thc", q, keys)) / math.sqrt(c.index_head_dim)
        return torch.einsum("th,thc->tc", w, dots).tolist()

    if c.variant == "dsa":
        every = scores(_rope(h @ ix.wk.weight.T, torch.arange(n_tok), c.rope_theta))
        out = []
        for t in range(n_tok):
            sc = every[t]
            sc[t] = math.inf  # the query's own token is always kept
            out.append(_best(sc, list(range(t + 1)), c.index_topk))
        return out
    g = c.index_group
    per_token = latent @ ix.wk.weight.T
    rows = torch.stack([per_token[i * g : i * g + g].mean(0) for i in range(n_tok // g)])
    every = scores(rows @ ix.compress_proj.weight.T)
    out = []
    for t in range(n_tok):
        own = t // g
        groups = _best(every[t], list(range(own)), c.index_topk_groups)
        out.append([i for gr in groups for i in range(gr * g, gr * g + g)])
        out[-1] += list(range(own * g, t + 1))
    return out


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_forward_matches_dense_reference(variant: str) -> None:
    model = build_model(preset(variant, dtype="float64"))
    ids_a, ids_b = tokens(200, seed=1), tokens(90, seed=2)
    want_a, counts = reference(model, ids_a)
    want_b, _ = reference(model, ids_b)
    pool = new_pool(model)
    locs = scattered_locs(314, seed=3)
    la, lb = locs[:200], locs[224:]
    # A in two chunks, the cut inside a group; its second chunk batched with all of B
    first = run(model, pool, ids_a[:70], la)
    seqs = [SeqSlots(130, la[70:], la), SeqSlots(90, lb, lb)]
    ids, pos = (
        torch.tensor(ids_a[70:] + ids_b),
        torch.cat((torch.arange(70, 200), torch.arange(90))),
    )
    rest = model(ids, pos, seqs, pool, all_logits=True)
    tol = dict(rtol=1e-5, atol=1e-5)  # the pool's RoPE angles are float32
    torch.testing.assert_close(torch.cat((first, rest[:130])), want_a, **tol)
    torch.testing.assert_close(rest[130:], want_b, **tol)
    # the same step again rewrites identical rows; now only each sequence's last logits
    torch.testing.assert_close(model(ids, pos, seqs, pool), rest[[129, 219]], **tol)
    if variant == "mla":
        assert counts == list(range(1, 201))
    elif variant == "dsa":
        assert max(counts) == 24 and counts[:24] == list(range(1, 25))
    else:  # own group, plus at most 3 earlier groups of 32
        assert counts[199] == 3 * 32 + 200 - 192 and counts[40] == 32 + 9


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decode_matches_full_recompute(variant: str) -> None:
    model = build_model(preset(variant))
    prompt = tokens(100, seed=4)
    pool, locs = new_pool(model), scattered_locs(160, seed=5)
    seq = list(prompt)
    logits = run(model, pool, seq, locs)[-1]
    for _ in range(40):  # crosses the group boundary at position 127
        seq.append(int(logits.argmax()))
        logits = run(model, pool, seq, locs, start=len(seq) - 1)[-1]
    full = run(model, new_pool(model), seq, scattered_locs(160, seed=6))
    assert full[99:-1].argmax(-1).tolist() == seq[100:]
    assert len(set(seq[100:])) > 5  # greedy output is not stuck on one token


def test_dsa_sparsity_changes_results_only_past_topk() -> None:
    ids = tokens(160, seed=7)
    dense = reference(build_model(preset("mla")), ids)[0]
    sparse = build_model(preset("dsa"))
    got = run(sparse, new_pool(sparse), ids, scattered_locs(160))
    torch.testing.assert_close(got[:24], dense[:24], rtol=1e-4, atol=1e-4)
    assert (got[24:] - dense[24:]).abs().max() > 1e-2
    wide = build_model(preset("dsa", index_topk=4096))  # indexer keeps everything: plain MLA
    torch.testing.assert_close(run(wide, new_pool(wide), ids, scattered_locs(160)), dense)
    wide_c = build_model(preset("dsa-compressed", index_topk_groups=64))
    torch.testing.assert_close(run(wide_c, new_pool(wide_c), ids, scattered_locs(160)), dense)


def test_compressed_group_row_written_once_when_complete() -> None:
    model = build_model(preset("dsa-compressed"))
    pool, locs = new_pool(model), scattered_locs(96, seed=8)
    rows = pool.buffers["index_rows"]  # [layers, slots // 32, dim]
    seq = tokens(40, seed=9)
    run(model, pool, seq, locs)
    g0, g1 = int(locs[0]) // 32, int(locs[32]) // 32
    assert (rows[:, g0] != 0).any(dim=-1).all() and (rows[:, g1] == 0).all()
    row0 = rows[:, g0].clone()
    while len(seq) < 63:  # positions 40..62: group 1 still incomplete
        seq.append(len(seq))
        run(model, pool, seq, locs, start=len(seq) - 1)
        assert (rows[:, g1] == 0).all()
    seq.append(7)  # position 63 completes group 1
    run(model, pool, seq, locs, start=63)
    assert (rows[:, g1] != 0).any(dim=-1).all()
    row1 = rows[:, g1].clone()
    seq.append(8)
    run(model, pool, seq, locs, start=64)
    assert torch.equal(rows[:, g0], row0) and torch.equal(rows[:, g1], row1)
    assert int((rows != 0).any(-1).sum()) == 2 * model.config.num_layers


def test_pool_specs() -> None:
    (kv,) = build_model(preset("mla")).pool_specs()
    assert (kv.name, kv.kind, kv.row_shape) == ("kv", "kv", (40,))
    kv, side = build_model(preset("dsa")).pool_specs()
    assert (side.name, side.kind, side.row_shape) == ("index_k", "sidecar", (16,))
    assert side.tokens_per_row == 1
    kv, side = build_model(preset("dsa-compressed")).pool_specs()
    assert kv.row_shape == (40,) and (side.name, side.tokens_per_row) == ("index_rows", 32)


def test_presets_and_fingerprint() -> None:
    assert [preset(n).variant for n in VARIANTS] == list(VARIANTS)
    assert preset("dsa").index_topk == 24 and preset("dsa-compressed").index_group == 32
    assert preset("mla", num_layers=2).num_layers == 2
    fps = {preset(n).fingerprint() for n in VARIANTS} | {preset("mla", seed=1).fingerprint()}
    assert len(fps) == 4 and preset("mla").fingerprint() == MLAConfig().fingerprint()
    assert MLAConfig(eos_token_ids=(3,)).fingerprint() == MLAConfig().fingerprint()
    a, b = build_model(preset("dsa")), build_model(preset("dsa"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_lora_rank", 0),
        ("qk_rope_head_dim", 7),
        ("index_topk", -1),
        ("index_kpool", 1.5),
        ("variant", "sparse"),
        ("dtype", "int8"),
        ("rms_norm_eps", 0.0),
        ("eos_token_ids", (512,)),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        MLAConfig(**{field: value})


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_prefix_hit_matches_cold(variant: str) -> None:
    cache = engine_config(device="cpu", prefetch_policy="timeout")
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    shared = tokens(150, seed=10)
    a, b = shared + tokens(20, seed=11), shared + tokens(30, seed=12)
    cold = LLM(preset(variant), cache).generate([b], greedy)[0]
    llm = LLM(preset(variant), cache)
    assert llm.cache.page_size == (32 if variant == "dsa-compressed" else 16)
    first = llm.generate([a], greedy)[0]
    warm = llm.generate([b], greedy)[0]
    assert len(first.output_ids) == 8 and warm.output_ids == cold.output_ids
    assert warm.cached_device == 150 // llm.cache.page_size * llm.cache.page_size


@pytest.mark.parametrize("variant", ["dsa", "dsa-compressed"])
def test_engine_host_and_storage_restores_match_cold(variant: str, tmp_path) -> None:
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    target = tokens(140, seed=20)
    base = dict(device="cpu", prefetch_policy="timeout")
    cold = LLM(preset(variant), engine_config(**base)).generate([target], greedy)
    small = engine_config(device_pages=12, host_ratio=4.0, **base)
    llm = LLM(preset(variant), small, max_running=1)
    llm.generate([target], greedy)
    others = [tokens(150, seed=21 + i) for i in range(3)]  # push target out of the device tier
    llm.generate(others, SamplingParams(max_tokens=2, ignore_eos=True))
    from_host = llm.generate([target], greedy)[0]
    assert from_host.cached_host == 128 and from_host.output_ids == cold[0].output_ids
    stored = engine_config(tmp_path, device="cpu")
    with LLM(preset(variant), stored) as first:
        first.generate([target], greedy)
    with LLM(preset(variant), stored) as fresh:
        from_storage = fresh.generate([target], greedy)[0]
    assert from_storage.cached_storage == 128
    assert from_storage.output_ids == cold[0].output_ids
