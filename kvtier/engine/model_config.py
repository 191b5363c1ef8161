"""Dense model configuration for the reference engine: presets, HF ``config.json`` export (the
import lives in ``kvtier.engine.hf_config``), and the dense blocks other families are built
from. Fingerprint and validation helpers live in ``kvtier.engine.common``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvtier.engine.common import DTYPES, ConfigBase, rope_inv_freq
from kvtier.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
"""HF's names of a layer's attention (``layer_types``): whole context, or a sliding window."""
ROPE_DEFAULTS: dict[str, Any] = {
    "rope_type": "default",
    "rope_factor": 1.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position": 8192,
    "rope_beta_fast": 32.0,
    "rope_beta_slow": 1.0,
    "rope_truncate": True,
    "rope_attention_factor": 1.0,
}
"""The RoPE fields and their defaults: left out of digests at these values (they came after
digests were in use)."""


@dataclass(frozen=True)
class RopeConfig(ConfigBase):
    """RoPE as checkpoints describe it (HF's ``rope_parameters``): the base of the families
    whose attention rotates queries and keys by position."""

    rope_type: str = "default"
    """RoPE frequency scaling, as HF's ``rope_type``: ``default`` (none), ``linear`` (every
    frequency divided by ``rope_factor``), ``llama3`` (Llama 3.1's banded scaling) or ``yarn``
    (YaRN: a ramp between interpolated and kept dims, and scaled RoPE tables)."""
    rope_factor: float = 1.0
    """Scaling factor of ``linear``, ``llama3`` and ``yarn`` RoPE."""
    rope_low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``rope_original_max_position / rope_low_freq_factor`` are
    divided by ``rope_factor``."""
    rope_high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``rope_original_max_position / rope_high_freq_factor`` are
    kept; those between the two bands are blended."""
    rope_original_max_position: int = 8192
    """``llama3``, ``yarn``: the context length the model was pretrained at."""
    rope_beta_fast: float = 32.0
    """``yarn``: dims turning more than this many times over the pretraining context keep their
    frequency."""
    rope_beta_slow: float = 1.0
    """``yarn``: dims turning fewer than this many times are divided by ``rope_factor``."""
    rope_truncate: bool = True
    """``yarn``: the ramp's ends are rounded to whole dims."""
    rope_attention_factor: float = 1.0
    """Scale of the RoPE tables (so of every query and key): ``yarn``'s attention factor,
    resolved when a config is read; ``1.0`` for the other types."""

    def _check_rope(self) -> None:
        self._check_choice("rope_type", ROPE_TYPES)
        for opt in ("rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor"):
            if not getattr(self, opt) > 0:
                raise self._error(f"{opt}={getattr(self, opt)} must be positive")
        if self.rope_type == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise self._error(
                f"rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                f"{self.rope_high_freq_factor} must satisfy 0 < low < high"
            )
        if self.rope_type != "yarn" and self.rope_attention_factor != 1.0:
            raise self._error(
                f"rope_attention_factor={self.rope_attention_factor} applies to yarn RoPE only"
            )
        if not isinstance(self.rope_truncate, bool):
            raise self._error(f"rope_truncate must be True or False, got {self.rope_truncate!r}")

    def rope_inv_freq_of(self, dim: int) -> torch.Tensor:
        """RoPE's float32 inverse frequencies over ``dim`` rotated dims (``[dim // 2]``, CPU)."""
        return rope_inv_freq(
            dim,
            self.rope_theta,
            self.rope_type,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_position,
            self.rope_beta_fast,
            self.rope_beta_slow,
            self.rope_truncate,
        )


@dataclass(frozen=True)
class DenseBlockConfig(RopeConfig):
    """The GQA attention and SwiGLU MLP blocks of the dense decoder, as checkpoints describe
    them: the base of ``ModelConfig`` and of the families built from the same blocks (their
    ``dense()`` config carries these fields over)."""

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

    def _check_dense(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise self._error(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        self._check_even("head_dim")
        self._check_choice("dtype", DTYPES)
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise self._error("rope_theta and rms_norm_eps must be positive")
        self._check_rope()

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's float32 inverse frequencies for this config (``[head_dim // 2]``, CPU)."""
        return self.rope_inv_freq_of(self.head_dim)


@dataclass(frozen=True)
class ModelConfig(DenseBlockConfig):
    """A Llama/Qwen-style dense GQA decoder."""

    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset({*ROPE_DEFAULTS, "mtp_layers"})

    mtp_layers: int = 0
    """Decoder layers of the multi-token-prediction draft head (``kvtier.engine.mtp``, built by
    ``build_model``), its K/V in the ``draft_kv`` sidecar; ``0``: no draft head."""

    def __post_init__(self) -> None:
        self._check_sizes("seed", "mtp_layers")
        m = self.mtp_layers
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise self._error(f"mtp_layers must be an integer >= 0, got {self.mtp_layers!r}")
        self._check_dense()
        self._check_eos()

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
            if self.rope_type in ("llama3", "yarn"):
                scaling["original_max_position_embeddings"] = self.rope_original_max_position
            if self.rope_type == "llama3":
                scaling["low_freq_factor"] = self.rope_low_freq_factor
                scaling["high_freq_factor"] = self.rope_high_freq_factor
            if self.rope_type == "yarn":
                scaling["beta_fast"] = self.rope_beta_fast
                scaling["beta_slow"] = self.rope_beta_slow
                scaling["attention_factor"] = self.rope_attention_factor
                if not self.rope_truncate:
                    scaling["truncate"] = False
            hf["rope_scaling"] = scaling
        if self.model_type != "qwen2":
            hf["attention_bias"] = False
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids)
        return hf


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
