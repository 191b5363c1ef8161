"""Configuration of the sliding-window attention family (``kvtier.engine.families.swa``):
``SWAConfig``, which layers slide, its HF ``config.json`` export, and the family's preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.engine.model_config import (
    LAYER_TYPES,
    ROPE_DEFAULTS,
    DenseBlockConfig,
    ModelConfig,
    dense_config_of,
)

_CHECKPOINT_OPTIONS = (
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "weights_digest",
    *ROPE_DEFAULTS,
)
"""``DenseBlockConfig`` fields that came to this family with checkpoint import."""


@dataclass(frozen=True)
class SWAConfig(DenseBlockConfig):
    """A GQA decoder mixing sliding-window and full-attention layers."""

    family: ClassVar[str] = "swa"
    # Where the rows live is the cache namespace's business (its component set names the
    # window pool); the rows themselves are the same either way.
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"eos_token_ids", "window_pool"})
    # Options that came with checkpoint import: at their defaults they leave the digests of
    # earlier configs as they were.
    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset(
        {*_CHECKPOINT_OPTIONS, "layer_types"}
    )

    sliding_window: int = 48
    """Positions a sliding layer sees: the query at ``p`` attends to ``(p - window, p]``."""
    full_every: int = 2
    """Every ``full_every``-th layer (layers ``full_every - 1``, ``2 * full_every - 1``, ...)
    attends to the whole context; the others slide. ``0`` makes every layer slide."""
    window_pool: bool = True
    """Keep the sliding layers' K/V in a window pool (only the window's pages hold rows);
    ``False`` keeps every token's rows (the model's math is the same)."""
    layer_types: tuple[str, ...] = ()
    """Per layer, ``"sliding_attention"`` or ``"full_attention"`` (HF's spelling); when given
    it decides which layers slide and ``full_every`` is not used. ``()``: ``full_every``."""

    def __post_init__(self) -> None:
        self._check_sizes("seed", "full_every")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int):
            raise self._error(f"full_every must be an integer, got {self.full_every!r}")
        if self.full_every < 0:
            raise self._error(f"full_every={self.full_every} must be >= 0")
        types = self.layer_types
        if not isinstance(types, tuple) or (types and len(types) != self.num_layers):
            raise self._error(
                f"layer_types={types!r} must be a tuple of one type per layer "
                f"(num_layers={self.num_layers}) or ()"
            )
        unknown = sorted({repr(t) for t in types} - {repr(t) for t in LAYER_TYPES})
        if unknown:
            raise self._error(f"layer_types holds {', '.join(unknown)}; known: {LAYER_TYPES}")
        self.dense()  # validates the fields shared with the dense decoder

    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers, ascending."""
        if self.layer_types:
            return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")
        if self.full_every == 0:
            return tuple(range(self.num_layers))
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.full_every)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, ascending."""
        return tuple(i for i in range(self.num_layers) if i not in self.swa_layers)

    @property
    def windowed(self) -> bool:
        """Whether the sliding layers' K/V live in a window pool of their own."""
        return self.window_pool and bool(self.swa_layers) and bool(self.full_layers)

    def dense(self) -> ModelConfig:
        """The dense Llama config with the same shapes and seed (hence the same weights)."""
        return dense_config_of(self)

    def to_hf(self) -> dict[str, Any]:
        """A HF ``config.json`` dict transformers runs with the same windows: ``qwen3`` or
        ``qwen2`` (``use_sliding_window`` and ``layer_types``) where the dense decoder is one,
        else ``mistral`` when every layer slides and ``ministral`` (``layer_types``) when not."""
        hf = self.dense().to_hf()
        swa = self.swa_layers
        types = [
            "sliding_attention" if i in swa else "full_attention" for i in range(self.num_layers)
        ]
        hf["sliding_window"] = self.sliding_window
        if hf["model_type"] in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=True, max_window_layers=0, layer_types=types)
        elif len(swa) == self.num_layers:
            hf.update(model_type="mistral", architectures=["MistralForCausalLM"])
        else:
            hf.update(
                model_type="ministral", architectures=["MinistralForCausalLM"], layer_types=types
            )
        return hf


def swa_preset(**overrides: Any) -> SWAConfig:
    """The default sliding-window config (fast on CPU) with ``overrides`` applied."""
    return SWAConfig(**overrides)
