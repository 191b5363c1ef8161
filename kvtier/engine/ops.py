"""Building blocks every model family shares: RMS normalisation, zero-initialised projections
(filled later by ``DecoderLM.init_random``, whose shared rule ``default_init`` is) and rotary
position embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        # torch's own normalisation (a fused kernel where it has one): fewer launches per layer
        return self.weight * F.rms_norm(xf, (xf.shape[-1],), eps=self.eps).to(x.dtype)


def linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    """A bias-optional projection with zero weights, for ``DecoderLM.init_random`` to fill."""
    # built on meta so construction leaves torch's global RNG alone
    lin = nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device="meta")
    lin.weight = nn.Parameter(torch.zeros(n_out, n_in, dtype=dtype), requires_grad=False)
    if bias:
        lin.bias = nn.Parameter(torch.zeros(n_out, dtype=dtype), requires_grad=False)
    return lin


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by its tokens' positions (HF half-split layout).

    ``inv_freq`` (``[head_dim // 2]``, float32, on ``x``'s device) replaces the unscaled
    frequencies of base ``theta``; ``scale`` multiplies the tables (``rope_tables``)."""
    d = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    return apply_rope(x, *rope_tables(positions, inv_freq, x.dtype, scale))


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, ``[T, 1, head_dim]`` in ``dtype``: what :func:`apply_rope` rotates rows
    at ``positions`` by, for the frequencies ``inv_freq`` (on ``positions``' device), both
    multiplied by ``scale`` in float32 first (YaRN's attention factor, as transformers does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``, HF half-split layout) by ``rope_tables``."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


_tables: tuple[torch.Tensor, tuple[float, ...], torch.dtype, torch.Tensor, torch.Tensor] | None = (
    None
)
"""The last ``shared_rope_tables`` entry: positions (held, so its identity cannot be reused),
frequencies, dtype, cos, sin."""


def shared_rope_tables(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    key: tuple[float, ...],
    dtype: torch.dtype,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables(positions, inv_freq, dtype, scale)``, built once for consecutive calls
    with the same ``positions`` object (which nobody writes after building it), the same
    ``key`` (the values of ``inv_freq`` and then ``scale``, compared on the host) and
    ``dtype``: every layer of a forward shares one pair instead of building its own."""
    global _tables
    entry = _tables  # one read: another thread may replace the entry meanwhile
    if entry is not None and entry[0] is positions and entry[1] == key and entry[2] == dtype:
        return entry[3], entry[4]
    cos, sin = rope_tables(positions, inv_freq, dtype, scale)
    _tables = (positions, key, dtype, cos, sin)
    return cos, sin


def default_init(
    name: str, shape: torch.Size, gen: torch.Generator, residual_scale: float
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        std = 0.1
    elif "embed_tokens" in name:
        std = 1.0
    else:
        std = 1.0 / math.sqrt(shape[1])
        if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            std *= residual_scale
        if name == "lm_head.weight":
            std *= 2.0
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std
