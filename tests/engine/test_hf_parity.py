"""Two-way parity with HF transformers: checkpoints transformers writes run in kvtier with the
same greedy tokens and logits (also through the cache), and checkpoints kvtier writes load in
transformers with the same logits. Tiny float32 models on the CPU, so this runs in CI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import DEVICE

from kvtier.config import CacheConfig
from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams, SeqSlots, save_hf_checkpoint
from kvtier.engine.common import yarn_attention_factor
from kvtier.engine.hf_config import read_hf_config
from kvtier.engine.weights import load_model
from kvtier.pools import DevicePool

transformers = pytest.importorskip("transformers")
TF5 = int(transformers.__version__.split(".")[0]) >= 5

VOCAB = 256
LENGTHS = (1, 7, 33, 100)
NEW_TOKENS = 6
PAGE = 4
ATOL = 1e-4


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    """RoPE settings in the spelling the installed transformers writes."""
    if TF5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **scaling}}
    return {"rope_theta": theta, "rope_scaling": scaling or None}


def _llama3() -> dict[str, Any]:
    return dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
SHAPES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-theta1e6": ("LlamaConfig", {**SHAPES, **_rope(1e6)}),
    "llama-llama3": ("LlamaConfig", {**SHAPES, **_rope(5e5, **_llama3())}),
    "llama-linear": ("LlamaConfig", {**SHAPES, **_rope(1e4, rope_type="linear", factor=4.0)}),
    "qwen2-tied": ("Qwen2Config", {**SHAPES, **_rope(1e6), "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**SHAPES, **_rope(1e6), "head_dim": 24, "num_key_value_heads": 1}),
    # YaRN with its context factor and attention factor, and with DeepSeek's mscale pair,
    # other betas and no truncation; a pretraining context short enough that both bind here
    "qwen3-yarn": ("Qwen3Config", {**SHAPES, **_rope(1e6, **YARN), "head_dim": 24}),
    "llama-yarn-mscale": (
        "LlamaConfig",
        {
            **SHAPES,
            **_rope(1e4, **YARN, mscale=0.9, mscale_all_dim=0.7, beta_fast=16.0, truncate=False),
        },
    ),
}
ROPE_OF = {
    "llama-llama3": "llama3",
    "llama-linear": "linear",
    "qwen3-yarn": "yarn",
    "llama-yarn-mscale": "yarn",
}


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF's own init (std 0.02, unit norms, zero biases) would leave biases and norms untested
    # and logits nearly flat; every parameter gets a distinct, order-one value instead.
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.3 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)


def _save_hf(case: str, directory: Path) -> Any:
    cls_name, kw = CASES[case]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    _randomize(model, seed=len(case))
    model.save_pretrained(directory)
    return model


def _hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(_hf_logits(model, toks)[-1].argmax()))
    return toks[len(prompt) :]


def _kv_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    pages = -(-len(tokens) // PAGE)
    pool = DevicePool(model.pool_specs(), pages, PAGE, torch.device("cpu"))
    locs = pool.locs(torch.arange(pages))[: len(tokens)]
    seq = SeqSlots(len(tokens), locs, locs)
    return model(torch.tensor(tokens), torch.arange(len(tokens)), [seq], pool, all_logits=True)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=list(CASES))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, _save_hf(request.param, directory)


def test_transformers_checkpoint_logits_and_tokens(hf_checkpoint) -> None:
    case, directory, hf = hf_checkpoint
    written = json.loads((directory / "config.json").read_text())
    if TF5:  # the 5.x spelling: RoPE settings only inside rope_parameters
        assert "rope_theta" not in written and "rope_parameters" in written
    model = load_model(directory)
    cfg = model.config
    theta = hf.config.rope_parameters["rope_theta"] if TF5 else hf.config.rope_theta
    rope_type = ROPE_OF.get(case, "default")
    assert (cfg.rope_theta, cfg.rope_type) == (theta, rope_type)
    assert cfg.rope_attention_factor == getattr(hf.model.rotary_emb, "attention_scaling", 1.0)
    assert cfg.tie_word_embeddings == (case == "qwen2-tied")
    for tokens in _prompts(1):
        want = _hf_logits(hf, tokens)
        got = _kv_logits(model, tokens)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    if rope_type != "default":  # the scaling matters at these lengths: unscaled, logits differ
        plain = CausalLM(dataclasses.replace(cfg, rope_type="default", rope_attention_factor=1.0))
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(_kv_logits(plain, tokens), want, atol=1e-2)

    prompts = _prompts(2)
    wanted = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(directory, CacheConfig(device=DEVICE, page_size=PAGE, device_pages=128)) as llm:
        outs = llm.generate(prompts, greedy)
        for out, want_ids in zip(outs, wanted, strict=True):
            assert out.output_ids == want_ids
        # a second request sharing the 100-token prompt's first 96 tokens: served from cache
        shared = prompts[-1][:96] + [3, 1, 4, 1, 5, 9, 2]
        (again,) = llm.generate([shared], greedy)
        assert again.cached_tokens == 96, again
        assert again.output_ids == _hf_greedy(hf, shared, NEW_TOKENS)


def test_tied_config_with_a_distinct_head_unties_like_transformers(tmp_path: Path) -> None:
    hf = _save_hf("llama-theta1e6", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    model = load_model(tmp_path)
    assert not model.config.tie_word_embeddings and model.lm_head is not None
    tokens = _prompts(3)[2]
    torch.testing.assert_close(
        _kv_logits(model, tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4
    )
    if TF5:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float()
        torch.testing.assert_close(
            _kv_logits(model, tokens), _hf_logits(reloaded, tokens), atol=ATOL, rtol=1e-4
        )


def test_tied_checkpoint_storing_only_the_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = _save_hf("qwen2-tied", tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    model = load_model(tmp_path)
    assert model.config.tie_word_embeddings and model.lm_head is None
    tokens = _prompts(5)[2]
    want = _hf_logits(hf, tokens)
    torch.testing.assert_close(_kv_logits(model, tokens), want, atol=ATOL, rtol=1e-4)
    if TF5:  # transformers 5 fills the embeddings from the head too
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float()
        torch.testing.assert_close(_hf_logits(reloaded, tokens), want, atol=ATOL, rtol=1e-4)


KV_VARIANTS = {
    "llama": ModelConfig(vocab_size=VOCAB, rope_theta=1e6, seed=1),
    "llama3": ModelConfig(
        vocab_size=VOCAB,
        rope_theta=5e5,
        rope_type="llama3",
        rope_factor=8.0,
        rope_original_max_position=64,
        seed=2,
    ),
    "qwen2": ModelConfig(vocab_size=VOCAB, attention_bias=True, tie_word_embeddings=True, seed=3),
    "qwen3": ModelConfig(vocab_size=VOCAB, qk_norm=True, head_dim=48, num_kv_heads=1, seed=4),
    "yarn": ModelConfig(
        vocab_size=VOCAB,
        rope_type="yarn",
        rope_factor=8.0,
        rope_original_max_position=64,
        max_position=512,
        rope_beta_slow=2.0,
        rope_truncate=False,
        rope_attention_factor=yarn_attention_factor(8.0),
        seed=5,
    ),
}


@pytest.mark.parametrize("variant", list(KV_VARIANTS))
def test_kvtier_checkpoint_loads_in_transformers(variant: str, tmp_path: Path) -> None:
    model = CausalLM(KV_VARIANTS[variant])
    save_hf_checkpoint(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    for tokens in _prompts(4):
        torch.testing.assert_close(
            _kv_logits(model, tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4
        )
    back = load_model(tmp_path)
    assert back.config.fingerprint() != model.config.fingerprint()  # the weights digest
    same = dict(weights_digest="", seed=0)
    assert dataclasses.replace(back.config, **same) == dataclasses.replace(model.config, **same)


@pytest.mark.parametrize(
    "case", ["llama-llama3", "llama-linear", "llama-theta1e6", "qwen3-yarn", "llama-yarn-mscale"]
)
def test_inverse_frequencies_equal_transformers(case: str, tmp_path: Path) -> None:
    # exact equality at a realistic head size, through the config.json transformers writes
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls_name, kw = CASES[case]
    hf_cfg = getattr(transformers, cls_name)(**{**kw, "head_dim": 128})
    hf_cfg.save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path, dense_only=True)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    init = ROPE_INIT_FUNCTIONS.get(cfg.rope_type)  # 5.x keeps "default" on the module
    if init is None:
        init = LlamaRotaryEmbedding.compute_default_rope_parameters
    want, scale = init(hf_cfg, device=torch.device("cpu"))
    assert cfg.head_dim == 128
    assert torch.equal(cfg.rope_inv_freq(), want)
    assert cfg.rope_attention_factor == scale
