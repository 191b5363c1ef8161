"""Hybrid recurrent family: layers alternate Mamba(-1) mixers and GQA attention.

Attention layers keep per-token K/V in the anchor pool. Recurrent layers carry a fixed-size
state per sequence (``SeqSlots.state``) and write checkpoints of it into the ``state`` pool
(one row per page, ``kind="state"``), from which a request resuming after that page restarts.

State layout of one recurrent layer (a state row, and each running-state tensor): flat
``[d_inner * (d_conv - 1 + d_state)]``, viewed as ``[d_inner, d_conv - 1 + d_state]``: per
channel, the last ``d_conv - 1`` conv inputs (oldest first), then the SSM state ``h``. The
family's config and preset are in ``hybrid_config.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.batch import ForwardBatch, KVBuffers, SeqSlots
from kvtier.engine.families.hybrid_config import HybridConfig
from kvtier.engine.model import MLP, Attention, DecoderLM
from kvtier.engine.model_config import dense_config_of
from kvtier.engine.ops import RMSNorm, linear
from kvtier.errors import RequestError
from kvtier.pools import PoolSpec


class DepthwiseConv(nn.Module):
    """The parameters of a causal depthwise conv, named and shaped as ``nn.Conv1d``'s
    (``weight`` ``[channels, 1, kernel]``, ``bias``); ``RecurrentMixer`` applies them."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(channels, 1, kernel, dtype=dtype), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False)


class RecurrentMixer(nn.Module):
    """Mamba's selective SSM mixer (Mamba-1, as transformers' ``MambaMixer`` computes it, with
    the same parameter names): in_proj -> (x, z); causal depthwise conv + SiLU on x, giving u;
    ``x_proj(u)`` -> (dt_rank inputs, B, C), ``dt = softplus(dt_proj(...))``; diagonal scan
    ``h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t u_t``, ``y_t = C_t . h_t + D * u_t``;
    ``out_proj(y * silu(z))``."""

    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        dt, di = c.torch_dtype, c.d_inner
        self.d_inner, self.d_conv, self.d_state, self.dt_rank = di, c.d_conv, c.d_state, c.dt_rank
        self.in_proj = linear(c.hidden_size, 2 * di, False, dt)
        self.conv1d = DepthwiseConv(di, c.d_conv, dt)
        self.x_proj = linear(di, c.dt_rank + 2 * c.d_state, False, dt)
        self.dt_proj = linear(c.dt_rank, di, True, dt)
        self.A_log = nn.Parameter(torch.zeros(di, c.d_state, dtype=dt), requires_grad=False)
        self.D = nn.Parameter(torch.ones(di, dtype=dt), requires_grad=False)
        self.out_proj = linear(di, c.hidden_size, False, dt)

    def forward(
        self,
        x: torch.Tensor,
        state: torch.Tensor,
        outs: Sequence[tuple[int, int]] = (),
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one sequence's ``n`` new tokens ``x`` (``[n, hidden]``) from ``state``.

        ``state`` (flat, the row layout) is updated in place to the state after the last
        token; for each ``(i, row)`` of ``outs`` the state after token ``i`` goes to
        ``rows[row]`` (``rows`` is the state pool layer). Raises ``RequestError`` when
        ``outs`` asks for checkpoints but no ``rows`` are given.
        """
        if outs and rows is None:
            raise RequestError(f"{len(outs)} state checkpoint(s) requested without state rows")
        n, k = x.shape[0], self.d_conv - 1
        st = state.view(self.d_inner, k + self.d_state)
        xi, z = self.in_proj(x).chunk(2, dim=-1)
        # conv inputs over time: the k carried inputs, then this call's tokens
        seq = torch.cat((st[:, :k].to(xi.dtype), xi.t()), dim=1)
        conv = (seq.unfold(1, self.d_conv, 1) * self.conv1d.weight).sum(-1)
        u = F.silu(conv.t() + self.conv1d.bias)
        dt_in, b, c = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt_in))
        a = -torch.exp(self.A_log)
        decay = torch.exp(dt[:, :, None] * a)
        drive = (dt * u)[:, :, None] * b[:, None, :]
        h = st[:, k:].to(u.dtype)
        want = {i: row for i, row in outs}
        ys = []
        for t in range(n):
            h = decay[t] * h + drive[t]
            ys.append(h @ c[t])
            if t in want and rows is not None:
                snap = rows[want[t]].view(self.d_inner, k + self.d_state)
                snap[:, :k] = seq[:, t + 1 : t + 1 + k]
                snap[:, k:] = h
        st[:, :k] = seq[:, n:]
        st[:, k:] = h
        y = torch.stack(ys) + self.D * u
        return self.out_proj(y * F.silu(z))


class HybridLayer(nn.Module):
    """Pre-norm residual block: a mixer (``self_attn`` or recurrent ``mixer``), then a MLP."""

    def __init__(self, c: HybridConfig, attention: bool) -> None:
        super().__init__()
        block = dense_config_of(c)
        self.self_attn = Attention(block) if attention else None
        self.mixer = None if attention else RecurrentMixer(c)
        self.mlp = MLP(block)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.torch_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.torch_dtype)


class HybridModel(DecoderLM):
    """The hybrid model. Weights start deterministic-random from ``config.seed``.

    Attention layer ``config.attn_layers[j]`` uses layer ``j`` of the ``kv`` pool; the ``r``-th
    recurrent layer uses layer ``r`` of the ``state`` pool and ``SeqSlots.state[r]``.
    """

    config_class = HybridConfig

    stateful = True
    """Recurrent layers carry a running state; the engine checkpoints it per page."""

    supports_cp = False
    """The running state spans every page, so it cannot be sharded by page (context
    parallelism)."""

    def __init__(self, config: HybridConfig) -> None:
        attn = config.attn_layers
        super().__init__(config, (HybridLayer(config, i in attn) for i in range(config.num_layers)))
        self.num_recurrent = config.num_layers - len(attn)
        # per layer: its kind and its index among that kind's layers (= its pool layer)
        self.slots: list[tuple[str, int]] = [
            ("attn", attn.index(i)) if i in attn else ("rec", i - sum(a < i for a in attn))
            for i in range(config.num_layers)
        ]

    def pool_specs(self) -> list[PoolSpec]:
        """Anchor KV pool for the attention layers, then one state pool for the recurrent ones."""
        c = self.config
        return [
            PoolSpec(
                "kv", len(c.attn_layers), (2, c.num_kv_heads, c.head_dim), c.torch_dtype, lossy=True
            ),
            PoolSpec("state", self.num_recurrent, (c.state_numel,), c.torch_dtype, kind="state"),
        ]

    def anchor_layers(self) -> list[int]:
        """Only the attention layers read the anchor (``kv``) pool."""
        return list(self.config.attn_layers)

    def zero_state(self) -> list[torch.Tensor]:
        """A fresh running state (before any token): zeros, one tensor per recurrent layer."""
        c = self.config
        return [
            torch.zeros(c.state_numel, dtype=c.torch_dtype, device=self.device)
            for _ in range(self.num_recurrent)
        ]

    def load_state(self, kv: KVBuffers, row: int) -> list[torch.Tensor]:
        """Copies of checkpoint ``row`` of every recurrent layer (a running state to resume)."""
        return [kv.layer(r, "state")[row].clone() for r in range(self.num_recurrent)]

    def init_value(self, name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
        """``dt`` starts log-uniform in [0.01, 0.1] and ``A`` in ``-[1, d_state]`` so the
        recurrence remembers tens of tokens; ``D`` starts at one."""
        if name.endswith(".D"):
            return torch.ones(shape)
        if name.endswith("A_log"):
            return torch.rand(shape, generator=gen) * math.log(self.config.d_state)
        if name.endswith("dt_proj.bias"):
            lo, hi = math.log(0.01), math.log(0.1)
            dt0 = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=gen))
            return dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
        if name.endswith("dt_proj.weight"):
            return torch.randn(shape, generator=gen) * ((1.0 / math.sqrt(shape[1])) * 0.1)
        if name.endswith("conv1d.weight"):
            return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        return None

    def check_batch(self, input_ids: torch.Tensor, seqs: Sequence[SeqSlots]) -> None:
        """Besides the shared checks, every sequence needs ``state``: the running state before
        its first new token, which ``forward`` updates in place; ``state_out`` rows of the
        ``state`` pool receive checkpoints."""
        super().check_batch(input_ids, seqs)
        for s in seqs:
            if s.state is None or len(s.state) != self.num_recurrent:
                got = None if s.state is None else len(s.state)
                raise RequestError(
                    f"every sequence needs a running state of {self.num_recurrent} tensors, "
                    f"got {got}"
                )
            if any(not 0 <= i < s.num_new for i, _ in s.state_out):
                raise RequestError(
                    f"state_out {s.state_out} names a token outside the {s.num_new} new ones"
                )

    def mix(self, i: int, layer: nn.Module, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """Recurrent layers ignore ``positions``: the state alone carries the past."""
        kind, j = self.slots[i]
        if kind == "attn":
            return layer.self_attn(h, b.positions, b.seqs, b.out_locs, b.kv.layer(j))
        rows = b.kv.layer(j, "state")
        mixed, start = [], 0
        for s in b.seqs:
            end = start + s.num_new
            mixed.append(layer.mixer(h[start:end], s.state[j], s.state_out, rows))
            start = end
        return torch.cat(mixed)
