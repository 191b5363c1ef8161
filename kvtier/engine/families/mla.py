"""Multi-head latent attention (DeepSeek-V2/V3: queries projected directly or through a query
latent, RoPE over half-split or interleaved dims) and two sparse variants with a lightning
indexer (DeepSeek-V3.2 style, simplified; ``indexer.py``), all reading their context from
kvtier's pool set.

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
from torch import nn

from kvtier.engine import cp
from kvtier.engine.common import DTYPES
from kvtier.engine.config import ROPE_DEFAULTS, RopeConfig
from kvtier.engine.families.indexer import Indexer
from kvtier.engine.families.moe import MoE
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
MOE_FIELDS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "first_k_dense_replace",
)
SIDECAR_NAMES = {"dsa": "index_k", "dsa-compressed": "index_rows"}


@dataclass(frozen=True)
class MLAConfig(RopeConfig):
    """A decoder with multi-head latent attention, optionally sparse through an indexer."""

    family: ClassVar[str] = "mla"
    # options added after MLA digests were in use: at their defaults they leave them as they were
    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset(
        {
            "q_lora_rank",
            "rope_interleave",
            "softmax_scale_factor",
            "weights_digest",
            *ROPE_DEFAULTS,
            *MOE_FIELDS,
        }
    )

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
    q_lora_rank: int = 0
    """Width of the normalised query latent (DeepSeek-V3's ``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj``); ``0``: queries are projected directly (``q_proj``)."""
    weights_digest: str = ""
    """Digest of a checkpoint's weight files (``load_model``); empty for random weights."""
    softmax_scale_factor: float = 1.0
    """Multiplies the attention's softmax scale ``1 / sqrt(qk_nope_head_dim +
    qk_rope_head_dim)``: DeepSeek's YaRN ``mscale(rope_factor, mscale_all_dim) ** 2``,
    resolved when a config is read."""
    n_routed_experts: int = 0
    """Routed experts of a DeepSeek-V3 mixture-of-experts MLP (``kvtier.engine.families.moe``)
    in the layers from ``first_k_dense_replace`` on; ``0``: every layer's MLP is dense."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to."""
    moe_intermediate_size: int = 64
    """Width of each routed expert's SwiGLU (and of each shared one)."""
    n_shared_experts: int = 0
    """Experts every token also goes through (fused into one SwiGLU)."""
    n_group: int = 1
    """Expert groups; routing picks experts only from the ``topk_group`` best groups."""
    topk_group: int = 1
    """Groups routing picks from."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights."""
    norm_topk_prob: bool = True
    """Normalise each token's chosen weights to sum one (before the scaling factor)."""
    first_k_dense_replace: int = 0
    """Leading layers whose MLP stays dense."""
    rope_interleave: bool = False
    """The RoPE dims of queries and the shared key hold interleaved pairs (DeepSeek-V3's
    default): they are reordered to the half-split layout before the rotation, as transformers
    does. Only the math differs; the stored rows keep their width."""
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
        self._check_sizes(
            "seed", "q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"
        )
        for opt in ("q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"):
            v = getattr(self, opt)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise self._error(f"{opt} must be an integer >= 0, got {v!r}")
        self._check_rope()
        self._check_moe()
        if not self.softmax_scale_factor > 0:
            raise self._error(f"softmax_scale_factor={self.softmax_scale_factor} must be positive")
        if not isinstance(self.rope_interleave, bool):
            raise self._error(
                f"rope_interleave must be True or False, got {self.rope_interleave!r}"
            )
        self._check_even("qk_rope_head_dim", "index_head_dim")
        self._check_choice("dtype", DTYPES)
        self._check_choice("variant", VARIANTS)
        for opt in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, opt) > 0:
                raise self._error(f"{opt} must be positive, got {getattr(self, opt)!r}")
        self._check_eos()

    def _check_moe(self) -> None:
        e = self.n_routed_experts
        if not e:
            return
        if not 1 <= self.num_experts_per_tok <= e:
            raise self._error(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"n_routed_experts={e}]"
            )
        if e % self.n_group or e // self.n_group < 2:
            raise self._error(
                f"n_routed_experts={e} must split into n_group={self.n_group} groups of at "
                "least 2 (a group scores by its two best experts)"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise self._error(
                f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        if not self.routed_scaling_factor > 0:
            raise self._error(
                f"routed_scaling_factor={self.routed_scaling_factor} must be positive"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise self._error(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}")

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts."""
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

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
