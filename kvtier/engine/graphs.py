"""CUDA graphs of decode steps: a step of ``B`` decoding sequences whose longest context fits
``C`` columns replays one recorded forward instead of launching its ~30 kernels per layer from
Python, which on a large GPU costs more than the kernels themselves.

A graph's inputs are static device buffers the step fills from one pinned host buffer:

    ids [B] | positions [B] | out slots [B] | context slots [B, C] | context lengths [B]

Both sizes are buckets, so that a serving engine whose batch and contexts keep changing records
few graphs (each recording costs a step's eager run plus the capture, and a new split count
compiles the kernel):

    real batch b     graph batch B (``batch_bucket``)     rows b .. B-1
    1, 2, 3-4, 5-8   1, 2, 4, 8                           padding: token 0 at position 0,
    9-16, 17-24 ...  multiples of 8 up to ``MAX_BATCH``     context and out slot the pad slot

    longest context  graph columns C (``context_bucket``)
    up to 256        256
    then             256 x 2^k or 256 x 3 x 2^k (past 512, at most 1.5x the one before)

Context slots past a sequence's length are never read (the decode kernel masks by length), so
contexts grow into ``C`` without a new graph. Padding rows write their K/V into the pad slot, a
page the engine holds for the purpose and no request ever reads; without one, graphs are
recorded per exact batch size. Only forwards of the dense model whose every item decodes one
token qualify; everything else runs eagerly. A new ``(B, C)`` runs its step eagerly on the
static buffers (which also compiles the kernels) and records the graph after it, so no step
waits for a capture it does not use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.engine import attention, cp, decode_kernel
from kvtier.engine.batch import SeqSlots
from kvtier.engine.model import Attention, CausalLM
from kvtier.errors import IntegrityError
from kvtier.pools.pinning import no_registrations
from kvtier.transfer import DeviceKV

if TYPE_CHECKING:
    from kvtier.cache import TieredCache
    from kvtier.engine.request import Request

CONTEXT_BUCKET = 256
"""Context columns of the smallest graphs; larger ones are this times 2^k or 3 x 2^k."""
MAX_GRAPHS = 12
"""Recorded graphs kept (least recently used go first)."""
MAX_BATCH = 128
"""Larger decode batches run eagerly."""


def batch_bucket(b: int) -> int:
    """Rows of the graph that serves a batch of ``b`` (``1 <= b <= MAX_BATCH``): the next power
    of two up to 8, then the next multiple of 8."""
    if b <= 8:
        return 1 << (b - 1).bit_length()
    return -(-b // 8) * 8


def context_bucket(c: int) -> int:
    """Context columns of the graph that serves a longest context of ``c`` tokens: the least
    ``CONTEXT_BUCKET x {1, 2, 3, 4, 6, 8, 12, ...}`` that holds it. Past 512 columns a bucket is
    at most 1.5x the one before, so the columns a step fills and the splits the kernel launches
    stay under 1.5x what the context needs; a decode from 2K to 32K tokens records 8 graphs per
    batch size, not 120."""
    units = max(1, -(-c // CONTEXT_BUCKET))
    power = 1 << (units - 1).bit_length()  # least power of two >= units
    three = 3 * power // 4  # 3 x 2^k just below it (0 when power < 4)
    return CONTEXT_BUCKET * (three if three >= units else power)


class PaddingPage:
    """The device page padding rows write into (see the module docstring): taken from the
    cache once, held by the engine for as long as it runs, never a request's. Empty (no
    page, ``slot`` ``None``) where decode steps do not replay graphs."""

    def __init__(self, cache: TieredCache, model: torch.nn.Module, enabled: bool) -> None:
        """Take the page from ``cache`` when ``enabled`` (``LLM(cuda_graphs=...)``) and
        :func:`supported` says ``model``'s decode steps replay graphs."""
        self.locs = torch.empty(0, dtype=torch.int64)
        """The page's slots (logical, as ``cache.alloc`` gave them)."""
        self.slot: int | None = None
        """Its first physical slot, where every padding row writes."""
        self._page_size = cache.page_size
        if enabled and supported(model, cache.kv_buffers):
            self.locs = cache.alloc(1)
            self.slot = int(cache.kv_buffers.slots(self.locs)[0])

    @property
    def pages(self) -> int:
        """Device pages held: 1 or 0."""
        return self.locs.numel() // self._page_size

    def check(self, cache: TieredCache, requests: Iterable[Request]) -> None:
        """The page is still the engine's and in none of ``requests``' slots (a request
        holding it would read the padding rows' K/V). Raises ``IntegrityError``."""
        if not self.pages:
            return
        if cache.engine_pages.owned_pages(self.locs).numel() != self.pages:
            raise IntegrityError("the engine's padding page is no longer the engine's")
        for req in requests:
            if req.locs is not None and bool(torch.isin(req.locs.cpu(), self.locs).any()):
                raise IntegrityError(f"request {req.id} holds the engine's padding page")


@dataclass(slots=True)
class _Graph:
    """One recorded decode forward and its static buffers."""

    host: torch.Tensor
    """Pinned int64 ``[3B + B*C]``: ids, positions, out slots, context slots."""
    host_lens: torch.Tensor
    """Pinned int32 ``[B]``."""
    dev: torch.Tensor
    """The device copy of ``host``."""
    lens: torch.Tensor
    """The device copy of ``host_lens``."""
    logits: torch.Tensor | None = None
    """The recorded forward's output; ``None`` until recorded."""
    graph: torch.cuda.CUDAGraph | None = None


_SAME_FORWARD = ("forward", "mix", "after_layers", "anchor_layers", "pool_specs", "check_batch")
"""What a model class must take unchanged from ``CausalLM`` for its decode steps to replay:
the forward's whole path (a subclass may still change how its weights start)."""


def supported(model: torch.nn.Module, kv: DeviceKV) -> bool:
    """Whether decode steps of ``model`` over ``kv`` may replay graphs: the dense model (not a
    family deriving from it with its own mixing or state) on CUDA, its pool's dtype one the
    decode kernel takes, no context parallelism."""
    if not isinstance(model, CausalLM) or decode_kernel.triton is None:
        return False
    cls = type(model)
    if any(getattr(cls, name) is not getattr(CausalLM, name) for name in _SAME_FORWARD):
        return False
    if getattr(model, "stateful", False) or model.device.type != "cuda":
        return False
    if cp.cp_group(kv) is not None:
        return False
    return (
        all(type(layer.self_attn) is Attention for layer in model.model.layers)
        and model.config.torch_dtype in (torch.float16, torch.bfloat16)
        and kv.layer(0).dtype == model.config.torch_dtype
    )


class DecodeGraphs:
    """Recorded decode forwards of one model over one pool, keyed by ``(B, C)``."""

    def __init__(self, model: CausalLM, kv: DeviceKV, pad_slot: int | None = None) -> None:
        """``pad_slot``: a device slot of ``kv`` that no request holds, for padding rows (see
        the module docstring); ``None`` records a graph per exact batch size."""
        self.model = model
        self.kv = kv
        self.device = model.device
        self.pad_slot = pad_slot
        self._pad_ctx = None if pad_slot is None else torch.tensor([pad_slot], dtype=torch.int64)
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        """Steps served by a recorded graph."""
        self.captures = 0
        """Graphs recorded."""
        self.padded = 0
        """Replayed steps whose batch was padded to their graph's size."""

    def forward(self, ctx_slots: Sequence[torch.Tensor], ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[b, vocab]`` (float32, on the device) of ``b`` sequences decoding one token
        each: sequence ``i`` reads the physical slots ``ctx_slots[i]`` (CPU int64, its whole
        context, the new token's slot last) and feeds token ``ids[i]``."""
        n = len(ctx_slots)
        b = n if self._pad_ctx is None else batch_bucket(n)
        if b > n:
            ctx_slots = [*ctx_slots, *([self._pad_ctx] * (b - n))]
            ids = [*ids, *([0] * (b - n))]
        lens = [int(s.shape[0]) for s in ctx_slots]
        c = context_bucket(max(lens))
        key = (b, c)
        g = self._graphs.get(key)
        if g is None:
            g = self._new(b, c)
        else:
            self._graphs.move_to_end(key)
        self._fill(g, b, c, ctx_slots, ids, lens)
        if g.graph is not None:
            g.graph.replay()
            self.replays += 1
            self.padded += b > n
            return g.logits[:n]
        logits = self._run(g, b, c)  # this step's forward, eagerly: kernels compile here
        self._record(g, b, c)
        return logits[:n]

    def _new(self, b: int, c: int) -> _Graph:
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        n = 3 * b + b * c
        g = _Graph(
            host=torch.zeros(n, dtype=torch.int64, pin_memory=True),
            host_lens=torch.ones(b, dtype=torch.int32, pin_memory=True),
            dev=torch.zeros(n, dtype=torch.int64, device=self.device),
            lens=torch.ones(b, dtype=torch.int32, device=self.device),
        )
        self._graphs[(b, c)] = g
        return g

    def _fill(
        self,
        g: _Graph,
        b: int,
        c: int,
        ctx_slots: Sequence[torch.Tensor],
        ids: Sequence[int],
        lens: list[int],
    ) -> None:
        host = g.host
        host[:b] = torch.tensor(ids, dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        host[b : 2 * b] = lens_t - 1
        locs = host[3 * b :].view(b, c)
        for i, s in enumerate(ctx_slots):
            locs[i, : s.shape[0]] = s
        host[2 * b : 3 * b] = locs[torch.arange(b), host[b : 2 * b]]
        g.host_lens.copy_(lens_t)
        # the previous step read its logits back, so its copies out of these buffers are done
        g.dev.copy_(host, non_blocking=True)
        g.lens.copy_(g.host_lens, non_blocking=True)

    def _run(self, g: _Graph, b: int, c: int) -> torch.Tensor:
        dev = g.dev
        ids, positions, out = dev[:b], dev[b : 2 * b], dev[2 * b : 3 * b]
        locs = dev[3 * b :].view(b, c)
        seqs = [SeqSlots(1, out[i : i + 1], locs[i]) for i in range(b)]
        attention.use_decode_plan(seqs, attention.DecodePlan(None, locs, None, g.lens))
        return self.model(ids, positions, seqs, self.kv, all_logits=True)

    def _record(self, g: _Graph, b: int, c: int) -> None:
        graph = torch.cuda.CUDAGraph()
        # Recording runs nothing: the eager step just run on these buffers stays the result.
        # A host tier pinning in the background would invalidate the capture.
        with no_registrations(), torch.cuda.graph(graph, pool=self._pool):
            g.logits = self._run(g, b, c)
        g.graph = graph
        self.captures += 1
