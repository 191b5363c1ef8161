"""How ``kvtier serve`` sizes its tiers when no flag gives their size, and byte sizes as
flags write them (``10G``, ``1GiB``, ``512M``).

The device pool takes ``mem_fraction`` of the device memory that is free once the weights are
loaded, less a workspace estimate (activations of a full prefill step, the step's logits,
CUDA graphs and library workspaces), in whole pages: as vLLM's ``--gpu-memory-utilization``
and SGLang's ``--mem-fraction-static`` leave the rest to the forward pass. On the CPU the
device pool is a fixed ``CPU_DEVICE_TOKENS`` tokens. The host tier defaults to twice the
device pool, capped at ``HOST_MEMORY_SHARE`` of the host memory available at start.

Arithmetic only: the figures are measured by the caller (``kvtier.server.lifecycle``), so
this module imports neither torch nor the engine.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

DEFAULT_MEM_FRACTION = 0.9
"""Share of the device memory free after the weights and the workspace that the device
pool takes by default."""
CPU_DEVICE_TOKENS = 16384
"""Tokens the device pool holds on the CPU when no flag sizes it."""
DEFAULT_HOST_RATIO = 2.0
"""Host tier pages per device pool page when no flag sizes the host tier."""
HOST_MEMORY_SHARE = 0.5
"""The default host tier takes at most this share of the host memory available at start."""
WORKSPACE_FIXED_BYTES = 512 << 20
"""Device memory the workspace estimate adds to its per-token figures: CUDA graphs, cuBLAS
and Triton workspaces, the allocator's fragmentation."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
"""Byte-size suffixes: a bare letter and ``KiB``/``MiB``/... are powers of 1024 (as ``df -h``
shows sizes), ``KB``/``MB``/... powers of 1000; case does not matter."""
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str, flag: str) -> int:
    """``text`` as a whole number of bytes: a number with an optional suffix (``4096``,
    ``512M``, ``10G``, ``1GiB``, ``1.5GB``; see ``_UNITS``). Raises ``ConfigError`` naming
    ``flag`` for anything else, and for a size below one byte."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(m.group(3).lower()) if m else None
    if m is None or unit is None:
        raise ConfigError(
            f"{flag} {text!r} is not a byte size: a number with an optional unit, e.g. 4096, "
            "512M, 10G, 1GiB, 1.5GB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, "
            "KB/MB/GB/TB powers of 1000)"
        )
    value = float(m.group(1)) * 10 ** int(m.group(2) or 0) * unit
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"{flag} {text!r} must be at least one byte")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``32.0 MiB``, ``1.50 GiB``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if n < 10 else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def workspace_bytes(model: Any, max_prefill_tokens: int, max_running: int) -> int:
    """Device memory a forward step needs beside weights and pools, estimated from the model
    config ``model`` (its ``hidden_size``, ``intermediate_size``, heads, ``vocab_size`` and
    ``dtype``): one layer's live activations for ``max_prefill_tokens`` tokens (residual,
    norms, q/k/v, attention output, the MLP's three projections; twice over for temporaries),
    float32 logits of up to ``max_running`` sequences plus drafts, and
    ``WORKSPACE_FIXED_BYTES``. Layers run one after another, so only one layer's activations
    are alive at a time."""
    hidden = int(model.hidden_size)
    inter = int(getattr(model, "intermediate_size", 4 * hidden))
    heads = int(getattr(model, "num_heads", 1))
    head_dim = int(getattr(model, "head_dim", 0) or hidden // max(heads, 1))
    kv_heads = int(getattr(model, "num_kv_heads", heads))
    elem = {"float32": 4, "float64": 8}.get(str(getattr(model, "dtype", "float32")), 2)
    per_token = 4 * hidden + 3 * inter + 2 * heads * head_dim + 2 * kv_heads * head_dim
    activations = 2 * max_prefill_tokens * per_token * elem
    logits = 2 * (max_running + 8) * int(model.vocab_size) * 4
    return WORKSPACE_FIXED_BYTES + activations + logits


def device_pages_from_memory(
    free_bytes: int, workspace: int, fraction: float, page_bytes: int
) -> int:
    """Pages of ``page_bytes`` in ``fraction`` of ``free_bytes - workspace`` (the device
    memory free once the weights are loaded, less the forward's workspace); 0 when that
    leaves nothing."""
    budget = math.floor((free_bytes - workspace) * fraction)
    return max(0, budget // page_bytes)


def available_host_bytes() -> int | None:
    """Host memory available to a new allocation now (Linux ``MemAvailable``; elsewhere the
    free physical pages), ``None`` when this host does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class SizeRequest:
    """The sizing flags as given (``None``: not given)."""

    device_pages: int | None = None
    """``--device-pages``: the device pool in pages, whatever memory is free."""
    device_bytes: int | None = None
    """``--device-bytes``: the device pool in bytes (whole pages)."""
    mem_fraction: float = DEFAULT_MEM_FRACTION
    """``--mem-fraction``: share of the free device memory (after weights and workspace)."""
    host_pages: int | None = None
    """``--host-pages``."""
    host_bytes: int | None = None
    """``--host-bytes``."""
    host_ratio: float | None = None
    """``--host-ratio``: host pages per device page."""

    def __post_init__(self) -> None:
        f = self.mem_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ConfigError(f"--mem-fraction must be a number in (0, 1], got {f!r}")
        if self.device_pages is not None and self.device_bytes is not None:
            raise ConfigError("--device-pages and --device-bytes both size the device pool")
        given = [
            n for n in ("host_pages", "host_bytes", "host_ratio") if getattr(self, n) is not None
        ]
        if len(given) > 1:
            flags = " and ".join("--" + n.replace("_", "-") for n in given)
            raise ConfigError(f"{flags} all size the host tier: give one")


@dataclass(frozen=True)
class PoolPlan:
    """The device and host pool sizes ``plan_pools`` chose, and why (for the start-up
    summary)."""

    device_pages: int
    """Device pool pages (tree pages: every component of the pool set)."""
    device_reason: str
    """How ``device_pages`` was decided."""
    host_pages: int | None
    """Host pool pages to configure; ``None``: ``CacheConfig`` sizes it from ``host_ratio``
    (the flag given) or there is no host tier."""
    host_ratio: float | None
    """``--host-ratio`` as given (passed on to ``CacheConfig``)."""
    host_bytes: int | None
    """``--host-bytes`` as given (passed on to ``CacheConfig``)."""
    host_reason: str
    """How the host tier was sized."""
    workspace_bytes: int = 0
    """The workspace estimate left free beside the pools (CUDA)."""
    free_bytes: int | None = None
    """Device memory free once the weights were loaded (CUDA; ``None`` on the CPU)."""


def plan_pools(
    req: SizeRequest,
    *,
    page_bytes: int,
    page_tokens: int,
    cuda: bool,
    free_bytes: int | None,
    workspace: int,
    host_tier: bool,
    host_available: int | None,
) -> PoolPlan:
    """The pool sizes for ``req``: a flag's size as given; else on CUDA
    ``device_pages_from_memory(free_bytes, workspace, mem_fraction, page_bytes)`` and on the
    CPU ``CPU_DEVICE_TOKENS`` tokens; a host tier of ``DEFAULT_HOST_RATIO`` device pools capped
    at ``HOST_MEMORY_SHARE`` of ``host_available``. ``page_bytes`` is one page of every
    component, ``page_tokens`` its tokens. Raises ``ConfigError`` when the device memory left
    holds no page."""
    if req.device_pages is not None:
        pages, why = req.device_pages, "--device-pages"
    elif req.device_bytes is not None:
        pages, why = req.device_bytes // page_bytes, "--device-bytes"
        if pages < 1:
            raise ConfigError(
                f"--device-bytes {req.device_bytes} holds no page of {page_bytes} bytes"
            )
    elif cuda:
        if free_bytes is None:
            raise ConfigError("sizing the device pool needs the free device memory")
        pages = device_pages_from_memory(free_bytes, workspace, req.mem_fraction, page_bytes)
        why = (
            f"--mem-fraction {req.mem_fraction:g} of the {format_bytes(free_bytes)} free after "
            f"the weights, less a {format_bytes(workspace)} workspace"
        )
        if pages < 1:
            raise ConfigError(
                f"no device memory left for the KV cache: {format_bytes(free_bytes)} free after "
                f"the weights, {format_bytes(workspace)} workspace (--max-prefill-tokens, "
                "--max-running), one page is "
                f"{format_bytes(page_bytes)}; lower those, or give --device-pages"
            )
    else:
        pages = -(-CPU_DEVICE_TOKENS // page_tokens)
        why = f"the CPU default of {CPU_DEVICE_TOKENS} tokens (--device-pages to change)"
    if not host_tier:
        return PoolPlan(pages, why, None, None, None, "no host tier", workspace, free_bytes)
    if req.host_pages is not None:
        host, host_why = req.host_pages, "--host-pages"
    elif req.host_bytes is not None or req.host_ratio is not None:
        host = None
        host_why = (
            "--host-bytes" if req.host_bytes is not None else f"--host-ratio {req.host_ratio:g}"
        )
    else:
        host = max(1, int(pages * DEFAULT_HOST_RATIO))
        host_why = f"{DEFAULT_HOST_RATIO:g} x the device pool"
        if host_available is not None:
            cap = int(host_available * HOST_MEMORY_SHARE) // page_bytes
            if cap < host:
                host = max(1, cap)
                host_why = (
                    f"{HOST_MEMORY_SHARE:.0%} of the {format_bytes(host_available)} of host "
                    "memory available (--host-bytes to change)"
                )
    return PoolPlan(
        pages, why, host, req.host_ratio, req.host_bytes, host_why, workspace, free_bytes
    )
