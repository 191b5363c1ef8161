"""What every model family's config shares: the common decoder fields, element types, field
validation whose errors name the concrete config class, and the fingerprint that names a model
inside kvtier's L3 key namespace."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvtier.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ConfigBase:
    """Base of the families' frozen config dataclasses: the fields every family has (the shared
    decoder pieces in ``kvtier.engine.model`` read them), element types, validation whose errors
    name the concrete class, and the fingerprint. A family adds its own fields after these and
    may redeclare one to change its default."""

    family: ClassVar[str] = ""
    """Tag hashed into the fingerprint so that two families' configs with equal field values
    do not collide. Empty for the dense config, whose digests predate the other families."""
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"eos_token_ids"})
    """Fields that change neither the pool bytes nor their meaning, so that deployments
    differing only in them (stop tokens, say) still share L3 objects."""

    vocab_size: int = 512
    """Number of token ids; valid ids are ``[0, vocab_size)``."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    num_layers: int = 4
    """Decoder layers (each holds one layer in every pool that has them)."""
    num_heads: int = 4
    """Query (attention) heads."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    max_position: int = 4096
    """Context length: prompt plus generated tokens never exceed it."""
    dtype: str = "float32"
    """Weights, activations and pool element type: ``float32``, ``bfloat16``, ``float16`` or
    ``float64``."""
    seed: int = 0
    """Seed of the deterministic random weights (ignored once a checkpoint is loaded)."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless a request sets ``ignore_eos``."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def fingerprint(self) -> str:
        """Stable hex digest of everything that determines the model's pool bytes."""
        fields: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.fingerprint_exclude
        }
        if self.family:
            fields = {"family": self.family, **fields}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    def _error(self, message: str) -> ConfigError:
        return ConfigError(f"{type(self).__name__}.{message}")

    def _check_sizes(self, *not_sizes: str) -> None:
        """Every ``int`` field except ``not_sizes`` is a size or count, hence positive."""
        for f in dataclasses.fields(self):
            if f.type not in ("int", int) or f.name in not_sizes:
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise self._error(f"{f.name} must be a positive integer, got {v!r}")

    def _check_even(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) % 2:
                raise self._error(f"{name}={getattr(self, name)} must be even for RoPE")

    def _check_choice(self, name: str, known: Iterable[str]) -> None:
        known = tuple(known)
        if getattr(self, name) not in known:
            raise self._error(f"{name}={getattr(self, name)!r} is not one of {', '.join(known)}")

    def _check_eos(self) -> None:
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise self._error(f"eos_token_ids={self.eos_token_ids} outside vocab")
