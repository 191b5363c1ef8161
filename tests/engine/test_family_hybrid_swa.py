from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from factories import engine_config

from kvtier.engine import LLM, CausalLM, SamplingParams, SeqSlots
from kvtier.engine.families import build_model, preset
from kvtier.engine.families.hybrid import HybridModel
from kvtier.engine.families.hybrid_config import HybridConfig, hybrid_preset
from kvtier.engine.families.swa import SWAModel
from kvtier.engine.families.swa_config import SWAConfig, swa_preset
from kvtier.errors import ConfigError, RequestError
from kvtier.pools import DevicePool

PAGE = 4
PAGES = 64


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scattered_locs(pool: DevicePool, seed: int = 1) -> torch.Tensor:
    # non-contiguous pages: the models must follow slots, not assume order
    pages = torch.randperm(PAGES, generator=torch.Generator().manual_seed(seed))[:40]
    return pool.locs(pages)


def make_pool(model: torch.nn.Module) -> DevicePool:
    return DevicePool(model.pool_specs(), PAGES, PAGE, torch.device("cpu"))


def rope_ref(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # rotate (x[i], x[i + d/2]) pairs as complex numbers
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None] * inv)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def attention_ref(attn, h: torch.Tensor, cfg, window: int | None) -> torch.Tensor:
    n = h.shape[0]
    pos = torch.arange(n)
    q = rope_ref(attn.q_proj(h).view(n, cfg.num_heads, cfg.head_dim), pos, cfg.rope_theta)
    k = rope_ref(attn.k_proj(h).view(n, cfg.num_kv_heads, cfg.head_dim), pos, cfg.rope_theta)
    v = attn.v_proj(h).view(n, cfg.num_kv_heads, cfg.head_dim)
    g = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return attn.o_proj(o.transpose(0, 1).reshape(n, -1))


def test_registry_builds_both_families() -> None:
    # build_model walks every registered family, so this also needs the others to import
    assert isinstance(build_model(preset("swa", seed=1)), SWAModel)
    assert isinstance(build_model(preset("hybrid", seed=1)), HybridModel)


# ---------------------------------------------------------------- sliding window


def swa_ref(model: SWAModel, toks: list[int]) -> torch.Tensor:
    """All-position logits from a whole-sequence forward with explicit window masks."""
    c, m = model.config, model.model
    x = m.embed_tokens(torch.tensor(toks))
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            window = c.sliding_window if i in c.swa_layers else None
            x = x + attention_ref(layer.self_attn, layer.input_layernorm(x), c, window)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return F.linear(m.norm(x), model.head_weight()).float()


def prefill(model, pool, toks, locs, **kw) -> torch.Tensor:
    n = len(toks)
    return model(torch.tensor(toks), torch.arange(n), [SeqSlots(n, locs[:n], locs[:n])], pool, **kw)


def test_swa_layers_and_pool() -> None:
    assert swa_preset().swa_layers == (0, 2)
    assert SWAConfig(full_every=0).swa_layers == (0, 1, 2, 3)
    assert SWAConfig(full_every=1).swa_layers == ()
    model = SWAModel(swa_preset())
    kv, win = model.pool_specs()
    assert (kv.name, kv.kind, kv.num_layers, kv.row_shape) == ("kv", "kv", 2, (2, 2, 32))
    assert (win.name, win.kind, win.num_layers, win.window) == ("swa", "window", 2, 48)
    assert model.anchor_layers() == [1, 3]
    # every row kept: one anchor of every layer (also when every layer slides)
    for cfg in (swa_preset(window_pool=False), swa_preset(full_every=0)):
        (spec,) = SWAModel(cfg).pool_specs()
        assert (spec.name, spec.kind, spec.num_layers) == ("kv", "kv", 4)
    assert model.stateful is False
    assert isinstance(preset("swa"), SWAConfig)


def test_swa_paged_matches_windowed_reference_and_differs_from_full() -> None:
    # the model's math on a plain paged pool (the window pool's engine runs are compared
    # with this layout's outputs in tests/test_window_pool.py)
    cfg = swa_preset(sliding_window=16, window_pool=False)
    model = SWAModel(cfg)
    toks = tokens(70)
    pool = make_pool(model)
    locs = scattered_locs(pool)
    paged = prefill(model, pool, toks, locs, all_logits=True)
    torch.testing.assert_close(paged, swa_ref(model, toks), atol=1e-4, rtol=1e-4)
    assert 1.0 < float(paged.std()) < 3.0
    # same weights as the dense model: equal inside the window, different beyond it
    dense = CausalLM(cfg.dense())
    full = prefill(dense, make_pool(dense), toks, locs, all_logits=True)
    torch.testing.assert_close(paged[:16], full[:16], atol=1e-4, rtol=1e-4)
    gap = (paged[16:] - full[16:]).abs().amax(dim=-1)
    assert bool((gap > 1e-2).all())


def test_swa_decode_reads_only_the_window() -> None:
    cfg = swa_preset(sliding_window=8, full_every=0, window_pool=False)
    model = SWAModel(cfg)
    toks = tokens(30, seed=3)
    pool = make_pool(model)
    locs = scattered_locs(pool)
    want = prefill(model, pool, toks, locs, all_logits=True)
    # garbage outside the window of the last token must not matter to a decode step
    n = len(toks)
    for layer in range(cfg.num_layers):
        pool.layer(layer)[locs[: n - cfg.sliding_window]] = 1e4
    seq = SeqSlots(1, locs[n - 1 : n], locs[:n])
    got = model(torch.tensor(toks[-1:]), torch.tensor([n - 1]), [seq], pool)
    torch.testing.assert_close(got[0], want[-1], atol=1e-4, rtol=1e-4)


def test_swa_engine_prefix_hit_equals_cold() -> None:
    cfg = preset("swa")
    params = SamplingParams(max_tokens=10)
    shared = tokens(70, seed=4)
    a, b = shared + [1, 2, 3], shared + [9, 8, 7, 6]

    def engine() -> LLM:
        cache = engine_config(device="cpu", prefetch_policy="timeout", debug_checks=False)
        return LLM(SWAModel(cfg), cache)

    cold = engine().generate([b], params)[0]
    llm = engine()
    llm.generate([a], params)
    warm = llm.generate([b], params)[0]
    assert warm.cached_device == 64
    assert warm.output_ids == cold.output_ids
    assert len(set(cold.output_ids)) > 3


def test_swa_config_validation_and_fingerprint() -> None:
    with pytest.raises(ConfigError, match="sliding_window"):
        SWAConfig(sliding_window=0)
    with pytest.raises(ConfigError, match="full_every"):
        SWAConfig(full_every=-1)
    with pytest.raises(ConfigError, match="num_heads"):
        SWAConfig(num_heads=3)
    with pytest.raises(ConfigError, match="dtype"):
        SWAConfig(dtype="int8")
    fp = SWAConfig().fingerprint()
    assert fp == SWAConfig(eos_token_ids=(1,)).fingerprint() and len(fp) == 32
    assert fp != SWAConfig(sliding_window=47).fingerprint()
    assert fp != SWAConfig().dense().fingerprint()


# ---------------------------------------------------------------- hybrid


def mixer_ref(mx, h: torch.Tensor) -> torch.Tensor:
    """The recurrent mixer over a whole sequence from zero state: conv1d, then a plain scan."""
    n = h.shape[0]
    xi, z = mx.in_proj(h).chunk(2, dim=-1)
    w = mx.conv1d.weight
    conv = F.conv1d(xi.t()[None], w, mx.conv1d.bias, padding=mx.d_conv - 1, groups=mx.d_inner)
    u = F.silu(conv[0, :, :n].t())
    dt_in, b, c = mx.x_proj(u).split([mx.dt_rank, mx.d_state, mx.d_state], dim=-1)
    dt = F.softplus(mx.dt_proj(dt_in))
    a = -torch.exp(mx.A_log)
    state = torch.zeros(mx.d_inner, mx.d_state)
    ys = []
    for t in range(n):
        state = torch.exp(dt[t, :, None] * a) * state + dt[t, :, None] * b[t] * u[t, :, None]
        ys.append((state * c[t]).sum(-1) + mx.D * u[t])
    return mx.out_proj(torch.stack(ys) * F.silu(z))


def hybrid_ref(model: HybridModel, toks: list[int]) -> torch.Tensor:
    c, m = model.config, model.model
    x = m.embed_tokens(torch.tensor(toks))
    with torch.no_grad():
        for layer in m.layers:
            h = layer.input_layernorm(x)
            if layer.self_attn is not None:
                x = x + attention_ref(layer.self_attn, h, c, None)
            else:
                x = x + mixer_ref(layer.mixer, h)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return F.linear(m.norm(x), model.lm_head.weight).float()


def run(model, pool, toks, locs, start, end, state, state_out=(), **kw) -> torch.Tensor:
    """Forward tokens ``[start, end)`` with context ``[0, end)``."""
    seq = SeqSlots(end - start, locs[start:end], locs[:end], state, list(state_out))
    ids = torch.tensor(toks[start:end])
    return model(ids, torch.arange(start, end), [seq], pool, **kw)


@pytest.fixture(scope="module")
def hybrid() -> HybridModel:
    return HybridModel(hybrid_preset())


def test_hybrid_layout_and_pools(hybrid: HybridModel) -> None:
    c = hybrid.config
    assert c.attn_layers == (1, 3) and hybrid.stateful is True
    kv, st = hybrid.pool_specs()
    assert (kv.kind, kv.num_layers, kv.row_shape) == ("kv", 2, (2, 2, 32))
    assert (st.kind, st.num_layers, st.row_shape) == ("state", 2, (256 * (3 + 8),))
    zero = hybrid.zero_state()
    assert len(zero) == 2 and all(s.shape == st.row_shape and not s.any() for s in zero)
    assert isinstance(preset("hybrid"), HybridConfig)


def test_hybrid_paged_matches_whole_sequence_reference(hybrid: HybridModel) -> None:
    toks = tokens(45, seed=5)
    pool = make_pool(hybrid)
    locs = scattered_locs(pool)
    state = hybrid.zero_state()
    paged = run(hybrid, pool, toks, locs, 0, len(toks), state, all_logits=True)
    torch.testing.assert_close(paged, hybrid_ref(hybrid, toks), atol=1e-4, rtol=1e-4)
    assert 1.0 < float(paged.std()) < 3.0
    assert all(s.any() for s in state), "the running state must be updated in place"


@pytest.mark.parametrize("variant", ["default", "RRA-d_conv1"])
def test_hybrid_split_prefill_equals_one_forward(hybrid: HybridModel, variant: str) -> None:
    if variant != "default":
        hybrid = HybridModel(HybridConfig(num_layers=3, attn_every=3, d_conv=1, seed=4))
    toks = tokens(41, seed=6)
    pool = make_pool(hybrid)
    locs = scattered_locs(pool)
    one_state = hybrid.zero_state()
    one = run(hybrid, pool, toks, locs, 0, 41, one_state, all_logits=True)
    pool2 = make_pool(hybrid)
    state = hybrid.zero_state()
    first = run(hybrid, pool2, toks, locs, 0, 17, state, all_logits=True)
    rest = run(hybrid, pool2, toks, locs, 17, 41, state, all_logits=True)
    torch.testing.assert_close(torch.cat((first, rest)), one, atol=1e-5, rtol=1e-5)
    for a, b in zip(state, one_state, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_hybrid_resume_from_checkpoint_row(hybrid: HybridModel) -> None:
    toks = tokens(40, seed=7)
    pool = make_pool(hybrid)
    locs = scattered_locs(pool)
    rows = {15: int(locs[15]) // PAGE, 31: int(locs[31]) // PAGE}
    full = run(hybrid, pool, toks, locs, 0, 40, hybrid.zero_state(), rows.items(), all_logits=True)
    for i, row in rows.items():
        state = hybrid.load_state(pool, row)
        assert all(s.any() for s in state)
        resumed = run(hybrid, pool, toks, locs, i + 1, 40, state, all_logits=True)
        torch.testing.assert_close(resumed, full[i + 1 :], atol=1e-5, rtol=1e-5)
    # load_state hands out copies: running from one leaves the checkpoint row as it was
    before = [s.clone() for s in hybrid.load_state(pool, rows[31])]
    run(hybrid, pool, toks, locs, 32, 40, hybrid.load_state(pool, rows[31]))
    after = hybrid.load_state(pool, rows[31])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_hybrid_incremental_decode_equals_recompute(hybrid: HybridModel) -> None:
    prompt, steps = tokens(9, seed=8), 16
    pool = make_pool(hybrid)
    locs = scattered_locs(pool)
    state = hybrid.zero_state()
    toks = list(prompt)
    logits = run(hybrid, pool, toks, locs, 0, len(toks), state)
    for _ in range(steps):
        toks.append(int(logits[0].argmax()))
        logits = run(hybrid, pool, toks, locs, len(toks) - 1, len(toks), state)
    decoded = toks[len(prompt) :]
    again = list(prompt)
    for _ in range(steps):
        fresh = make_pool(hybrid)
        last = run(hybrid, fresh, again, locs, 0, len(again), hybrid.zero_state())
        again.append(int(last[0].argmax()))
    assert decoded == again[len(prompt) :]
    assert len(set(decoded)) > 4, "random weights should not collapse to one repeated token"


def test_hybrid_batch_is_per_sequence(hybrid: HybridModel) -> None:
    a, b = tokens(13, seed=9), tokens(6, seed=10)
    pool = make_pool(hybrid)
    la, lb = pool.locs(torch.tensor([3, 7, 1, 9])), pool.locs(torch.tensor([20, 2]))
    sa, sb = hybrid.zero_state(), hybrid.zero_state()
    seqs = [SeqSlots(13, la[:13], la[:13], sa), SeqSlots(6, lb[:6], lb[:6], sb)]
    pos = torch.cat((torch.arange(13), torch.arange(6)))
    both = hybrid(torch.tensor(a + b), pos, seqs, pool)
    alone = run(hybrid, make_pool(hybrid), b, lb, 0, 6, hybrid.zero_state())
    torch.testing.assert_close(both[1], alone[0], atol=1e-5, rtol=1e-5)


def test_hybrid_forward_requires_state(hybrid: HybridModel) -> None:
    pool = make_pool(hybrid)
    locs = pool.locs(torch.tensor([0]))
    n = hybrid.num_recurrent
    with pytest.raises(RequestError, match=f"running state of {n} tensors, got None"):
        run(hybrid, pool, [1, 2], locs, 0, 2, None)
    with pytest.raises(RequestError, match=r"state_out \[\(2, 0\)\] names a token outside the 2"):
        run(hybrid, pool, [1, 2], locs, 0, 2, hybrid.zero_state(), [(2, 0)])


def test_recurrent_checkpoints_need_rows(hybrid: HybridModel) -> None:
    mixer = next(layer.mixer for layer in hybrid.model.layers if layer.mixer is not None)
    x = torch.zeros(2, hybrid.config.hidden_size, dtype=hybrid.config.torch_dtype)
    with pytest.raises(RequestError, match="1 state checkpoint"):
        mixer(x, hybrid.zero_state()[0], [(1, 0)])


def test_hybrid_config_validation_and_fingerprint() -> None:
    for bad, field in [
        (dict(attn_every=1), "attn_every"),
        (dict(attn_every=5), "attn_every"),
        (dict(d_conv=0), "d_conv"),
        (dict(d_state=0), "d_state"),
        (dict(checkpoint_every=0), "checkpoint_every"),
        (dict(num_kv_heads=3), "num_heads"),
        (dict(dtype="int8"), "dtype"),
        (dict(eos_token_ids=(512,)), "eos_token_ids"),
    ]:
        with pytest.raises(ConfigError, match=field):
            HybridConfig(**bad)
    fp = HybridConfig().fingerprint()
    assert fp == hybrid_preset().fingerprint() and len(fp) == 32
    assert fp == HybridConfig(eos_token_ids=(3,), checkpoint_every=4).fingerprint()
    assert fp != HybridConfig(d_state=16).fingerprint()
    assert fp != HybridConfig(seed=1).fingerprint()
