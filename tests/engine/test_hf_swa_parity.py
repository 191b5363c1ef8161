"""Sliding-window checkpoints against HF transformers: Mistral, Ministral, and Qwen2/Qwen3 with
``use_sliding_window``, saved by transformers' own ``save_pretrained``, load as the sliding-window
family and give transformers' logits and greedy tokens (also through the cache's window pool);
sliding-window models kvtier writes load in transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams, load_model, save_hf_checkpoint
from kvtier.engine.families import build_model
from kvtier.engine.families.swa import SWAModel
from kvtier.engine.families.swa_config import SWAConfig
from kvtier.engine.hf_config import read_hf_config
from kvtier.errors import ConfigError

transformers = pytest.importorskip("transformers")
from test_hf_parity import (  # noqa: E402  (after the skip: it imports transformers too)
    ATOL,
    DEVICE,
    NEW_TOKENS,
    PAGE,
    SHAPES,
    VOCAB,
    _hf_greedy,
    _hf_logits,
    _kv_logits,
    _prompts,
    _randomize,
    _rope,
)

WINDOW = 8
# case -> (transformers config class, its fields, the layers that slide)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "mistral": ("MistralConfig", {**SHAPES, **_rope(1e4), "sliding_window": WINDOW}, (0, 1)),
    "ministral": (
        "MinistralConfig",
        {
            **SHAPES,
            **_rope(1e4),
            "num_hidden_layers": 3,
            "head_dim": 16,  # transformers' Ministral needs it spelled out
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        (0, 2),
    ),
    "qwen2-max-window-layers": (
        "Qwen2Config",
        {
            **SHAPES,
            **_rope(1e6),
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
        (1, 2),
    ),
    "qwen3-layer-types": (
        "Qwen3Config",
        {
            **SHAPES,
            **_rope(1e6),
            "head_dim": 24,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        (1,),
    ),
}


def _transformers_has(cls_name: str) -> bool:
    return hasattr(transformers, cls_name)


@pytest.fixture(scope="module", params=list(CASES))
def swa_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    cls_name, kw, sliding = CASES[request.param]
    if not _transformers_has(cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kw))
    hf = hf.float().eval()
    _randomize(hf, seed=len(request.param))
    hf.save_pretrained(directory)
    return request.param, directory, hf, sliding


def _flat(model: SWAModel) -> SWAModel:
    """The same model with every sliding layer's rows in the anchor pool (one pool, so that
    ``_kv_logits`` can run it); the math is the window model's."""
    flat = build_model(dataclasses.replace(model.config, window_pool=False))
    flat.load_state_dict(model.state_dict())
    return flat


def test_transformers_swa_checkpoint_logits_and_tokens(swa_checkpoint) -> None:
    case, directory, hf, sliding = swa_checkpoint
    model = load_model(directory)
    assert isinstance(model, SWAModel)
    cfg = model.config
    assert (cfg.sliding_window, cfg.swa_layers) == (WINDOW, sliding)
    assert cfg.windowed == (len(sliding) < cfg.num_layers)
    assert cfg.weights_digest
    flat = _flat(model)
    for tokens in _prompts(1):
        torch.testing.assert_close(
            _kv_logits(flat, tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4
        )
    # the window binds at these lengths: without it the logits are another model's
    dense = CausalLM(cfg.dense())
    dense.load_state_dict(model.state_dict())
    assert not torch.allclose(_kv_logits(dense, tokens), _hf_logits(hf, tokens), atol=1e-2)

    prompts = _prompts(2)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(directory, CacheConfig(device=DEVICE, page_size=PAGE, device_pages=128)) as llm:
        outs = llm.generate(prompts, greedy)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.output_ids == _hf_greedy(hf, prompt, NEW_TOKENS), (case, len(prompt))
        # a request sharing the 100-token prompt's first 96 tokens reuses its cached pages
        shared = prompts[-1][:96] + [3, 1, 4, 1, 5, 9, 2]
        (again,) = llm.generate([shared], greedy)
        assert again.cached_tokens == 96, again
        assert again.output_ids == _hf_greedy(hf, shared, NEW_TOKENS)
        llm.cache.check_integrity()


KV_VARIANTS: dict[str, tuple[SWAConfig, str]] = {
    "every-layer": (SWAConfig(vocab_size=VOCAB, sliding_window=6, full_every=0, seed=1), "mistral"),
    "alternating": (SWAConfig(vocab_size=VOCAB, sliding_window=6, seed=2), "ministral"),
    "qwen2": (
        SWAConfig(
            vocab_size=VOCAB,
            sliding_window=5,
            attention_bias=True,
            tie_word_embeddings=True,
            seed=3,
        ),
        "qwen2",
    ),
    "qwen3-layer-types": (
        SWAConfig(
            vocab_size=VOCAB,
            num_layers=3,
            sliding_window=7,
            qk_norm=True,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
            seed=4,
        ),
        "qwen3",
    ),
}


@pytest.mark.parametrize("variant", list(KV_VARIANTS))
def test_kvtier_swa_checkpoint_loads_in_transformers(variant: str, tmp_path: Path) -> None:
    config, model_type = KV_VARIANTS[variant]
    if model_type == "ministral" and not _transformers_has("MinistralConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Ministral")
    model = build_model(config)
    save_hf_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    flat = _flat(model)
    for tokens in _prompts(4):
        torch.testing.assert_close(
            _kv_logits(flat, tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4
        )
    back = load_model(tmp_path)
    assert back.config.swa_layers == config.swa_layers
    assert back.config.fingerprint() != config.fingerprint()  # the weights digest
    same = dict(weights_digest="", seed=0, layer_types=(), full_every=2)
    assert dataclasses.replace(back.config, **same) == dataclasses.replace(config, **same)


def test_the_new_options_keep_earlier_digests() -> None:
    # configs that do not use the checkpoint options keep the digests their L3 objects have
    assert SWAConfig().fingerprint() == "ff80c768a08574c7804f7bb23763b802"
    window9 = SWAConfig(full_every=0, sliding_window=9)
    assert window9.fingerprint() == "6da3f19640d9f25ddee8e7fefca3c242"
    # the same layers named by layer_types are another config: no sharing, never a wrong one
    assert SWAConfig(layer_types=("sliding_attention",) * 4, sliding_window=9).swa_layers == (
        window9.swa_layers
    )


BASE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _write(tmp_path: Path, **fields: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return tmp_path


@pytest.mark.parametrize(
    "fields, layers",
    [
        ({"model_type": "mistral", "sliding_window": 16}, (0, 1)),
        # transformers' default window (4096) in a longer context
        ({"model_type": "mistral", "max_position_embeddings": 8192}, (0, 1)),
        # transformers' Mistral slides every layer whatever layer_types says
        (
            {"model_type": "mistral", "sliding_window": 16, "layer_types": ["full_attention"] * 2},
            (0, 1),
        ),
        ({"model_type": "ministral", "sliding_window": 16}, (0, 1)),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 1,
            },
            (1,),
        ),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            (0,),
        ),
    ],
)
def test_sliding_configs_read_as_the_window_family(
    tmp_path: Path, fields: dict[str, Any], layers: tuple[int, ...]
) -> None:
    cfg = read_hf_config(_write(tmp_path, **fields))
    assert isinstance(cfg, SWAConfig) and cfg.swa_layers == layers
    with pytest.raises(ConfigError, match=r"config\.json: sliding_window=\d+ makes layers"):
        read_hf_config(tmp_path, dense_only=True)


@pytest.mark.parametrize(
    "fields",
    [
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 256},  # the whole context: binds nowhere
        {"model_type": "ministral", "sliding_window": 16, "layer_types": ["full_attention"] * 2},
        {"model_type": "qwen2", "sliding_window": 16, "layer_types": ["sliding_attention"] * 2},
        {
            "model_type": "qwen3",
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 2,
        },
        {"model_type": "llama", "use_sliding_window": True, "sliding_window": 4},
    ],
)
def test_windows_that_bind_nowhere_read_as_dense(tmp_path: Path, fields: dict[str, Any]) -> None:
    cfg = read_hf_config(_write(tmp_path, **fields))
    assert type(cfg) is ModelConfig
    assert read_hf_config(tmp_path, dense_only=True) == cfg


@pytest.mark.parametrize(
    "fields, pattern",
    [
        ({"model_type": "mistral", "sliding_window": 0}, r"sliding_window=0 must be positive"),
        (
            {"model_type": "mistral", "sliding_window": "8"},
            r"sliding_window='8' must be an integer",
        ),
        (
            {"model_type": "ministral", "layer_types": ["sliding_attention"]},
            r"layer_types=.* one type per layer \(num_hidden_layers=2\)",
        ),
        (
            {"model_type": "ministral", "layer_types": ["sliding_attention", "chunked"]},
            r"layer_types \['chunked'\] are not supported",
        ),
    ],
)
def test_bad_window_fields_are_named(tmp_path: Path, fields: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        read_hf_config(_write(tmp_path, **fields))
    assert "config.json" in str(e.value)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"layer_types": ("sliding_attention",)}, r"SWAConfig\.layer_types=.*num_layers=4"),
        ({"layer_types": ["sliding_attention"] * 4}, r"must be a tuple"),
        ({"layer_types": ("sliding",) * 4}, r"SWAConfig\.layer_types holds 'sliding'"),
    ],
)
def test_swa_config_layer_types_are_checked(overrides: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        SWAConfig(**overrides)
