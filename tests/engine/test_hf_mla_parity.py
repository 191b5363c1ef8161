"""The MLA family against transformers' DeepSeek-V3: checkpoints its ``save_pretrained`` writes
load through ``load_model`` (the ``deepseek_v3`` config read as ``MLAConfig``) and give
transformers' logits and the same greedy tokens through the cache (fresh and from cached
pages): queries projected directly with half-split RoPE; DeepSeek-V3's query latent with
interleaved RoPE; YaRN with DeepSeek's mscale pair; and its mixture of experts. Nothing here
compares kvtier with itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.common import yarn_attention_factor, yarn_softmax_scale_factor
from kvtier.engine.families.mla import MLAModel
from kvtier.engine.families.mla_config import MOE_FIELDS, MLAConfig
from kvtier.engine.weights import load_model
from kvtier.errors import ConfigError

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip(
        f"transformers {transformers.__version__} has no DeepSeek-V3", allow_module_level=True
    )
from test_hf_parity import (  # noqa: E402  (after the skip: it imports transformers too)
    ATOL,
    DEVICE,
    NEW_TOKENS,
    PAGE,
    VOCAB,
    _hf_greedy,
    _hf_logits,
    _kv_logits,
    _prompts,
    _randomize,
    _rope,
)

SHAPES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    max_position=256,
)


YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    mscale=1.0,
    mscale_all_dim=0.7,
)
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
)
# (layers, q_lora_rank, rope_interleave, RoPE scaling, experts)
VARIANTS = {
    "direct-queries": (2, 0, False, {}, {}),
    "query-latent-interleaved": (3, 24, True, {}, {}),
    "yarn": (2, 24, True, YARN, {}),
    "experts": (3, 24, True, {}, MOE),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[object, MLAModel]:
    layers, q_lora_rank, interleave, scaling, experts = VARIANTS[request.param]
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        num_attention_heads=SHAPES["num_heads"],
        num_key_value_heads=SHAPES["num_heads"],
        hidden_size=SHAPES["hidden_size"],
        intermediate_size=SHAPES["intermediate_size"],
        q_lora_rank=q_lora_rank or None,
        kv_lora_rank=SHAPES["kv_lora_rank"],
        qk_nope_head_dim=SHAPES["qk_nope_head_dim"],
        qk_rope_head_dim=SHAPES["qk_rope_head_dim"],
        v_head_dim=SHAPES["v_head_dim"],
        rope_interleave=interleave,
        **(experts or {"first_k_dense_replace": layers}),  # no experts: every MLP dense
        max_position_embeddings=SHAPES["max_position"],
        rms_norm_eps=SHAPES["rms_norm_eps"],
        **_rope(1e4, **scaling),
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    _randomize(hf, seed=layers)
    gen = torch.Generator().manual_seed(layers)
    for name, buf in hf.named_buffers():  # the routers' correction biases shift the choice
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    rope: dict[str, Any] = {}
    if scaling:  # resolved as a config import resolves them
        rope = dict(
            rope_type="yarn",
            rope_factor=4.0,
            rope_original_max_position=64,
            rope_attention_factor=yarn_attention_factor(4.0, 1.0, 0.7),
            softmax_scale_factor=yarn_softmax_scale_factor(4.0, 0.7),
        )
    config = MLAConfig(
        vocab_size=VOCAB,
        num_layers=layers,
        rope_theta=1e4,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        **rope,
        **experts,
        **SHAPES,
    )
    # through the checkpoint transformers writes (per-expert tensors, as DeepSeek-V3 ships
    # them); loading is strict: every tensor has its parameter, of the same shape
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    model = load_model(directory).eval()
    assert isinstance(model, MLAModel)
    got = model.config
    if not experts:  # the config keeps transformers' default experts, none of them used
        assert not any(got.moe_layer(i) for i in range(layers))
        config = dataclasses.replace(config, **{f: getattr(got, f) for f in MOE_FIELDS})
    ignore = dict(weights_digest="", eos_token_ids=())
    assert dataclasses.replace(got, **ignore) == dataclasses.replace(config, **ignore)
    return hf, model


def test_mla_logits_equal_deepseek_v3(pair) -> None:
    hf, model = pair
    for tokens in _prompts(1):
        torch.testing.assert_close(
            _kv_logits(model, tokens), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4
        )


def test_mla_greedy_tokens_through_the_cache_equal_deepseek_v3(pair) -> None:
    hf, model = pair
    prompts = _prompts(2)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model, CacheConfig(device=DEVICE, page_size=PAGE, device_pages=128)) as llm:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy), strict=True):
            assert out.output_ids == _hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)
        shared = prompts[-1][:96] + [3, 1, 4, 1, 5, 9, 2]
        (again,) = llm.generate([shared], greedy)
        assert again.cached_tokens == 96, again
        assert again.output_ids == _hf_greedy(hf, shared, NEW_TOKENS)
        llm.cache.check_integrity()


def test_the_query_options_are_what_transformers_reads(pair) -> None:
    hf, model = pair
    c = model.config
    assert (hf.config.q_lora_rank or 0, hf.config.rope_interleave) == (
        c.q_lora_rank,
        c.rope_interleave,
    )
    # the options change the model: the other RoPE layout gives other logits
    other = MLAModel(dataclasses.replace(c, rope_interleave=not c.rope_interleave)).eval()
    other.load_state_dict(model.state_dict())
    tokens = _prompts(3)[-1]
    assert not torch.allclose(_kv_logits(other, tokens), _hf_logits(hf, tokens), atol=1e-2)
    if c.rope_type == "yarn":  # each YaRN piece binds: without it the logits are others
        for plain in (
            dict(rope_type="default", rope_attention_factor=1.0),
            dict(softmax_scale_factor=1.0),
            dict(rope_attention_factor=1.0),
        ):
            unscaled = MLAModel(dataclasses.replace(c, **plain)).eval()
            unscaled.load_state_dict(model.state_dict())
            got = _kv_logits(unscaled, tokens)
            assert not torch.allclose(got, _hf_logits(hf, tokens), atol=1e-3), plain


def test_new_options_keep_earlier_digests_and_are_checked() -> None:
    assert MLAConfig().fingerprint() == "69dc1beff24058a4bc75b0abc6dd07b9"
    assert MLAConfig(q_lora_rank=8).fingerprint() != MLAConfig().fingerprint()
    with pytest.raises(ConfigError, match=r"MLAConfig\.q_lora_rank must be an integer >= 0"):
        MLAConfig(q_lora_rank=-1)
    with pytest.raises(ConfigError, match=r"MLAConfig\.rope_interleave must be True or False"):
        MLAConfig(rope_interleave=1)
