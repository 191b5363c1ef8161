"""Dense model configuration for the reference engine: presets, HF ``config.json`` import, and
the dense blocks other families are built from. Fingerprint and validation helpers live in
``kvtier.engine.common``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.engine.common import DTYPES, ConfigBase
from kvtier.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig(ConfigBase):
    """A Llama/Qwen-style dense GQA decoder."""

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
    """Digest of a checkpoint's weight files (names and sizes); empty for random weights."""

    def __post_init__(self) -> None:
        self._check_sizes("seed")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        self._check_even("head_dim")
        self._check_choice("dtype", DTYPES)
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("ModelConfig.rope_theta and rms_norm_eps must be positive")
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

    @classmethod
    def from_hf(cls, path: str | Path, dtype: str | None = None) -> ModelConfig:
        """Read a HF checkpoint directory's ``config.json`` (or the file itself).

        Supports ``llama``, ``qwen2`` and ``qwen3``; anything else, and options this engine
        would silently get wrong (rope scaling, sliding windows, non-SiLU MLPs), raise
        ``ConfigError``. ``dtype`` overrides the checkpoint's ``torch_dtype``.
        """
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        try:
            hf = json.loads(cfg_file.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {cfg_file}") from e
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{cfg_file}: model_type={model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported(hf, model_type, cfg_file)
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hf_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            dtype=dtype or str(hf_dtype),
            eos_token_ids=eos_ids,
            weights_digest=_weights_digest(cfg_file.parent),
        )

    def to_hf(self) -> dict[str, Any]:
        """A HF ``config.json`` dict describing this architecture."""
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
        if self.model_type != "qwen2":
            hf["attention_bias"] = False
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids)
        return hf


def _reject_unsupported(hf: dict[str, Any], model_type: str, where: Path) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported (only silu)")
    if hf.get("rope_scaling"):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']!r} is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ConfigError(
            f"{where}: attention_bias=true for {model_type} (biases on q/k/v/o) is not supported"
        )


def _weights_digest(directory: Path) -> str:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return ""
    blob = "\n".join(f"{f.name}:{f.stat().st_size}" for f in files)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


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
