"""Multi-head latent attention (DeepSeek-V2 style) and two sparse variants with a lightning
indexer (DeepSeek-V3.2 style, simplified), all reading their context from kvtier's pool set.

Per token and layer the anchor pool holds one compressed row ``[c_kv ; k_rope]``; attention
decompresses per-head keys and values from it. The sparse variants add a sidecar the indexer
scores against: one index key per token (``dsa``) or one compressed row per group of
``index_page_size * index_kpool`` tokens (``dsa-compressed``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine import cp
from kvtier.engine.common import DTYPES, ConfigBase
from kvtier.engine.model import (
    DecoderLayer,
    DecoderLM,
    ForwardBatch,
    KVBuffers,
    RMSNorm,
    SeqSlots,
    linear,
)
from kvtier.engine.ops import rope
from kvtier.pools import PoolSpec

VARIANTS = ("mla", "dsa", "dsa-compressed")
SIDECAR_NAMES = {"dsa": "index_k", "dsa-compressed": "index_rows"}


@dataclass(frozen=True)
class MLAConfig(ConfigBase):
    """A decoder with multi-head latent attention, optionally sparse through an indexer."""

    family: ClassVar[str] = "mla"

    num_layers: int = 3
    """Decoder layers (each holds one layer in every pool)."""

    kv_lora_rank: int = 32
    """Width of the normalised KV latent ``c_kv`` stored per token."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width without RoPE (keys decompressed from ``c_kv``)."""
    qk_rope_head_dim: int = 8
    """Per-head query width with RoPE; the RoPE key part is shared by all heads and stored."""
    v_head_dim: int = 16
    """Per-head value width (decompressed from ``c_kv``)."""
    variant: str = "mla"
    """``mla`` (dense latent attention), ``dsa`` (per-token indexer keys, top-k tokens) or
    ``dsa-compressed`` (one indexer row per token group, top-k groups)."""
    index_n_heads: int = 2
    """Indexer query heads (``dsa`` variants)."""
    index_head_dim: int = 16
    """Width of an indexer key, query head and compressed row (``dsa`` variants)."""
    index_topk: int = 32
    """Tokens each query attends to, its own included (``dsa``)."""
    index_page_size: int = 16
    """With ``index_kpool``, sets the group size ``G = index_page_size * index_kpool``
    (``dsa-compressed``)."""
    index_kpool: int = 2
    """Index pages pooled into one compressed row (``dsa-compressed``)."""
    index_topk_groups: int = 4
    """Earlier complete groups each query attends to besides its own (``dsa-compressed``)."""

    def __post_init__(self) -> None:
        self._check_sizes("seed")
        self._check_even("qk_rope_head_dim", "index_head_dim")
        self._check_choice("dtype", DTYPES)
        self._check_choice("variant", VARIANTS)
        for opt in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, opt) > 0:
                raise self._error(f"{opt} must be positive, got {getattr(self, opt)!r}")
        self._check_eos()

    @property
    def latent_dim(self) -> int:
        """Width of one anchor row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_group(self) -> int:
        """Tokens per compressed index row (``dsa-compressed``)."""
        return self.index_page_size * self.index_kpool


def mla_preset(**overrides: Any) -> MLAConfig:
    """Dense multi-head latent attention."""
    return MLAConfig(**{"variant": "mla", **overrides})


def dsa_preset(**overrides: Any) -> MLAConfig:
    """MLA with per-token indexer keys; top-24 tokens, so prompts of a few hundred are sparse."""
    return MLAConfig(**{"variant": "dsa", "index_topk": 24, **overrides})


def dsa_compressed_preset(**overrides: Any) -> MLAConfig:
    """MLA with one indexer row per 32-token group; each query sees 3 earlier groups + its own."""
    base = {"variant": "dsa-compressed", "index_page_size": 16, "index_kpool": 2}
    return MLAConfig(**{**base, "index_topk_groups": 3, **overrides})


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


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        dt, h = cfg.torch_dtype, cfg.hidden_size
        self.cfg = cfg
        self.q_proj = linear(
            h, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), False, dt
        )
        self.kv_a_proj_with_mqa = linear(h, cfg.latent_dim, False, dt)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dt)
        self.kv_b_proj = linear(
            cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dt
        )
        self.o_proj = linear(cfg.num_heads * cfg.v_head_dim, h, False, dt)
        self.indexer = Indexer(cfg) if cfg.variant != "mla" else None

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The anchor rows ``[T, kv_lora_rank + qk_rope_head_dim]``: normalised ``c_kv`` and the
        RoPE-rotated shared key part."""
        c = self.cfg
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        k_pe = rope(k_pe[:, None, :], positions, c.rope_theta)[:, 0]
        return torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)

    def _scores(self, q: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``[heads, n, C]`` (float32 or wider) of ``n`` queries over ``C`` latent rows,
        and the rows' decompressed values ``[C, heads, v_head_dim]``."""
        c, ctx = self.cfg, latents.shape[0]
        c_kv, k_pe = latents.to(q.dtype).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(c_kv).view(ctx, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        scores = torch.einsum("nhd,chd->hnc", q_nope, k_nope)
        scores = scores + torch.einsum("nhd,cd->hnc", q_pe, k_pe)
        scores = scores / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        return scores.to(torch.promote_types(scores.dtype, torch.float32)), v

    def attend(self, q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``n`` queries ``[n, heads, nope + rope]`` (RoPE applied) over ``C`` latent rows where
        ``mask`` (``[n, C]``) allows; returns ``[n, heads * v_head_dim]``."""
        scores, v = self._scores(q, latents)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hnc,chd->nhd", probs.to(v.dtype), v).reshape(q.shape[0], -1)

    def attend_partial(
        self, q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` over this rank's latent rows only (CP): ``(out [n, heads,
        v_head_dim], lse [n, heads])``, ``lse`` float32, ``-inf`` (``out`` 0) for a query
        with no allowed local row."""
        scores, v = self._scores(q, latents)
        probs, lse = cp.softmax_partial(scores, mask)
        return torch.einsum("hnc,chd->nhd", probs.to(v.dtype), v), lse.transpose(0, 1).float()

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        out_locs: torch.Tensor,
        kv: KVBuffers,
        layer: int,
        out_rows: torch.Tensor | None = None,
        group: cp.Group | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' rows (only ``out_rows`` of them when given) and attend; with
        a CP ``group`` each sequence's partial over this rank's rows is merged over it."""
        c, t = self.cfg, x.shape[0]
        anchor = kv.layer(layer, "kv")
        latent = self.latent(x, positions)
        if out_rows is not None:
            latent = latent.index_select(0, out_rows)
        anchor.index_copy_(0, out_locs, latent.to(anchor.dtype))
        side = None
        if self.indexer is not None:
            side = kv.layer(layer, SIDECAR_NAMES[c.variant])
            self.indexer.write(x, positions, seqs, out_locs, anchor, side, out_rows)
        q = self.q_proj(x).view(t, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_pe = rope(q[..., c.qk_nope_head_dim :], positions, c.rope_theta)
        q = torch.cat((q[..., : c.qk_nope_head_dim], q_pe), dim=-1)
        outs, lses, start = [], [], 0
        for s in seqs:
            end = start + s.num_new
            q_pos = positions[start:end]
            if self.indexer is not None and side is not None:
                mask = self.indexer.select(x[start:end], q_pos, s, side, group)
            elif group is not None:
                mask = cp.local_visible(s, q_pos)
            else:
                cols = torch.arange(s.ctx_locs.shape[0], device=x.device)
                mask = cols[None, :] <= q_pos[:, None]
            latents = anchor.index_select(0, s.ctx_locs)
            if group is None:
                outs.append(self.attend(q[start:end], latents, mask))
            else:  # this rank's partial, merged below
                o, lse = self.attend_partial(q[start:end], latents, mask)
                outs.append(o)
                lses.append(lse)
            start = end
        if group is None:
            return self.o_proj(torch.cat(outs))
        merged = cp.merge_partials(group, torch.cat(outs), torch.cat(lses))[0]
        return self.o_proj(merged.reshape(t, -1))


class MLAModel(DecoderLM):
    """MLA decoder (``variant`` picks dense, token-sparse or group-sparse attention).

    Weights start deterministic-random from ``config.seed``; the indexer's come from a stream of
    their own, so ``mla`` and ``dsa`` models of one seed share every other weight.

    Each layer first writes the new tokens' latent rows (and indexer sidecar rows) into the
    pool set, then reads every sequence's context back from it by slot, so a restored cache
    gives the same result. ``dsa-compressed`` needs each group of ``G`` tokens in ``G``
    consecutive, ``G``-aligned slots (pages a multiple of ``G`` guarantee it).
    """

    config_class = MLAConfig

    def __init__(self, config: MLAConfig) -> None:
        layers = (DecoderLayer(config, MLAAttention(config)) for _ in range(config.num_layers))
        super().__init__(config, layers)

    def pool_specs(self) -> list[PoolSpec]:
        """The anchor (one latent row per token), then the indexer's sidecar if any."""
        c = self.config
        specs = [PoolSpec("kv", c.num_layers, (c.latent_dim,), c.torch_dtype)]
        if c.variant != "mla":
            per_row = c.index_group if c.variant == "dsa-compressed" else 1
            name, shape = SIDECAR_NAMES[c.variant], (c.index_head_dim,)
            specs.append(PoolSpec(name, c.num_layers, shape, c.torch_dtype, "sidecar", per_row))
        return specs

    def init_stream(self, name: str) -> int:
        return 1_000_003 if ".indexer." in name else 0

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        return layer.self_attn(h, b.positions, b.seqs, b.out_locs, b.kv, i, b.out_rows, b.group)
