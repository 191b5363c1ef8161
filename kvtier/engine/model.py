"""Llama/Qwen-style decoder whose attention reads and writes K/V in kvtier's device pool, and
the decoder skeleton (``DecoderLM``) every model family builds on.

Parameter names equal the HF checkpoint names (``model.layers.3.self_attn.q_proj.weight``), so
loading a checkpoint is a name-for-name copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine import cp
from kvtier.engine.attention import batched_attention, paged_attention
from kvtier.engine.batch import ForwardBatch, KVBuffers, SeqSlots
from kvtier.engine.common import ConfigBase
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.ops import RMSNorm, apply_rope, default_init, linear, shared_rope_tables
from kvtier.errors import RequestError
from kvtier.pools import PoolSpec


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dt, h, d = cfg.torch_dtype, cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.theta = cfg.rope_theta
        self._inv_freq = cfg.rope_inv_freq()
        self._rope_scale = cfg.rope_attention_factor
        self._rope_key = (*self._inv_freq.tolist(), self._rope_scale)
        """The frequencies' values and the tables' scale: layers with equal ones share a
        forward's RoPE tables."""
        self.q_proj = linear(h, cfg.num_heads * d, cfg.attention_bias, dt)
        self.k_proj = linear(h, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.v_proj = linear(h, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.o_proj = linear(cfg.num_heads * d, h, False, dt)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        out_locs: torch.Tensor,
        kv: torch.Tensor,
        out_rows: torch.Tensor | None = None,
        group: cp.Group | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' K/V rows (only ``out_rows`` of them when given) and attend.
        With a CP ``group`` each sequence's attention is this rank's partial, merged over the
        group (``cp.merge_partials``)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self._inv_freq.device != x.device:
            # kept off the module's buffers so checkpoints and dtype casts never see it
            self._inv_freq = self._inv_freq.to(x.device)
        cos, sin = shared_rope_tables(
            positions, self._inv_freq, self._rope_key, q.dtype, self._rope_scale
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rows = torch.stack((k, v), dim=1)
        if out_rows is not None:
            rows = rows.index_select(0, out_rows)
        kv.index_copy_(0, out_locs, rows.to(kv.dtype))
        if group is not None:
            return self.o_proj(cp.dense_attention(q, positions, seqs, kv, group).reshape(t, -1))
        return self.o_proj(self.attend_all(q, positions, seqs, kv).reshape(t, -1))

    def attend_all(
        self, q: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqSlots], kv: torch.Tensor
    ) -> torch.Tensor:
        """Attention of every sequence's new queries (``q`` ``[T, heads, d]`` at ``positions``,
        sequences concatenated in ``seqs`` order) over its context in ``kv``: ``[T, heads, d]``.
        Decoding sequences share one fused call."""
        return batched_attention(q, seqs, kv)

    def attend_each(
        self, q: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqSlots], kv: torch.Tensor
    ) -> torch.Tensor:
        """``attend_all`` one sequence at a time through :meth:`attend`."""
        outs, start = [], 0
        for s in seqs:
            end = start + s.num_new
            outs.append(self.attend(q[start:end], positions[start:end], s, kv))
            start = end
        return torch.cat(outs)

    def attend(
        self, q: torch.Tensor, q_pos: torch.Tensor, s: SeqSlots, kv: torch.Tensor
    ) -> torch.Tensor:
        """Attention of sequence ``s``'s new queries ``q`` (at ``q_pos``) over its context."""
        ctx = kv.index_select(0, s.ctx_locs)
        return paged_attention(q, ctx[:, 0], ctx[:, 1], q_pos)


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, ``intermediate_size`` wide
    (``cfg``'s unless given: an expert's)."""

    def __init__(self, cfg: ConfigBase, intermediate_size: int | None = None) -> None:
        super().__init__()
        dt, h = cfg.torch_dtype, cfg.hidden_size
        i = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = linear(h, i, False, dt)
        self.up_proj = linear(h, i, False, dt)
        self.down_proj = linear(i, h, False, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: the family's attention ``self_attn``, then the SwiGLU MLP."""

    def __init__(self, cfg: ConfigBase, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class Decoder(nn.Module):
    """Token embeddings, a family's layer stack and the final norm."""

    def __init__(self, cfg: ConfigBase, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        self.embed_tokens.weight = nn.Parameter(
            torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class DecoderLM(nn.Module):
    """What every family's model shares: ``config``, ``model`` (a ``Decoder`` whose layers have
    ``input_layernorm``, ``mlp`` and ``post_attention_layernorm``), ``lm_head`` (``None`` ties
    it to the embeddings), seeded random weights and the forward pass. A family says how its
    layers mix tokens (``mix``) and which pools they use (``pool_specs``)."""

    stateful = False
    """Attention-only: no recurrent state, no checkpoints."""

    supports_cp = True
    """Runs sharded over a context-parallel group (``kvtier.engine.cp``); a family that cannot
    says ``False`` and a CP forward raises ``ConfigError``."""

    def __init__(
        self, config: ConfigBase, layers: Iterable[nn.Module], tie_word_embeddings: bool = False
    ) -> None:
        """``layers`` (built lazily, in order) become ``model.layers``; weights start
        deterministic-random from ``config.seed``."""
        super().__init__()
        self.config = config
        self.model = Decoder(config, layers)
        self.lm_head = (
            None
            if tie_word_embeddings
            else linear(config.hidden_size, config.vocab_size, False, config.torch_dtype)
        )
        self.init_random(config.seed)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def pool_specs(self) -> list[PoolSpec]:
        """The pool set this model reads and writes (the anchor KV pool first)."""
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """Residual update of layer ``i``'s token mixer from the normalised stream ``h``,
        writing the new tokens' rows into ``b.kv``."""
        raise NotImplementedError

    def check_batch(self, input_ids: torch.Tensor, seqs: Sequence[SeqSlots]) -> None:
        """Raise ``RequestError`` (a ``ValueError``) unless ``seqs`` describe the batch
        ``input_ids``."""
        total = sum(s.num_new for s in seqs)
        if total != input_ids.shape[0]:
            raise RequestError(
                f"seqs' num_new add up to {total}, not the {input_ids.shape[0]} input tokens"
            )

    def init_stream(self, name: str) -> int:
        """Parameter ``name`` draws from the generator seeded ``seed + init_stream(name)``."""
        return 0

    def init_value(self, name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
        """A family's own initial value for parameter ``name`` (drawn from ``gen``), or
        ``None`` for the shared rules of ``init_random``."""
        return None

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Fill every weight from CPU generators seeded by ``seed`` (same on any device).

        Norm weights start at one, biases at std 0.1, embeddings at std 1, projections at std
        1/sqrt(fan_in) (unit variance); residual outputs shrink with depth so the stream stays
        dominated by the input, and the LM head is doubled so the logits, of std ~2, are
        neither flat nor one-hot.
        """
        gens: dict[int, torch.Generator] = {}
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            offset = self.init_stream(name)
            if offset not in gens:
                gens[offset] = torch.Generator().manual_seed(seed + offset)
            w = self.init_value(name, p.shape, gens[offset])
            if w is None:
                w = default_init(name, p.shape, gens[offset], residual_scale)
            p.copy_(w.to(p.dtype))

    def anchor_layers(self) -> list[int]:
        """Model layers that read the anchor pool, in order (anchor layer ``j`` is read by the
        ``j``-th of them). Every layer by default."""
        return list(range(len(self.model.layers)))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[SeqSlots],
        kv: KVBuffers,
        all_logits: bool = False,
        before_layer: Callable[[int], None] | None = None,
        last_logits: Sequence[int] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run ``sum(s.num_new)`` tokens of several sequences, writing their K/V into ``kv``.

        ``input_ids``/``positions`` are ``[T]``, sequences concatenated in ``seqs`` order.
        Returns float32 logits of each sequence's last token (``[len(seqs), vocab]``), or of
        every token when ``all_logits``. Each sequence's attention is computed on its own, so
        the result depends only on its tokens and the batch's composition.
        When ``kv`` is one rank's shard of a CP group (``kv.group``), ``seqs`` come from
        ``cp.seq_slots`` and every rank runs the same batch (``kvtier.engine.cp``).
        ``before_layer(j)`` is called before the first layer that reads anchor-pool layer ``j``
        (and with 0 before layer 0): where a load that is still arriving is waited for.
        ``last_logits[i]``: logits of sequence ``i``'s last that many tokens instead of one.
        ``after_layer(j)`` is called once the layer writing anchor-pool layer ``j`` ran: where
        a per-layer backup copies it.
        """
        self.check_batch(input_ids, seqs)
        b = ForwardBatch(positions, seqs, torch.cat([s.out_locs for s in seqs]), kv)
        if seqs and seqs[0].window_locs is not None:
            b.window_out = torch.cat(
                [s.window_locs[s.window_locs.shape[0] - s.num_new :] for s in seqs]
            )
        group = cp.cp_group(kv)
        if group is not None:
            cp.check_supported(self, group)
            b.group, b.out_rows = group, cp.batch_out_rows(seqs)
        x = self.model.embed_tokens(input_ids)
        anchor = self.anchor_layers()
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(max(0, sum(1 for a in anchor if a <= i) - 1))
            x = x + self.mix(i, layer, layer.input_layernorm(x), b)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if after_layer is not None and i in anchor:
                after_layer(anchor.index(i))
        self.after_layers(input_ids, x, b)
        if not all_logits:
            ends = itertools.accumulate(s.num_new for s in seqs)
            counts = last_logits or [1] * len(seqs)
            rows = [r for e, m in zip(ends, counts, strict=True) for r in range(e - m, e)]
            x = x.index_select(0, torch.tensor(rows, device=x.device))
        return F.linear(self.model.norm(x), self.head_weight()).float()

    def after_layers(self, input_ids: torch.Tensor, x: torch.Tensor, b: ForwardBatch) -> None:
        """Sees the batch's final (pre-norm) hidden states ``x``; a draft head writes here."""


class CausalLM(DecoderLM):
    """The dense model. Weights start deterministic-random from ``config.seed``."""

    config_class = ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        layers = (DecoderLayer(config, Attention(config)) for _ in range(config.num_layers))
        super().__init__(config, layers, config.tie_word_embeddings)

    def pool_specs(self) -> list[PoolSpec]:
        """The pool set this model reads and writes (the anchor KV pool first)."""
        return [self.kv_pool_spec()]

    def kv_pool_spec(self) -> PoolSpec:
        """The anchor KV pool this model's attention uses."""
        c = self.config
        return PoolSpec(
            name="kv",
            num_layers=c.num_layers,
            row_shape=(2, c.num_kv_heads, c.head_dim),
            dtype=c.torch_dtype,
            lossy=True,  # attention KV: a page codec may hold it (one scale per K/V head)
        )

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        return layer.self_attn(
            h, b.positions, b.seqs, b.out_locs, b.kv.layer(i), b.out_rows, b.group
        )
