"""Page codecs: how the host and storage tiers hold a lossy component (``CacheConfig.kv_codec``).

A component marked ``PoolSpec.lossy`` (the attention KV anchor) is held in the host pool, and
so in storage objects made from host bytes, as one byte per element plus a float32 scale per
page, layer and scale group (``PoolSpec.block`` elements of a row: one KV head, K and V apart,
or one MLA latent block). The host pool's *host specs* say so (:func:`host_specs`): the lossy
component keeps its name and rows with the codec's one-byte element type, and a sidecar
``<name>.scale`` follows it with one ``[groups]`` float32 row per page and layer. Every other
component is held exactly as on the device.

Error bounds, per element ``x`` of a group with scale ``s`` (``amax / qmax``, ``1`` for an
all-zero group), before the result is cast back to the device's element type:

    fp8_e4m3   |x - x'| <= 2**-4 * |x| + 2**-10 * s     (3 mantissa bits; the second term is
                                                         half the subnormal step near zero)
    int8       |x - x'| <= s / 2                        (round to nearest, 127 levels)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.config import KV_CODECS
from kvtier.errors import ConfigError
from kvtier.pools.spec import PoolSpec

SCALE_SUFFIX = ".scale"
"""Suffix of the scale sidecar that follows a coded component in the host specs."""


@dataclass(frozen=True)
class PageCodec:
    """One codec of ``CacheConfig.kv_codec``."""

    name: str
    """``none``, ``fp8_e4m3`` or ``int8``."""
    dtype: torch.dtype | None
    """Element type of a coded component in the host pool (``None``: exact, no coding)."""
    qmax: float
    """Largest magnitude a scaled element takes: ``amax`` of a group maps to it."""

    def codes(self, spec: PoolSpec) -> bool:
        """Whether this codec holds ``spec`` in coded form in the host tier."""
        return self.dtype is not None and spec.lossy

    def encode(self, x: torch.Tensor, spec: PoolSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (``[n, rows, row elements]``: ``n`` pages of one layer each) as ``(codes,
        scales)``: codes of the same shape in :attr:`dtype`, float32 scales ``[n, groups]``
        (one per page, layer and group of ``spec.block`` elements)."""
        n, rows, numel = x.shape
        groups = numel // spec.block
        g = x.float().view(n, rows, groups, spec.block)
        amax = g.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax))
        y = g / scale[:, None, :, None]
        if self.dtype == torch.int8:
            y = y.round()
        codes = y.clamp(-self.qmax, self.qmax).to(self.dtype)
        return codes.view(n, rows, numel), scale

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, spec: PoolSpec) -> torch.Tensor:
        """The inverse of :meth:`encode`, in ``spec.dtype``: ``[n, rows, row elements]``."""
        n, rows, numel = codes.shape
        g = codes.float().view(n, rows, numel // spec.block, spec.block)
        return (g * scale[:, None, :, None]).to(spec.dtype).view(n, rows, numel)


CODECS: dict[str, PageCodec] = {
    "none": PageCodec("none", None, 0.0),
    "fp8_e4m3": PageCodec("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "int8": PageCodec("int8", torch.int8, 127.0),
}
if tuple(CODECS) != KV_CODECS:  # the configuration's choices are these codecs
    raise ImportError(f"kv codecs {tuple(CODECS)} differ from CacheConfig's {KV_CODECS}")


def get_codec(name: str) -> PageCodec:
    """The codec ``name``; an unknown one raises ``ConfigError`` naming the choices."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"kv_codec={name!r} is not one of {', '.join(CODECS)}") from None


def scale_spec(spec: PoolSpec, page_size: int) -> PoolSpec:
    """The scale sidecar of coded ``spec`` in a host pool of ``page_size``-token pages: one
    float32 row of ``groups`` scales per page and layer."""
    return PoolSpec(
        spec.name + SCALE_SUFFIX,
        spec.num_layers,
        (spec.row_numel // spec.block,),
        torch.float32,
        kind="sidecar",
        tokens_per_row=page_size,
    )


def host_specs(specs: Sequence[PoolSpec], codec: PageCodec, page_size: int) -> tuple[PoolSpec, ...]:
    """The components a host pool of ``page_size``-token pages holds for the device pool set
    ``specs`` under ``codec``: each coded one in the codec's element type, followed by its
    scale sidecar; the others unchanged (the same specs without a codec)."""
    out: list[PoolSpec] = []
    for s in specs:
        if not codec.codes(s):
            out.append(s)
            continue
        out.append(dataclasses.replace(s, dtype=codec.dtype, lossy=False, scale_block=0))
        out.append(scale_spec(s, page_size))
    return tuple(out)


def host_page_bytes(specs: Sequence[PoolSpec], codec: PageCodec, page_size: int) -> int:
    """Host bytes of one ``page_size``-token page of the pool set ``specs`` under ``codec``."""
    return sum(s.page_bytes(page_size) for s in host_specs(specs, codec, page_size))
