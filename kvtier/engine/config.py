"""Dense model configuration for the reference engine: presets, HF ``config.json`` import, and
the dense blocks other families are built from. Fingerprint and validation helpers live in
``kvtier.engine.common``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvtier.engine.common import DTYPES, ConfigBase, rope_inv_freq, weights_digest
from kvtier.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_DEFAULTS: dict[str, Any] = {
    "rope_type": "default",
    "rope_factor": 1.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position": 8192,
}


@dataclass(frozen=True)
class ModelConfig(ConfigBase):
    """A Llama/Qwen-style dense GQA decoder."""

    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset({*_ROPE_DEFAULTS, "mtp_layers"})

    num_kv_heads: int = 2
    """Key/value heads; ``num_heads`` must be a multiple of it (GQA)."""
    head_dim: int = 32
    """Per-head width of q, k and v."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    attention_bias: bool = False
    """Bias on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    weights_digest: str = ""
    """Digest of a checkpoint's weight files (names, sizes and bytes); empty for random
    weights."""
    rope_type: str = "default"
    """RoPE frequency scaling, as HF's ``rope_type``: ``default`` (none), ``linear`` (every
    frequency divided by ``rope_factor``) or ``llama3`` (Llama 3.1's banded scaling)."""
    rope_factor: float = 1.0
    """Scaling factor of ``linear`` and ``llama3`` RoPE."""
    rope_low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``rope_original_max_position / rope_low_freq_factor`` are
    divided by ``rope_factor``."""
    rope_high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``rope_original_max_position / rope_high_freq_factor`` are
    kept; those between the two bands are blended."""
    rope_original_max_position: int = 8192
    """``llama3``: the context length the model was pretrained at."""
    mtp_layers: int = 0
    """Decoder layers of the multi-token-prediction draft head (``kvtier.engine.mtp``, built by
    ``build_model``), its K/V in the ``draft_kv`` sidecar; ``0``: no draft head."""

    def __post_init__(self) -> None:
        self._check_sizes("seed", "mtp_layers")
        m = self.mtp_layers
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise self._error(f"mtp_layers must be an integer >= 0, got {self.mtp_layers!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        self._check_even("head_dim")
        self._check_choice("dtype", DTYPES)
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("ModelConfig.rope_theta and rms_norm_eps must be positive")
        self._check_choice("rope_type", ROPE_TYPES)
        if not self.rope_factor > 0:
            raise self._error(f"rope_factor={self.rope_factor} must be positive")
        if self.rope_type == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise self._error(
                f"rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                f"{self.rope_high_freq_factor} must satisfy 0 < low < high"
            )
        self._check_eos()

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's float32 inverse frequencies for this config (``[head_dim // 2]``, CPU)."""
        return rope_inv_freq(
            self.head_dim,
            self.rope_theta,
            self.rope_type,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_position,
        )

    @property
    def model_type(self) -> str:
        """HF family that has exactly this architecture (used when writing ``config.json``)."""
        if self.qk_norm:
            return "qwen3"
        return "qwen2" if self.attention_bias else "llama"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """``tiny`` (the default config, fast on CPU) or ``small`` (a little closer to real)."""
        presets: dict[str, dict[str, Any]] = {
            "tiny": {},
            "small": dict(
                vocab_size=4096,
                hidden_size=512,
                intermediate_size=1408,
                num_layers=8,
                num_heads=8,
                num_kv_heads=2,
                head_dim=64,
                max_position=8192,
            ),
        }
        if name not in presets:
            raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(presets)}")
        return cls(**{**presets[name], **overrides})

    @classmethod
    def from_hf(cls, path: str | Path, dtype: str | None = None) -> ModelConfig:
        """Read a HF checkpoint directory's ``config.json`` (or the file itself).

        Supports ``llama``, ``qwen2`` and ``qwen3`` as transformers 4.x and 5.x write them
        (RoPE settings in ``rope_theta``/``rope_scaling`` or in ``rope_parameters``; absent
        fields take the family's transformers default). Anything this engine would get wrong
        (other RoPE scalings, sliding windows, non-SiLU MLPs, biases other than Qwen2's q/k/v,
        quantized weights) and missing or mistyped fields raise ``ConfigError`` naming the
        file and field. ``dtype`` overrides the checkpoint's ``torch_dtype``/``dtype``.
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
        family = _FAMILY_DEFAULTS[model_type]
        heads = r.int("num_attention_heads")
        hidden = r.int("hidden_size")
        if heads < 1:
            raise ConfigError(f"{cfg_file}: num_attention_heads={heads} must be positive")
        kv_heads = r.int("num_key_value_heads", family["num_key_value_heads"])
        head_dim = r.int("head_dim", family["head_dim"])
        max_position = r.int("max_position_embeddings", family["max_position_embeddings"])
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_list):
            raise ConfigError(f"{cfg_file}: eos_token_id={eos!r} must be an integer or a list")
        dtype_key = "torch_dtype" if hf.get("torch_dtype") else "dtype"
        hf_dtype = str(hf.get(dtype_key) or "float32")
        if dtype is None and hf_dtype not in DTYPES:
            raise ConfigError(
                f"{cfg_file}: {dtype_key}={hf_dtype!r} is not one of {', '.join(DTYPES)}"
            )
        tied = hf.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ConfigError(f"{cfg_file}: tie_word_embeddings={tied!r} must be true or false")
        fields = dict(
            vocab_size=r.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.int("intermediate_size"),
            num_layers=r.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=hidden // heads if head_dim is None else head_dim,
            rms_norm_eps=r.float("rms_norm_eps", 1e-6),
            max_position=max_position,
            tie_word_embeddings=tied,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            dtype=dtype or hf_dtype,
            eos_token_ids=tuple(eos_list),
            **_read_rope(r, max_position),
        )
        try:
            config = cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{cfg_file}: {e}") from None
        # hashed only once the config is known to be valid: a large checkpoint takes a while
        return dataclasses.replace(config, weights_digest=weights_digest(cfg_file.parent))

    def to_hf(self) -> dict[str, Any]:
        """A HF ``config.json`` dict describing this architecture, readable by transformers
        4.x and 5.x (RoPE scaling goes in ``rope_scaling``, which both read)."""
        hf: dict[str, Any] = {
            "architectures": [
                {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
                    self.model_type, "Qwen3ForCausalLM"
                )
            ],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        if self.rope_type != "default":
            scaling: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.rope_factor}
            if self.rope_type == "llama3":
                scaling["low_freq_factor"] = self.rope_low_freq_factor
                scaling["high_freq_factor"] = self.rope_high_freq_factor
                scaling["original_max_position_embeddings"] = self.rope_original_max_position
            hf["rope_scaling"] = scaling
        if self.model_type != "qwen2":
            hf["attention_bias"] = False
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids)
        return hf


# transformers' defaults for fields a config.json may leave out (None: derived from others)
_FAMILY_DEFAULTS: dict[str, dict[str, int | None]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
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


def _read_rope(r: _Reader, max_position: int) -> dict[str, Any]:
    """The ``ModelConfig`` RoPE fields of a config, as transformers 5.x resolves them:
    ``rope_scaling`` before ``rope_parameters``, a ``rope_theta`` inside them before the
    top-level one. Values 4.x would read differently (both given and different) are refused."""
    hf, where = r.hf, r.where
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(name) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: {name}={params!r} is not supported (one flat dict expected)")
    p = _Reader(params, where, f"{name}.")
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
    out["rope_factor"] = p.float("factor")
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = p.float("low_freq_factor")
        out["rope_high_freq_factor"] = p.float("high_freq_factor")
        inner = p.int("original_max_position_embeddings", None)
        outer = r.int("original_max_position_embeddings", None)
        if inner is not None and outer is not None and inner != outer:
            raise ConfigError(
                f"{where}: {name}.original_max_position_embeddings={inner} and "
                f"original_max_position_embeddings={outer} disagree"
            )
        orig = outer if outer is not None else inner
        out["rope_original_max_position"] = max_position if orig is None else orig
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
    if model_type == "llama":
        return  # transformers' Llama has no sliding window: those fields are ignored there too
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ConfigError(f"{where}: layer_types {sorted(unknown)} are not supported")
    window = hf.get("sliding_window", 4096)
    if not hf.get("use_sliding_window") or window is None:
        return
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        sliding = int(hf.get("num_hidden_layers", 0)) > first
    else:
        sliding = "sliding_attention" in layer_types
    if sliding:
        raise ConfigError(
            f"{where}: use_sliding_window=true with sliding_window={window!r} is not supported"
        )


def tiny_dense(**overrides: Any) -> ModelConfig:
    """The default dense preset (fast on CPU)."""
    return ModelConfig.preset("tiny", **overrides)


def small_dense(**overrides: Any) -> ModelConfig:
    """A somewhat larger dense preset."""
    return ModelConfig.preset("small", **overrides)


def dense_config_of(c: Any) -> ModelConfig:
    """The dense config of the fields that ``c``, another family's config, shares with
    ``ModelConfig``: the shapes and seed of the GQA attention and MLP blocks it is built from.
    Its validation errors name ``c``'s class, whose fields they are."""
    shared = {f.name for f in dataclasses.fields(ModelConfig)} & {
        f.name for f in dataclasses.fields(c)
    }
    try:
        return ModelConfig(**{name: getattr(c, name) for name in shared})
    except ConfigError as e:
        raise ConfigError(str(e).replace("ModelConfig.", f"{type(c).__name__}.")) from None
