"""A multi-token-prediction draft head on the dense model (DeepSeek-V3 style, simplified), whose
K/V are components of the target's pool set.

The head predicts the token after next. For the pair ``(h_{j-1}, x_j)`` (the target's final
hidden state of position ``j - 1`` and the token at ``j``) it computes
``eh_proj([enorm(embed(x_j)); hnorm(h_{j-1})])``, runs ``mtp_layers`` decoder layers (same
shapes as a target layer), then the shared final norm and LM head: a guess of ``x_{j+1}``
that the target only makes after processing ``x_j``. ``h_{-1}`` is zero.

Two sidecar components (one row per token slot) hold what the head needs:

==================  ================================  ==========================================
component           row at token slot ``j``           written
==================  ================================  ==========================================
``draft_kv``        the head's K/V of pair ``j``,     by every target forward for its new tokens;
                    RoPE position ``j``               speculatively by draft steps
``draft_hidden``    the target's ``h_j``              by every target forward for its new tokens
==================  ================================  ==========================================

Keying the draft row of pair ``(h_{j-1}, x_j)`` by ``x_j``'s slot makes it, like the target's
K/V at ``j``, a function of ``x_0 .. x_j`` only, so a cached page's draft rows are exactly
those a cold run computes, whoever wrote them; ``draft_hidden`` gives a prefill that resumes
after a cached prefix of ``s`` tokens the ``h_{s-1}`` its first pair needs. The cache moves
both with the anchor through every tier, so nothing here keeps bookkeeping of its own.

Which rows exist for a request with ``n = num_computed`` (``tokens[:n]`` computed):

====================================  ============  ================  ========================
after                                 ``kv``        ``draft_hidden``  ``draft_kv``
====================================  ============  ================  ========================
a target forward over ``[s, e)``      ``[0, e)``    ``[0, e)``        ``[0, e)``
``k`` draft steps from ``n``          ``[0, n)``    ``[0, n)``        ``[0, n]`` exact, then
                                                                      ``n+1 .. n+k-1`` guessed
the verify forward over ``[n, n+k]``  ``[0, n+k]``  ``[0, n+k]``      ``[0, n+k]``
====================================  ============  ================  ========================

Verification accepts ``a`` of the ``k`` drafts: ``num_computed`` becomes ``n + a + 1`` and the
rows past it, computed for rejected tokens, are rewritten before anything reads them.

Draft step ``i`` (from 0) writes the pair at slot ``n + i``; step 0's pair ``(h_{n-1}, x_n)``
is exact, later ones stand in the head's own output for the unknown target hidden (as
EAGLE/MTP drafting does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine import cp
from kvtier.engine.batch import ForwardBatch, KVBuffers, SeqSlots
from kvtier.engine.model import Attention, CausalLM, DecoderLayer
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.ops import RMSNorm, linear
from kvtier.errors import ConfigError
from kvtier.pools import PoolSpec

DRAFT_KV = "draft_kv"
"""Sidecar component of the draft head's K/V."""
DRAFT_HIDDEN = "draft_hidden"
"""Sidecar component of the target's final hidden state per token."""

DRAFT_SEED_STREAM = 7919
"""The draft's perturbations draw from ``seed + DRAFT_SEED_STREAM``: the target's weights are
those of the same config without a head."""
DRAFT_NOISE = 0.1
"""Relative std of the perturbation of the draft's copy of the target's last layer."""
HIDDEN_GAIN = 0.1
"""Weight of ``hnorm(h)`` against the embedding in the draft's input projection."""


def tiny_mtp_preset(**overrides: Any) -> ModelConfig:
    """``tiny`` with a one-layer draft head."""
    return ModelConfig.preset("tiny", **{"mtp_layers": 1, **overrides})


class DraftHead(nn.Module):
    """The draft head's own weights (embeddings, final norm and LM head are the target's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dt, h = cfg.torch_dtype, cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.eh_proj = linear(2 * h, h, False, dt)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, Attention(cfg)) for _ in range(cfg.mtp_layers)
        )


class MTPCausalLM(CausalLM):
    """The dense model with a draft head (``config.mtp_layers`` layers) for speculative
    decoding. Every forward also writes the ``draft_hidden`` and ``draft_kv`` rows of its new
    tokens (see the module's range table); ``draft_step`` runs the head alone."""

    supports_cp = True
    """Under context parallelism the draft rows of a page live with its anchor rows on the
    page's owner (the sidecars share the anchor's physical pages); the head's attention merges
    partials like the target's, and a ``draft_hidden`` row read at another token's step comes
    from its owner (``cp.owner_rows``)."""

    def __init__(self, config: ModelConfig) -> None:
        if config.mtp_layers < 1:
            raise ConfigError(f"MTPCausalLM needs mtp_layers >= 1, got {config.mtp_layers}")
        super().__init__(config)
        self.mtp = DraftHead(config)
        self.init_draft(config.seed)

    def pool_specs(self) -> list[PoolSpec]:
        c = self.config
        return [
            self.kv_pool_spec(),
            PoolSpec(
                DRAFT_KV, c.mtp_layers, (2, c.num_kv_heads, c.head_dim), c.torch_dtype, "sidecar"
            ),
            PoolSpec(DRAFT_HIDDEN, 1, (c.hidden_size,), c.torch_dtype, "sidecar"),
        ]

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        super().init_random(seed)
        if "mtp" in self._modules:  # not yet while the base class builds the target
            self.init_draft(seed)

    @torch.no_grad()
    def init_draft(self, seed: int) -> None:
        """Make the head a perturbed copy of the target's last layer whose input is mostly the
        token's embedding: a random target is dominated by its input embedding, so such a
        head often (not always) agrees with it on the next token."""
        gen = torch.Generator().manual_seed(seed + DRAFT_SEED_STREAM)
        last = dict(self.model.layers[-1].named_parameters())
        for layer in self.mtp.layers:
            for name, p in layer.named_parameters():
                src = last[name].float()
                noise = torch.randn(src.shape, generator=gen) * src.std().clamp_min(1e-3)
                p.copy_((src + DRAFT_NOISE * noise).to(p.dtype))
        h = self.config.hidden_size
        mix = torch.randn(h, h, generator=gen) / h**0.5
        eye = torch.eye(h) + DRAFT_NOISE * torch.randn(h, h, generator=gen) / h**0.5
        self.mtp.eh_proj.weight.copy_(torch.cat((eye, HIDDEN_GAIN * mix), dim=1))

    def after_layers(self, input_ids: torch.Tensor, x: torch.Tensor, b: ForwardBatch) -> None:
        hid = b.kv.layer(0, DRAFT_HIDDEN)
        firsts = [s.seq_len - s.num_new for s in b.seqs]
        # h of the token before each sequence's first new one: the cached prefix's last row
        # (on its owner's rank under CP), or zero
        befores = self.hidden_at(b.kv, b.seqs, [f - 1 for f in firsts]).to(x.dtype)
        prev = []
        start = 0
        for i, s in enumerate(b.seqs):
            prev += [befores[i : i + 1], x[start : start + s.num_new - 1]]
            start += s.num_new
        h_prev = torch.cat(prev)
        rows = x if b.out_rows is None else x.index_select(0, b.out_rows)
        hid.index_copy_(0, b.out_locs, rows.to(hid.dtype))
        self.draft_hidden_states(
            input_ids, b.positions, b.seqs, b.out_locs, b.kv, h_prev, b.out_rows, b.group
        )

    def draft_hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        out_locs: torch.Tensor,
        kv: KVBuffers,
        h_prev: torch.Tensor,
        out_rows: torch.Tensor | None = None,
        group: cp.Group | None = None,
    ) -> torch.Tensor:
        """Run the head on pairs ``(h_prev[i], input_ids[i])``, writing their ``draft_kv`` rows
        at ``out_locs`` (only ``out_rows`` of them when given: a CP rank's own); returns its
        final (pre-norm) hidden states ``[T, hidden]``. With a CP ``group`` the head's
        attention merges every rank's partial, as the target's does."""
        m = self.mtp
        e = self.model.embed_tokens(input_ids)
        x = m.eh_proj(torch.cat((m.enorm(e), m.hnorm(h_prev.to(e.dtype))), dim=-1))
        for i, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(
                h, positions, seqs, out_locs, kv.layer(i, DRAFT_KV), out_rows, group
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    @torch.inference_mode()
    def draft_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        kv: KVBuffers,
        h_prev: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft token per sequence (``seqs`` each with ``num_new == 1``): float32 logits
        ``[len(seqs), vocab]`` and the head's hidden states, the stand-in ``h_prev`` of the
        next step. Writes only ``draft_kv`` rows. When ``kv`` is a CP rank's shard, ``seqs``
        come from ``cp.seq_slots`` and every rank of the group runs the same step."""
        out_locs = torch.cat([s.out_locs for s in seqs])
        group = cp.cp_group(kv)
        out_rows = cp.batch_out_rows(seqs) if group is not None else None
        g = self.draft_hidden_states(
            input_ids, positions, seqs, out_locs, kv, h_prev, out_rows, group
        )
        return F.linear(self.model.norm(g), self.head_weight()).float(), g

    def hidden_rows(self, kv: KVBuffers, slots: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states stored at physical ``slots``."""
        return kv.layer(0, DRAFT_HIDDEN).index_select(0, slots)

    def hidden_at(
        self, kv: KVBuffers, seqs: Sequence[SeqSlots], positions: Sequence[int]
    ) -> torch.Tensor:
        """``[len(seqs), hidden]``: the target's final hidden state at ``positions[i]`` of
        ``seqs[i]`` (zero for a negative position). Under CP the row lives on its page's
        owner, which shares it with the group (``cp.owner_rows``): every rank of the group
        calls this with the same sequences and positions."""
        hid = kv.layer(0, DRAFT_HIDDEN)
        group = cp.cp_group(kv)
        if group is not None:
            return cp.owner_rows(group, hid, seqs, positions)
        rows = [
            hid.index_select(0, s.ctx_locs[p : p + 1])
            if p >= 0
            else hid.new_zeros(1, *hid.shape[1:])
            for s, p in zip(seqs, positions, strict=True)
        ]
        return torch.cat(rows) if rows else hid.new_zeros(0, *hid.shape[1:])
