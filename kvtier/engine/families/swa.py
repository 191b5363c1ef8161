"""Sliding-window attention family: a GQA decoder whose sliding layers attend only to the last
``sliding_window`` positions while the remaining layers attend to the whole context.

Its pool set is the anchor ``kv`` (the full-attention layers) and a *window* pool ``swa`` (the
sliding layers, ``PoolSpec(kind="window")``): a page keeps sliding-layer rows only while a
query's window may read them, so a running request holds ``sliding_window`` positions of them
whatever its context length. With ``window_pool=False`` (or when every layer slides, or none
does) every layer's K/V stays in the anchor pool for every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.attention import decode_attention, expand_heads
from kvtier.engine.config import (
    LAYER_TYPES,
    ROPE_DEFAULTS,
    DenseBlockConfig,
    ModelConfig,
    dense_config_of,
)
from kvtier.engine.model import Attention, CausalLM, ForwardBatch, SeqSlots
from kvtier.errors import RequestError
from kvtier.pools import PoolSpec

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


def window_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    q_pos: torch.Tensor,
    ctx_start: int,
    window: int,
) -> torch.Tensor:
    """Causal sliding-window GQA attention of one sequence.

    ``q`` is ``[n, heads, d]`` at positions ``q_pos``; ``k_ctx``/``v_ctx`` are
    ``[C, kv_heads, d]`` holding positions ``ctx_start .. ctx_start + C - 1``. The query at
    ``p`` sees context positions in ``(p - window, p]``.
    """
    n, heads, _ = q.shape
    k_pos = torch.arange(ctx_start, ctx_start + k_ctx.shape[0], device=q.device)[None, :]
    visible = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
    if n == 1:
        return decode_attention(q, k_ctx[None], v_ctx[None], visible)
    k_ctx, v_ctx = k_ctx.to(q.dtype), v_ctx.to(q.dtype)
    qh = q.transpose(0, 1)[None]
    kh, vh = expand_heads(k_ctx, heads)[None], expand_heads(v_ctx, heads)[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible)
    return out[0].transpose(0, 1)


class WindowAttention(Attention):
    """``Attention`` (same parameters) that reads only the slots inside the window."""

    def __init__(self, cfg: ModelConfig, window: int, pooled: bool = False) -> None:
        super().__init__(cfg)
        self.window = window
        self.pooled = pooled
        """``kv`` is the window pool's layer, addressed by ``SeqSlots.window_locs``."""

    def attend_all(
        self, q: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqSlots], kv: torch.Tensor
    ) -> torch.Tensor:
        """Each sequence over its window (:meth:`attend`)."""
        return self.attend_each(q, positions, seqs, kv)

    def attend(
        self, q: torch.Tensor, q_pos: torch.Tensor, s: SeqSlots, kv: torch.Tensor
    ) -> torch.Tensor:
        if self.pooled:
            if s.window_locs is None:
                raise RequestError("a window-pool layer needs SeqSlots.window_locs")
            ctx = kv.index_select(0, s.window_locs)
            return window_attention(q, ctx[:, 0], ctx[:, 1], q_pos, s.window_start, self.window)
        # first new position from host-side lengths, so no device sync is needed
        first = s.ctx_locs.shape[0] - s.num_new
        lo = max(0, first - self.window + 1)
        ctx = kv.index_select(0, s.ctx_locs[lo:])
        return window_attention(q, ctx[:, 0], ctx[:, 1], q_pos, lo, self.window)


class SWAModel(CausalLM):
    """Dense decoder whose ``config.swa_layers`` use sliding-window attention.

    Weights equal those of ``CausalLM(config.dense())`` (same names, same seed), so with a
    window covering the whole context both models give the same logits. The forward contract
    is ``CausalLM.forward``'s; ``config`` is the ``SWAConfig``.
    """

    config_class = SWAConfig

    def __init__(self, config: SWAConfig) -> None:
        dense = config.dense()
        super().__init__(dense)
        self.config = config  # type: ignore[assignment]
        for i in config.swa_layers:
            layer = self.model.layers[i]
            windowed = WindowAttention(dense, config.sliding_window, config.windowed)
            windowed.load_state_dict(layer.self_attn.state_dict())
            layer.self_attn = windowed
        full, swa = config.full_layers, config.swa_layers
        self.pool_layer = [
            (("swa", swa.index(i)) if i in swa else ("kv", full.index(i)))
            if config.windowed
            else ("kv", i)
            for i in range(config.num_layers)
        ]
        """Per layer: the component holding its K/V and its layer there."""

    def pool_specs(self) -> list[PoolSpec]:
        """The anchor ``kv`` (full-attention layers) and the window pool ``swa`` (sliding
        layers); one anchor of every layer when ``not config.windowed``."""
        c = self.config
        row = (2, c.num_kv_heads, c.head_dim)
        if not c.windowed:
            return [PoolSpec("kv", c.num_layers, row, c.torch_dtype)]
        return [
            PoolSpec("kv", len(c.full_layers), row, c.torch_dtype),
            PoolSpec(
                "swa", len(c.swa_layers), row, c.torch_dtype, kind="window", window=c.sliding_window
            ),
        ]

    def anchor_layers(self) -> list[int]:
        """The layers reading the anchor pool: the full-attention ones under a window pool."""
        return [i for i, (name, _) in enumerate(self.pool_layer) if name == "kv"]

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        name, j = self.pool_layer[i]
        if name == "kv":
            return layer.self_attn(
                h, b.positions, b.seqs, b.out_locs, b.kv.layer(j), b.out_rows, b.group
            )
        if b.window_out is None:
            raise RequestError("a window-pool forward needs SeqSlots.window_locs")
        return layer.self_attn(h, b.positions, b.seqs, b.window_out, b.kv.layer(j, "swa"))

    stateful = False
    """Attention-only: no recurrent state, no checkpoints."""

    supports_cp = False
    """Window attention reads a trailing slice of the local rows, not yet sharded (context
    parallelism)."""
