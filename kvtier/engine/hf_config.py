"""HF ``config.json`` import for the reference engine: the dense decoders (``llama``,
``qwen2``, ``qwen3``, ``mistral`` and ``ministral`` without a binding window), their
sliding-window variants (``mistral``, ``ministral``, ``qwen2``/``qwen3`` with
``use_sliding_window``) and DeepSeek-V3's latent attention with experts (``deepseek_v3``), as
transformers 4.x and 5.x write them. What the engine would run wrong raises ``ConfigError``
naming the file and field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvtier.engine.common import (
    DTYPES,
    weights_digest,
    yarn_attention_factor,
    yarn_softmax_scale_factor,
)
from kvtier.engine.families.mla_config import MLAConfig
from kvtier.engine.families.swa_config import SWAConfig
from kvtier.engine.model_config import LAYER_TYPES, ROPE_TYPES, ModelConfig
from kvtier.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "deepseek_v3")


def read_hf_config(
    path: str | Path, dtype: str | None = None, dense_only: bool = False
) -> ModelConfig | SWAConfig | MLAConfig:
    """The engine config of a HF checkpoint directory's ``config.json`` (or the file itself).

    ``deepseek_v3`` gives an ``MLAConfig`` (latent attention, DeepSeek-V3's experts).
    Layers that slide as transformers runs them (a ``sliding_window`` shorter than
    ``max_position_embeddings``, on the layers ``layer_types`` or ``max_window_layers`` name)
    give an ``SWAConfig``; otherwise a ``ModelConfig``. Absent fields take the family's
    transformers default. ``dtype`` overrides the checkpoint's ``torch_dtype``/``dtype``.
    ``dense_only``: a sliding config raises ``ConfigError`` instead. The weights digest is
    computed last, once the config is known to be valid (a large checkpoint takes a while).
    """
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    hf = _read_json(cfg_file)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{cfg_file}: model_type={model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _reject_unsupported(hf, model_type, cfg_file)
    r = _Reader(hf, cfg_file)
    mla = model_type == "deepseek_v3"
    window: int | None = None
    layer_types: tuple[str, ...] = ()
    if mla:
        fields = _mla_fields(r, dtype)
    else:
        fields = _dense_fields(r, model_type, dtype)
        window, layer_types = _sliding(r, model_type, fields["num_layers"], fields["max_position"])
    config: ModelConfig | SWAConfig | MLAConfig
    try:
        if mla and dense_only:
            raise ConfigError("deepseek_v3 is an MLA model, not a dense one")
        if mla:
            config = MLAConfig(**fields)
        elif window is None:
            config = ModelConfig(**fields)
        elif dense_only:
            raise ConfigError(
                f"sliding_window={window} makes layers {_sliding_indices(layer_types)} slide"
                f"{' (use_sliding_window=true)' if 'use_sliding_window' in hf else ''}: not a "
                "dense model; kvtier.engine.load_model reads it as the sliding-window family"
            )
        else:
            config = SWAConfig(**fields, sliding_window=window, layer_types=layer_types)
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    return dataclasses.replace(config, weights_digest=weights_digest(cfg_file.parent))


def _mla_fields(r: _Reader, dtype: str | None) -> dict[str, Any]:
    """The ``MLAConfig`` fields of a ``deepseek_v3`` config; absent fields take transformers'
    defaults. DeepSeek's YaRN also scales the softmax (``mscale_all_dim``)."""
    hf, where = r.hf, r.where
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {want!r})")
    if hf.get("moe_layer_freq", 1) not in (1, None):
        raise ConfigError(f"{where}: moe_layer_freq={hf['moe_layer_freq']!r} is not supported")
    if hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{where}: tie_word_embeddings=true is not supported for deepseek_v3")
    interleave = hf.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"{where}: rope_interleave={interleave!r} must be true or false")
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"{where}: norm_topk_prob={norm!r} must be true or false")
    fields = _common_fields(r, dtype, max_position_default=4096)
    rope = _read_rope(r, fields["max_position"])
    all_dim = _rope_params(r).float("mscale_all_dim", None)
    if rope["rope_type"] == "default":
        all_dim = None
    softmax = yarn_softmax_scale_factor(rope.get("rope_factor", 1.0), all_dim or 0.0)
    return dict(
        fields,
        **rope,
        softmax_scale_factor=softmax,
        q_lora_rank=_int_or_zero(r, "q_lora_rank", 1536),
        kv_lora_rank=r.int("kv_lora_rank", 512),
        qk_nope_head_dim=r.int("qk_nope_head_dim", 128),
        qk_rope_head_dim=r.int("qk_rope_head_dim", 64),
        v_head_dim=r.int("v_head_dim", 128),
        rope_interleave=interleave,
        n_routed_experts=_int_or_zero(r, "n_routed_experts", 256),
        num_experts_per_tok=r.int("num_experts_per_tok", 8),
        moe_intermediate_size=r.int("moe_intermediate_size", 2048),
        n_shared_experts=_int_or_zero(r, "n_shared_experts", 1),
        n_group=r.int("n_group", 8),
        topk_group=r.int("topk_group", 4),
        routed_scaling_factor=r.float("routed_scaling_factor", 2.5),
        norm_topk_prob=norm,
        first_k_dense_replace=r.int("first_k_dense_replace", 3),
    )


def _int_or_zero(r: _Reader, key: str, default: int) -> int:
    """An integer field where ``null`` means none (``0``)."""
    return 0 if r.hf.get(key, default) is None else r.int(key, default)


def _common_fields(
    r: _Reader, dtype: str | None, max_position_default: int | None
) -> dict[str, Any]:
    """The fields every family's config takes: shapes, norm epsilon, context, element type
    and stop tokens."""
    hf, cfg_file = r.hf, r.where
    heads = r.int("num_attention_heads")
    if heads < 1:
        raise ConfigError(f"{cfg_file}: num_attention_heads={heads} must be positive")
    eos = hf.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_list):
        raise ConfigError(f"{cfg_file}: eos_token_id={eos!r} must be an integer or a list")
    dtype_key = "torch_dtype" if hf.get("torch_dtype") else "dtype"
    hf_dtype = str(hf.get(dtype_key) or "float32")
    if dtype is None and hf_dtype not in DTYPES:
        raise ConfigError(f"{cfg_file}: {dtype_key}={hf_dtype!r} is not one of {', '.join(DTYPES)}")
    return dict(
        vocab_size=r.int("vocab_size"),
        hidden_size=r.int("hidden_size"),
        intermediate_size=r.int("intermediate_size"),
        num_layers=r.int("num_hidden_layers"),
        num_heads=heads,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        max_position=r.int("max_position_embeddings", max_position_default),
        dtype=dtype or hf_dtype,
        eos_token_ids=tuple(eos_list),
    )


def _dense_fields(r: _Reader, model_type: str, dtype: str | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a dense or sliding-window decoder's config."""
    hf, cfg_file = r.hf, r.where
    family = _FAMILY_DEFAULTS[model_type]
    common = _common_fields(r, dtype, family["max_position_embeddings"])
    heads, hidden = common["num_heads"], common["hidden_size"]
    kv_heads = r.int("num_key_value_heads", family["num_key_value_heads"])
    head_dim = r.int("head_dim", family["head_dim"])
    tied = hf.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ConfigError(f"{cfg_file}: tie_word_embeddings={tied!r} must be true or false")
    return dict(
        common,
        num_kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=hidden // heads if head_dim is None else head_dim,
        tie_word_embeddings=tied,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        **_read_rope(r, common["max_position"]),
    )


def _sliding(
    r: _Reader, model_type: str, num_layers: int, max_position: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(window, layer types)`` as transformers runs the config; ``(None, ())`` when no layer
    slides or the window is no shorter than the context (then it changes nothing).

    | model_type | a layer slides when |
    |---|---|
    | llama | never (transformers' Llama has no window; the fields are ignored) |
    | mistral | ``sliding_window`` is set (every layer; ``layer_types`` is ignored) |
    | ministral | ``sliding_window`` is set and ``layer_types`` (default: all) says so |
    | qwen2, qwen3 | ``use_sliding_window`` and ``sliding_window`` are set and ``layer_types``
      says so (default: the layers from ``max_window_layers`` on) |
    """
    hf, where = r.hf, r.where
    if model_type == "llama":
        return None, ()
    given = hf.get("layer_types")
    if given is not None and model_type != "mistral":
        if not isinstance(given, list) or len(given) != num_layers:
            raise ConfigError(
                f"{where}: layer_types={given!r} must list one type per layer "
                f"(num_hidden_layers={num_layers})"
            )
        unknown = sorted({str(t) for t in given} - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"{where}: layer_types {unknown} are not supported")
    qwen = model_type in ("qwen2", "qwen3")
    if hf.get("sliding_window", 4096) is None or (qwen and not hf.get("use_sliding_window")):
        return None, ()
    window = r.int("sliding_window", 4096)
    if window < 1:
        raise ConfigError(f"{where}: sliding_window={window} must be positive")
    if model_type == "mistral":
        types = ("sliding_attention",) * num_layers
    elif given is not None:
        types = tuple(given)
    elif qwen:
        first = r.int("max_window_layers", 28)
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        )
    else:
        types = ("sliding_attention",) * num_layers
    if "sliding_attention" not in types or window >= max_position:
        return None, ()
    return window, types


def _sliding_indices(layer_types: tuple[str, ...]) -> list[int]:
    return [i for i, t in enumerate(layer_types) if t == "sliding_attention"]


# transformers' defaults for fields a config.json may leave out (None: derived from others)
_FAMILY_DEFAULTS: dict[str, dict[str, int | None]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072},
    "ministral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
}
_REQUIRED = object()


class _Reader:
    """Typed field access to a parsed ``config.json`` whose errors name the file and field."""

    def __init__(self, hf: dict[str, Any], where: Path, prefix: str = "") -> None:
        self.hf, self.where, self.prefix = hf, where, prefix

    def get(self, key: str, default: Any, kind: type) -> Any:
        v = self.hf.get(key, default)
        if v is _REQUIRED:
            raise ConfigError(f"{self.where}: required field {self.prefix}{key!r} is missing")
        if v is None and default is None:
            return None
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
        if not ok or isinstance(v, bool):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{self.where}: {self.prefix}{key}={v!r} must be {what}")
        return kind(v)

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(key, default, int)

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(key, default, float)


def _read_json(cfg_file: Path) -> dict[str, Any]:
    if cfg_file.suffix == ".safetensors":
        raise ConfigError(
            f"{cfg_file} is a weights file; pass the checkpoint directory that holds it and "
            "config.json"
        )
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"no config.json at {cfg_file}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{cfg_file} is not a config.json (not UTF-8 text); pass the checkpoint directory"
        ) from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}: invalid JSON ({e})") from e
    except OSError as e:
        raise ConfigError(f"cannot read {cfg_file}: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    return hf


def _rope_params(r: _Reader) -> _Reader:
    """The RoPE parameters, as transformers 5.x picks them: ``rope_scaling`` when set, else
    ``rope_parameters`` (a reader whose errors name the one used)."""
    name = "rope_scaling" if r.hf.get("rope_scaling") else "rope_parameters"
    params = r.hf.get(name) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{r.where}: {name}={params!r} is not supported (one flat dict expected)")
    return _Reader(params, r.where, f"{name}.")


def _read_rope(r: _Reader, max_position: int) -> dict[str, Any]:
    """The ``ModelConfig`` RoPE fields of a config, as transformers 5.x resolves them:
    ``rope_scaling`` before ``rope_parameters``, a ``rope_theta`` inside them before the
    top-level one. Values 4.x would read differently (both given and different) are refused.
    ``yarn`` takes ``factor`` as given and resolves its attention factor here (given, from
    DeepSeek's ``mscale`` pair, or from ``factor``), as transformers 5 does."""
    hf, where = r.hf, r.where
    p = _rope_params(r)
    name, params = p.prefix[:-1], p.hf
    theta = p.float("rope_theta", None)
    top_theta = r.float("rope_theta", None)
    if theta is not None and top_theta is not None and theta != top_theta:
        raise ConfigError(f"{where}: {name}.rope_theta={theta} and rope_theta={top_theta} disagree")
    theta = theta if theta is not None else top_theta if top_theta is not None else 10000.0
    for where_prf, prf in ((f"{name}.", params), ("", hf)):
        if prf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(
                f"{where}: {where_prf}partial_rotary_factor={prf['partial_rotary_factor']!r} "
                "is not supported (RoPE over the whole head only)"
            )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "type" in params and params["type"] != rope_type:
        raise ConfigError(
            f"{where}: {name}.type={params['type']!r} and rope_type={rope_type!r} disagree"
        )
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: {name}.rope_type={rope_type!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
    if rope_type == "default":
        return out
    out["rope_factor"] = factor = p.float("factor")
    if rope_type == "linear":
        return out
    inner = p.int("original_max_position_embeddings", None)
    outer = r.int("original_max_position_embeddings", None)
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(
            f"{where}: {name}.original_max_position_embeddings={inner} and "
            f"original_max_position_embeddings={outer} disagree"
        )
    orig = outer if outer is not None else inner
    out["rope_original_max_position"] = max_position if orig is None else orig
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = p.float("low_freq_factor")
        out["rope_high_freq_factor"] = p.float("high_freq_factor")
        return out
    # yarn: ``factor`` as given (transformers 5); zero or absent betas take the defaults
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: {name}.truncate={truncate!r} must be true or false")
    attention = p.float("attention_factor", None)
    if attention is None:
        mscale, all_dim = p.float("mscale", None), p.float("mscale_all_dim", None)
        attention = yarn_attention_factor(factor, mscale or 0.0, all_dim or 0.0)
    out.update(
        rope_beta_fast=p.float("beta_fast", None) or 32.0,
        rope_beta_slow=p.float("beta_slow", None) or 1.0,
        rope_truncate=truncate,
        rope_attention_factor=attention,
    )
    return out


def _reject_unsupported(hf: dict[str, Any], model_type: str, where: Path) -> None:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only silu)")
    if hf.get("quantization_config"):
        raise ConfigError(
            f"{where}: quantization_config is set; quantized weights are not supported"
        )
    if hf.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true (biases on the MLP) is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ConfigError(
            f"{where}: attention_bias=true for {model_type} (biases on q/k/v/o) is not supported"
        )
