from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import CausalLM, CheckpointError, ModelConfig, SeqSlots, save_hf_checkpoint
from kvtier.engine.hf_config import read_hf_config
from kvtier.engine.weights import load_model, load_tokenizer
from kvtier.errors import ConfigError
from kvtier.pools import DevicePool

PAGE = 4


def make_pool(model: CausalLM, pages: int = 64) -> DevicePool:
    return DevicePool([model.kv_pool_spec()], pages, PAGE, torch.device("cpu"))


def dense_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """All-position logits from a plain causal forward that never touches a pool."""
    c, m = model.config, model.model
    ids = torch.tensor(tokens)
    pos = torch.arange(len(tokens))
    x = m.embed_tokens(ids)
    with torch.no_grad():
        for layer in m.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(-1, c.num_heads, c.head_dim)
            k = a.k_proj(h).view(-1, c.num_kv_heads, c.head_dim)
            v = a.v_proj(h).view(-1, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = _rope_complex(q, pos, c.rope_theta), _rope_complex(k, pos, c.rope_theta)
            g = c.num_heads // c.num_kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )
            x = x + a.o_proj(o.transpose(0, 1).reshape(len(tokens), -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return F.linear(m.norm(x), model.head_weight()).float()


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # Independent formulation: rotate (x[i], x[i + d/2]) pairs as complex numbers.
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None] * inv)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def prefill(model: CausalLM, pool: DevicePool, tokens: list[int], locs: torch.Tensor, **kw):
    n = len(tokens)
    seq = SeqSlots(n, locs[:n], locs[:n])
    return model(torch.tensor(tokens), torch.arange(n), [seq], pool, **kw)


def greedy_paged(model: CausalLM, prompt: list[int], steps: int) -> list[int]:
    pool = make_pool(model)
    # scattered, non-contiguous pages: attention must follow the slots, not assume order
    locs = pool.locs(torch.randperm(64, generator=torch.Generator().manual_seed(1))[:32])
    toks = list(prompt)
    logits = prefill(model, pool, toks, locs)
    for _ in range(steps):
        toks.append(int(logits[0].argmax()))
        n = len(toks)
        seq = SeqSlots(1, locs[n - 1 : n], locs[:n])
        logits = model(torch.tensor(toks[-1:]), torch.tensor([n - 1]), [seq], pool)
    return toks[len(prompt) :]


def greedy_recompute(model: CausalLM, prompt: list[int], steps: int) -> list[int]:
    toks = list(prompt)
    for _ in range(steps):
        toks.append(int(dense_logits(model, toks)[-1].argmax()))
    return toks[len(prompt) :]


VARIANTS = {
    "llama": ModelConfig(),
    "qwen2": ModelConfig(attention_bias=True, tie_word_embeddings=True, seed=3),
    "qwen3": ModelConfig(qk_norm=True, head_dim=48, num_kv_heads=1, seed=5),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_attention_matches_dense(variant: str) -> None:
    model = CausalLM(VARIANTS[variant])
    tokens = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    pool = make_pool(model)
    locs = pool.locs(torch.tensor([9, 2, 30, 4, 17, 8, 11, 5, 40, 41]))
    paged = prefill(model, pool, tokens, locs, all_logits=True)
    assert torch.allclose(paged, dense_logits(model, tokens), atol=1e-4, rtol=1e-4)
    last = prefill(model, make_pool(model), tokens, locs)
    assert torch.allclose(last[0], paged[-1], atol=1e-5)


def test_kv_lands_in_pool_slots() -> None:
    model = CausalLM(ModelConfig(num_layers=2))
    pool = make_pool(model)
    locs = pool.locs(torch.tensor([5, 1]))
    prefill(model, pool, [1, 2, 3, 4, 5, 6], locs)
    written = locs[:6]
    for layer in range(2):
        buf = pool.layer(layer)
        assert buf.shape == (64 * PAGE, 2, 2, 32)
        assert bool(buf[written].abs().sum(dim=(1, 2, 3)).gt(0).all())
        untouched = torch.ones(buf.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert not bool(buf[untouched].any())


def test_incremental_decode_equals_recompute() -> None:
    model = CausalLM(ModelConfig(num_layers=2))
    prompt = [7, 300, 12, 99, 5]
    out = greedy_paged(model, prompt, 24)
    assert out == greedy_recompute(model, prompt, 24)
    assert len(set(out)) > 5, "random weights should not collapse to one repeated token"


def test_batch_composition_is_reproducible_and_per_sequence() -> None:
    model = CausalLM(ModelConfig(num_layers=2))
    pool = make_pool(model)
    a, b = [3, 4, 5, 6, 7], [100, 200, 300]
    la, lb = pool.locs(torch.tensor([0, 1])), pool.locs(torch.tensor([2]))
    seqs = [SeqSlots(5, la[:5], la[:5]), SeqSlots(3, lb[:3], lb[:3])]
    ids, pos = torch.tensor(a + b), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    first = model(ids, pos, seqs, pool)
    again = model(ids, pos, seqs, pool)
    assert torch.equal(first, again)
    alone = prefill(model, make_pool(model), b, lb)
    assert torch.allclose(first[1], alone[0], atol=1e-5)


def test_random_weights_are_seeded() -> None:
    a, b = CausalLM(ModelConfig(seed=1)), CausalLM(ModelConfig(seed=1))
    c = CausalLM(ModelConfig(seed=2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert ModelConfig(seed=1).fingerprint() == ModelConfig(seed=1).fingerprint()
    assert ModelConfig(seed=1).fingerprint() != ModelConfig(seed=2).fingerprint()
    assert len(ModelConfig().fingerprint()) == 32


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_pool_dtype_follows_model(dtype: str) -> None:
    model = CausalLM(ModelConfig(num_layers=1, dtype=dtype))
    pool = make_pool(model, pages=8)
    assert pool.layer(0).dtype == getattr(torch, dtype)
    logits = prefill(model, pool, [1, 2, 3], pool.locs(torch.tensor([0])))
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_roundtrip(variant: str, tmp_path: Path) -> None:
    model = CausalLM(VARIANTS[variant])
    save_hf_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == variant
    loaded = load_model(tmp_path)
    assert loaded.config.qk_norm == model.config.qk_norm
    assert loaded.config.attention_bias == model.config.attention_bias
    assert loaded.config.fingerprint() != model.config.fingerprint()  # weights digest differs
    tokens = [1, 5, 9, 200, 3, 4, 77]
    locs = torch.arange(2 * PAGE)
    want = prefill(model, make_pool(model), tokens, locs, all_logits=True)
    got = prefill(loaded, make_pool(loaded), tokens, locs, all_logits=True)
    assert torch.equal(want, got)
    assert load_tokenizer(tmp_path) is None


def test_sharded_checkpoint_roundtrip(tmp_path: Path) -> None:
    model = CausalLM(ModelConfig(num_layers=2, seed=9))
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    loaded = load_model(tmp_path)
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p, p2)


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_checkpoint_errors_name_the_tensor(tmp_path: Path) -> None:
    cfg = ModelConfig(num_layers=1)
    sd = {n: p.clone() for n, p in CausalLM(cfg).named_parameters()}
    missing = dict(sd)
    del missing["model.layers.0.mlp.up_proj.weight"]
    _write(tmp_path, missing, cfg)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(tmp_path)
    _write(tmp_path, {**sd, "model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}, cfg)
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*q_proj\.bias"):
        load_model(tmp_path)
    bad = {**sd, "model.norm.weight": torch.ones(64)}
    _write(tmp_path, bad, cfg)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(64,\).*\(128,\)"):
        load_model(tmp_path)


def test_hf_config_mapping_and_rejections(tmp_path: Path) -> None:
    hf = {
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 40,
        "max_position_embeddings": 2048,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": 7,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = read_hf_config(tmp_path, dense_only=True)
    assert (cfg.head_dim, cfg.qk_norm, cfg.attention_bias, cfg.dtype) == (
        40,
        True,
        False,
        "bfloat16",
    )
    assert (cfg.max_position, cfg.eos_token_ids, cfg.tie_word_embeddings) == (2048, (7,), True)
    assert math.isclose(cfg.rope_theta, 1e6)
    assert read_hf_config(tmp_path, "float32", dense_only=True).dtype == "float32"
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "qwen2"}))
    assert read_hf_config(tmp_path, dense_only=True).attention_bias
    for bad, pattern in [
        ({"model_type": "mixtral"}, "model_type='mixtral' is not supported"),
        ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**hf, **bad}))
        with pytest.raises(ConfigError, match=pattern):
            read_hf_config(tmp_path, dense_only=True)


def test_model_config_validation() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig(dtype="int8")
    with pytest.raises(ConfigError, match="preset"):
        ModelConfig.preset("huge")
    assert ModelConfig.preset("tiny") == ModelConfig()
