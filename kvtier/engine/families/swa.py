"""Sliding-window attention family: a GQA decoder whose sliding layers attend only to the last
``sliding_window`` positions while the remaining layers attend to the whole context.

The cache still keeps every token's K/V in every layer (one anchor pool), so prefix hits,
eviction and restores work exactly as for the dense model; the sliding layers just read fewer
slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvtier.engine.common import ConfigBase
from kvtier.engine.config import ModelConfig, dense_config_of
from kvtier.engine.model import Attention, CausalLM, SeqSlots


@dataclass(frozen=True)
class SWAConfig(ConfigBase):
    """A GQA decoder mixing sliding-window and full-attention layers."""

    family: ClassVar[str] = "swa"

    num_kv_heads: int = 2
    """Key/value heads; ``num_heads`` must be a multiple of it (GQA)."""
    head_dim: int = 32
    """Per-head width of q, k and v (even, for RoPE)."""
    sliding_window: int = 48
    """Positions a sliding layer sees: the query at ``p`` attends to ``(p - window, p]``."""
    full_every: int = 2
    """Every ``full_every``-th layer (layers ``full_every - 1``, ``2 * full_every - 1``, ...)
    attends to the whole context; the others slide. ``0`` makes every layer slide."""

    def __post_init__(self) -> None:
        self._check_sizes("seed", "full_every")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int):
            raise self._error(f"full_every must be an integer, got {self.full_every!r}")
        if self.full_every < 0:
            raise self._error(f"full_every={self.full_every} must be >= 0")
        self.dense()  # validates the fields shared with the dense decoder

    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers, ascending."""
        if self.full_every == 0:
            return tuple(range(self.num_layers))
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.full_every)

    def dense(self) -> ModelConfig:
        """The dense Llama config with the same shapes and seed (hence the same weights)."""
        return dense_config_of(self)


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
    n, heads, d = q.shape
    kv_heads = k_ctx.shape[1]
    qg = q.view(n, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("nkgd,ckd->kgnc", qg, k_ctx) * (1.0 / math.sqrt(d))
    k_pos = torch.arange(ctx_start, ctx_start + k_ctx.shape[0], device=q.device)[None, :]
    visible = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return torch.einsum("kgnc,ckd->nkgd", probs.to(v_ctx.dtype), v_ctx).reshape(n, heads, d)


class WindowAttention(Attention):
    """``Attention`` (same parameters) that reads only the slots inside the window."""

    def __init__(self, cfg: ModelConfig, window: int) -> None:
        super().__init__(cfg)
        self.window = window

    def attend(
        self, q: torch.Tensor, q_pos: torch.Tensor, s: SeqSlots, kv: torch.Tensor
    ) -> torch.Tensor:
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
            windowed = WindowAttention(dense, config.sliding_window)
            windowed.load_state_dict(layer.self_attn.state_dict())
            layer.self_attn = windowed

    stateful = False
    """Attention-only: no recurrent state, no checkpoints."""

    supports_cp = False
    """Window attention reads a trailing slice of the local rows, not yet sharded (context
    parallelism)."""
