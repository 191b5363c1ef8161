"""Sliding-window attention family: a GQA decoder whose sliding layers attend only to the last
``sliding_window`` positions while the remaining layers attend to the whole context.

Its pool set is the anchor ``kv`` (the full-attention layers) and a *window* pool ``swa`` (the
sliding layers, ``PoolSpec(kind="window")``): a page keeps sliding-layer rows only while a
query's window may read them, so a running request holds ``sliding_window`` positions of them
whatever its context length. With ``window_pool=False`` (or when every layer slides, or none
does) every layer's K/V stays in the anchor pool for every token. The family's config and
preset are in ``swa_config.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.attention import decode_attention, expand_heads
from kvtier.engine.batch import ForwardBatch, SeqSlots
from kvtier.engine.families.swa_config import SWAConfig
from kvtier.engine.model import Attention, CausalLM
from kvtier.engine.model_config import ModelConfig
from kvtier.errors import RequestError
from kvtier.pools import PoolSpec


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
            return [PoolSpec("kv", c.num_layers, row, c.torch_dtype, lossy=True)]
        # Window rows stay exact under a page codec: only the full-attention anchor is lossy.
        return [
            PoolSpec("kv", len(c.full_layers), row, c.torch_dtype, lossy=True),
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
