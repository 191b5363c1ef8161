"""``read_hf_config`` reads config.json as transformers 4.x and 5.x write it, and refuses
what the engine would run wrong, naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import ModelConfig
from kvtier.engine.families import preset
from kvtier.engine.families.mla_config import MLAConfig
from kvtier.engine.hf_config import read_hf_config
from kvtier.errors import ConfigError

BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _read(tmp_path: Path, **fields: Any) -> ModelConfig:
    hf = {**BASE, **fields}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != ...}))
    return read_hf_config(tmp_path, dense_only=True)


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    cfg = _read(tmp_path, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
    assert (cfg.rope_theta, cfg.rope_type) == (1e6, "default")
    cfg = _read(tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3})
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (5e5, "llama3", 8.0)
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (1.0, 4.0)
    assert cfg.rope_original_max_position == 8192


def test_transformers4_rope_theta_and_scaling(tmp_path: Path) -> None:
    assert _read(tmp_path, rope_theta=1e6, rope_scaling=None).rope_theta == 1e6
    assert _read(tmp_path).rope_theta == 10000.0
    for key in ("type", "rope_type"):
        cfg = _read(tmp_path, rope_theta=5e5, rope_scaling={key: "llama3", **LLAMA3})
        assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (5e5, "llama3", 8.0)
    cfg = _read(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 2.0)
    # no original_max_position_embeddings: transformers takes max_position_embeddings
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = _read(
        tmp_path, max_position_embeddings=4096, rope_scaling={"rope_type": "llama3", **scaling}
    )
    assert cfg.rope_original_max_position == 4096
    # rope_scaling wins over rope_parameters, as in transformers 5
    cfg = _read(
        tmp_path,
        rope_scaling={"rope_type": "linear", "factor": 3.0},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 3.0)


def test_yarn_fields_as_transformers_5_resolves_them(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0}
    cfg = _read(tmp_path, max_position_embeddings=4096, rope_parameters=yarn)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position) == ("yarn", 4.0, 4096)
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_truncate) == (32.0, 1.0, True)
    assert cfg.rope_attention_factor == 0.1 * math.log(4.0) + 1.0
    # factor as given, not max_position / original (transformers 5 warns and does the same)
    cfg = _read(
        tmp_path,
        max_position_embeddings=40960,
        rope_scaling={**yarn, "original_max_position_embeddings": 32768, "beta_fast": 0},
    )
    assert (cfg.rope_factor, cfg.rope_original_max_position, cfg.rope_beta_fast) == (
        4.0,
        32768,
        32.0,
    )
    cfg = _read(tmp_path, rope_scaling={**yarn, "attention_factor": 1.5, "truncate": False})
    assert (cfg.rope_attention_factor, cfg.rope_truncate) == (1.5, False)
    cfg = _read(tmp_path, rope_scaling={**yarn, "mscale": 1.0, "mscale_all_dim": 0.5})
    want = (0.1 * math.log(4.0) + 1.0) / (0.05 * math.log(4.0) + 1.0)
    assert cfg.rope_attention_factor == pytest.approx(want, rel=1e-15)
    # a config written back reads the same
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert dataclasses.replace(read_hf_config(tmp_path, dense_only=True), weights_digest="") == (
        dataclasses.replace(cfg, weights_digest="")
    )


@pytest.mark.parametrize(
    "fields, pattern",
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            r"rope_scaling\.rope_type='dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            r"rope_parameters\.rope_type='dynamic'",
        ),
        ({"rope_scaling": {"rope_type": "yarn"}}, r"rope_scaling\.'factor'.*missing"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}},
            r"rope_scaling\.truncate='no' must be true or false",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": "1"}},
            r"rope_parameters\.attention_factor='1' must be a number",
        ),
        ({"rope_scaling": {"type": "longrope"}}, r"rope_scaling\.rope_type='longrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling\.'factor'.*missing"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"low_freq_factor"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}, r"rope_theta.*disagree"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5"),
        ({"rope_scaling": {"type": "linear", "rope_type": "llama3"}}, r"type='linear'.*disagree"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"rope_parameters"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"mlp_bias": True}, r"mlp_bias"),
        ({"attention_bias": True}, r"attention_bias"),
        ({"model_type": "qwen3", "attention_bias": True}, r"attention_bias"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantization_config"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
            r"use_sliding_window",
        ),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            r"use_sliding_window",
        ),
        (
            {"model_type": "qwen2", "layer_types": ["full_attention", "chunked_attention"]},
            r"layer_types",
        ),
        ({"head_dim": 33}, r"head_dim=33 must be even"),
    ],
)
def test_refusals_name_the_field(tmp_path: Path, fields: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        _read(tmp_path, **fields)
    assert "config.json" in str(e.value)


def test_family_defaults_and_accepted_fields(tmp_path: Path) -> None:
    # Qwen3 without head_dim uses transformers' 128; Llama's null head_dim is hidden // heads
    assert _read(tmp_path, model_type="qwen3").head_dim == 128
    assert _read(tmp_path, head_dim=None).head_dim == 16
    assert _read(tmp_path, head_dim=40).head_dim == 40
    cfg = _read(
        tmp_path, model_type="qwen2", num_attention_heads=32, head_dim=8, num_key_value_heads=...
    )
    assert cfg.num_kv_heads == 32 and cfg.attention_bias and cfg.max_position == 32768
    assert _read(tmp_path, num_key_value_heads=...).num_kv_heads == 4
    assert _read(tmp_path).max_position == 2048
    # settings that change nothing here are accepted
    cfg = _read(
        tmp_path,
        model_type="qwen2",
        hidden_act="swish",
        use_sliding_window=True,
        sliding_window=4096,
        max_window_layers=28,
        attention_bias=False,  # transformers' Qwen2 has q/k/v biases whatever this says
        dtype="bfloat16",
        pretraining_tp=2,
        eos_token_id=[5, 7],
    )
    assert cfg.attention_bias and cfg.dtype == "bfloat16" and cfg.eos_token_ids == (5, 7)
    assert _read(tmp_path, use_sliding_window=True, max_window_layers=0).model_type == "llama"
    assert _read(tmp_path, model_type="qwen3", use_sliding_window=True, sliding_window=None).qk_norm


def test_fingerprints_of_presets_are_unchanged() -> None:
    # pinned: L3 objects written before RoPE scaling existed stay readable. The hybrid's moved
    # (from 72c613b0...) when its mixer took Mamba's time-step projection (``dt_rank``): the
    # states an older mixer wrote are another model's and must not be read
    pinned = {
        "tiny": "ec91a9e65be5cf51edb79b49fe13d343",
        "small": "3024ad3ead69cea644664c3810446102",
        "mla": "69dc1beff24058a4bc75b0abc6dd07b9",
        "hybrid": "45b878df537253d41b60ad61d1cba208",
        "swa": "ff80c768a08574c7804f7bb23763b802",
    }
    assert {name: preset(name).fingerprint() for name in pinned} == pinned


def test_rope_scaling_enters_the_fingerprint() -> None:
    base = ModelConfig(rope_type="llama3", rope_factor=8.0)
    variants = [
        ModelConfig(),
        ModelConfig(rope_type="linear", rope_factor=8.0),
        dataclasses.replace(base, rope_factor=4.0),
        dataclasses.replace(base, rope_low_freq_factor=2.0),
        dataclasses.replace(base, rope_high_freq_factor=8.0),
        dataclasses.replace(base, rope_original_max_position=4096),
    ]
    prints = {v.fingerprint() for v in [base, *variants]}
    assert len(prints) == len(variants) + 1


def test_to_hf_round_trip_keeps_rope_scaling(tmp_path: Path) -> None:
    cfg = ModelConfig(
        rope_theta=5e5, rope_type="llama3", rope_factor=8.0, rope_original_max_position=64
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert read_hf_config(tmp_path, dense_only=True) == cfg
    linear = ModelConfig(rope_type="linear", rope_factor=2.0)
    (tmp_path / "config.json").write_text(json.dumps(linear.to_hf()))
    assert read_hf_config(tmp_path, dense_only=True) == linear
    with pytest.raises(ConfigError, match="rope_type='ntk'"):
        ModelConfig(rope_type="ntk")
    with pytest.raises(ConfigError, match="rope_low_freq_factor"):
        ModelConfig(rope_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)


DEEPSEEK: dict[str, Any] = {
    **BASE,
    "model_type": "deepseek_v3",
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}


@pytest.mark.parametrize(
    "fields, pattern",
    [
        ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
        ({"topk_method": "greedy"}, r"topk_method='greedy' is not supported"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        ({"tie_word_embeddings": True}, r"tie_word_embeddings=true is not supported"),
        ({"rope_interleave": "yes"}, r"rope_interleave='yes' must be true or false"),
        ({"n_group": 3}, r"n_routed_experts=4 must split into n_group=3 groups"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, n_routed_experts=4\]"),
        ({"attention_bias": True}, r"attention_bias=true for deepseek_v3"),
    ],
)
def test_deepseek_v3_refusals_name_the_field(
    tmp_path: Path, fields: dict[str, Any], pattern: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK, **fields}))
    with pytest.raises(ConfigError, match=pattern) as e:
        read_hf_config(tmp_path)
    assert "config.json" in str(e.value)


def test_deepseek_v3_reads_as_mla_and_not_as_dense(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = {**DEEPSEEK, "rope_scaling": {**yarn, "original_max_position_embeddings": 4096}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = read_hf_config(tmp_path)
    assert isinstance(cfg, MLAConfig) and cfg.variant == "mla"
    assert (cfg.q_lora_rank, cfg.rope_interleave, cfg.n_routed_experts) == (0, True, 4)
    assert (cfg.first_k_dense_replace, cfg.routed_scaling_factor) == (3, 2.5)  # the defaults
    # DeepSeek-V3's own YaRN: the tables unscaled (mscale over mscale_all_dim), the softmax
    # scaled by (0.1 ln 40 + 1)^2
    assert cfg.rope_attention_factor == 1.0
    assert cfg.softmax_scale_factor == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)
    with pytest.raises(ConfigError, match=r"deepseek_v3 is an MLA model"):
        read_hf_config(tmp_path, dense_only=True)
