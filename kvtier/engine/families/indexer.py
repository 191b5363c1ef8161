"""The lightning indexer of the sparse MLA variants (DeepSeek-V3.2 style, simplified): it writes
the sidecar rows the cache keeps beside the latents (one key per token for ``dsa``, one
compressed row per token group for ``dsa-compressed``) and picks the context each query
attends to."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine import cp
from kvtier.engine.batch import SeqSlots
from kvtier.engine.ops import linear, rope

if TYPE_CHECKING:
    from kvtier.engine.families.mla_config import MLAConfig


def top_k_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[n, C]``: of each row's ``allowed`` entries, the ``k`` highest ``scores`` (all of
    them when fewer). Equal scores prefer the lower column, so the choice is deterministic."""
    if scores.shape[-1] <= k:
        return allowed.clone()
    masked = scores.masked_fill(~allowed, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(allowed).scatter_(1, order, True) & allowed


class Indexer(nn.Module):
    """Picks the context tokens each query attends to by scoring indexer keys (``dsa``) or
    compressed group rows (``dsa-compressed``) with ``sum_h w_h(q) * relu(q_h . key)``.

    ``dsa`` rotates index queries and keys by position (RoPE), so equal tokens at different
    positions do not tie; a group row has no single position, so its queries stay unrotated.
    """

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        dt, di = cfg.torch_dtype, cfg.index_head_dim
        self.cfg = cfg
        self.wq = linear(cfg.hidden_size, cfg.index_n_heads * di, False, dt)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads, False, dt)
        compressed = cfg.variant == "dsa-compressed"
        # compressed rows must be recomputable from the stored latents alone
        self.wk = linear(cfg.latent_dim if compressed else cfg.hidden_size, di, False, dt)
        self.compress_proj = linear(di, di, False, dt) if compressed else None

    def write(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        out_locs: torch.Tensor,
        anchor: torch.Tensor,
        side: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> None:
        """Fill the sidecar for this forward's tokens (``anchor`` already holds their latents).

        ``dsa``: one key per new token. ``dsa-compressed``: one row for every group whose last
        token is new, compressed from the group's latents as stored in ``anchor`` and written
        to sidecar row ``slot // G`` of the group's slots. Under CP only the rows of
        ``out_rows`` (``dsa``) or of the groups on this rank's pages (``dsa-compressed``: a
        group lies inside one page, so its owner holds all its latents) are written.
        """
        if self.compress_proj is None:
            keys = rope(self.wk(x)[:, None, :], positions, self.cfg.rope_theta)[:, 0]
            if out_rows is not None:
                keys = keys.index_select(0, out_rows)
            side.index_copy_(0, out_locs, keys.to(side.dtype))
            return
        g = self.cfg.index_group
        for s in seqs:
            ctx_len = s.seq_len
            first, last = (ctx_len - s.num_new) // g, ctx_len // g
            if first == last:
                continue
            slots = cp.group_slots(s, first, last, g)
            if slots.shape[0] == 0:
                continue
            latents = anchor.index_select(0, slots.reshape(-1)).view(slots.shape[0], g, -1)
            rows = self.compress_proj(self.wk(latents.to(x.dtype)).mean(dim=1))
            side.index_copy_(0, slots[:, 0] // g, rows.to(side.dtype))

    def _scores(
        self, x: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor | None
    ) -> torch.Tensor:
        c = self.cfg
        q = self.wq(x).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        if q_pos is not None:
            q = rope(q, q_pos, c.rope_theta)
        wide = torch.promote_types(x.dtype, torch.float32)
        w = self.weights_proj(x).to(wide) / math.sqrt(c.index_n_heads)
        dots = torch.einsum("nhd,cd->nhc", q, keys.to(q.dtype)).to(wide).relu()
        return torch.einsum("nh,nhc->nc", w, dots) / math.sqrt(c.index_head_dim)

    def select(
        self,
        x: torch.Tensor,
        q_pos: torch.Tensor,
        s: SeqSlots,
        side: torch.Tensor,
        group: cp.Group | None = None,
    ) -> torch.Tensor:
        """Bool ``[n, C]``: the context tokens the ``n`` queries (hidden ``x`` at ``q_pos``) of
        sequence ``s`` attend to. ``dsa``: the ``index_topk`` best of positions ``<= q_pos``,
        the query's own token always among them. ``dsa-compressed``: every token of the
        ``index_topk_groups`` best complete groups before the query's group, plus its own
        group up to ``q_pos``.

        With a CP ``group``: the choice over the whole context, the same on every rank (each
        scores its own columns, the scores are gathered), returned for this rank's columns
        ``s.ctx_cols`` only (``[n, len(ctx_locs)]``)."""
        if group is not None:
            return self._select_cp(x, q_pos, s, side, group)
        c, ctx_len = self.cfg, s.ctx_locs.shape[0]
        cols = torch.arange(ctx_len, device=x.device)
        visible = cols[None, :] <= q_pos[:, None]
        if self.compress_proj is None:
            scores = self._scores(x, side.index_select(0, s.ctx_locs), q_pos)
            scores = scores.masked_fill(cols[None, :] == q_pos[:, None], float("inf"))
            return top_k_mask(scores, visible, c.index_topk)
        g = c.index_group
        own = visible & ((cols // g)[None, :] == (q_pos // g)[:, None])
        complete = ctx_len // g
        if complete == 0:
            return own
        rows = side.index_select(0, s.ctx_locs[0 : complete * g : g] // g)
        scores = self._scores(x, rows, None)
        earlier = torch.arange(complete, device=x.device)[None, :] < (q_pos // g)[:, None]
        picked = top_k_mask(scores, earlier, c.index_topk_groups).repeat_interleave(g, dim=1)
        return F.pad(picked, (0, ctx_len - complete * g), value=False) | own

    def _select_cp(
        self,
        x: torch.Tensor,
        q_pos: torch.Tensor,
        s: SeqSlots,
        side: torch.Tensor,
        group: cp.Group,
    ) -> torch.Tensor:
        c, ctx_len, local = self.cfg, s.seq_len, cp.require_cols(s)
        cols = torch.arange(ctx_len, device=x.device)
        visible = cols[None, :] <= q_pos[:, None]
        if self.compress_proj is None:
            mine = self._scores(x, side.index_select(0, s.ctx_locs), q_pos)
            scores = cp.gather_max(group, cp.scatter_cols(mine, local, ctx_len))
            scores = scores.masked_fill(cols[None, :] == q_pos[:, None], float("inf"))
            return top_k_mask(scores, visible, c.index_topk)[:, local]
        g = c.index_group
        own = visible & ((cols // g)[None, :] == (q_pos // g)[:, None])
        complete = ctx_len // g
        if complete == 0:
            return own[:, local]
        # this rank's complete groups: those whose first token it holds
        firsts = torch.nonzero((local % g == 0) & (local < complete * g)).reshape(-1)
        rows = side.index_select(0, s.ctx_locs.index_select(0, firsts) // g)
        mine = self._scores(x, rows, None)
        scores = cp.gather_max(group, cp.scatter_cols(mine, local[firsts] // g, complete))
        earlier = torch.arange(complete, device=x.device)[None, :] < (q_pos // g)[:, None]
        picked = top_k_mask(scores, earlier, c.index_topk_groups).repeat_interleave(g, dim=1)
        return (F.pad(picked, (0, ctx_len - complete * g), value=False) | own)[:, local]
