"""Multi-head latent attention (DeepSeek-V2/V3: queries projected directly or through a query
latent, RoPE over half-split or interleaved dims) and two sparse variants with a lightning
indexer (DeepSeek-V3.2 style, simplified; ``indexer.py``), all reading their context from
kvtier's pool set.

Per token and layer the anchor pool holds one compressed row ``[c_kv ; k_rope]``; attention
decompresses per-head keys and values from it. The sparse variants add a sidecar the indexer
scores against: one index key per token (``dsa``) or one compressed row per group of
``index_page_size * index_kpool`` tokens (``dsa-compressed``). The family's config and
presets are in ``mla_config.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kvtier.engine import cp
from kvtier.engine.batch import ForwardBatch, KVBuffers, SeqSlots
from kvtier.engine.families.indexer import Indexer
from kvtier.engine.families.mla_config import MLAConfig
from kvtier.engine.families.moe import MoE
from kvtier.engine.model import DecoderLayer, DecoderLM
from kvtier.engine.ops import RMSNorm, linear, rope
from kvtier.pools import PoolSpec

SIDECAR_NAMES = {"dsa": "index_k", "dsa-compressed": "index_rows"}


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        dt, h = cfg.torch_dtype, cfg.hidden_size
        self.cfg = cfg
        q_width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = linear(h, cfg.q_lora_rank, False, dt)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt)
            self.q_b_proj = linear(cfg.q_lora_rank, q_width, False, dt)
        else:
            self.q_proj = linear(h, q_width, False, dt)
        self.kv_a_proj_with_mqa = linear(h, cfg.latent_dim, False, dt)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dt)
        self.kv_b_proj = linear(
            cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dt
        )
        self.o_proj = linear(cfg.num_heads * cfg.v_head_dim, h, False, dt)
        self.indexer = Indexer(cfg) if cfg.variant != "mla" else None
        self._inv_freq = cfg.rope_inv_freq_of(cfg.qk_rope_head_dim)
        """Kept off the module's buffers so checkpoints and dtype casts never see it."""

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The anchor rows ``[T, kv_lora_rank + qk_rope_head_dim]``: normalised ``c_kv`` and the
        RoPE-rotated shared key part."""
        c = self.cfg
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        k_pe = self._rope(k_pe[:, None, :], positions)[:, 0]
        return torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE over the last dim of ``x`` (``[T, heads, qk_rope_head_dim]``); interleaved
        pairs ``(x0, x1), (x2, x3), ...`` first become halves ``(x0, x2, ...), (x1, x3, ...)``."""
        c = self.cfg
        if c.rope_interleave:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        return rope(x, positions, c.rope_theta, self._inv_freq, c.rope_attention_factor)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T, heads, qk_nope_head_dim + qk_rope_head_dim]``, the RoPE part rotated."""
        c = self.cfg
        lora = c.q_lora_rank > 0
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if lora else self.q_proj(x)
        q = q.view(x.shape[0], c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_pe = self._rope(q[..., c.qk_nope_head_dim :], positions)
        return torch.cat((q[..., : c.qk_nope_head_dim], q_pe), dim=-1)

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
        scores = scores * (
            c.softmax_scale_factor / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        )
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
        q = self.queries(x, positions)
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
        layers = [DecoderLayer(config, MLAAttention(config)) for _ in range(config.num_layers)]
        for i, layer in enumerate(layers):
            if config.moe_layer(i):
                layer.mlp = MoE(config)
        super().__init__(config, layers)

    def pool_specs(self) -> list[PoolSpec]:
        """The anchor (one latent row per token), then the indexer's sidecar if any."""
        c = self.config
        # A page codec may hold the latent rows: one scale per latent block, the RoPE part's
        # width dividing both parts so no block mixes the two.
        block = math.gcd(c.kv_lora_rank, c.qk_rope_head_dim)
        specs = [
            PoolSpec(
                "kv", c.num_layers, (c.latent_dim,), c.torch_dtype, lossy=True, scale_block=block
            )
        ]
        if c.variant != "mla":
            per_row = c.index_group if c.variant == "dsa-compressed" else 1
            name, shape = SIDECAR_NAMES[c.variant], (c.index_head_dim,)
            specs.append(PoolSpec(name, c.num_layers, shape, c.torch_dtype, "sidecar", per_row))
        return specs

    def init_stream(self, name: str) -> int:
        return 1_000_003 if ".indexer." in name else 0

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        return layer.self_attn(h, b.positions, b.seqs, b.out_locs, b.kv, i, b.out_rows, b.group)
