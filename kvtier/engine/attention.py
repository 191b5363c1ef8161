"""Dense causal GQA attention over K/V gathered from the paged pool by slot, through PyTorch's
scaled-dot-product attention: its flash / memory-efficient kernels on CUDA, its own kernels on
CPU, the same calls on both. A prefilling sequence is one call; every decoding sequence of a
batch shares one call, on CUDA the paged Triton kernel of ``kvtier.engine.decode_kernel``
(which reads the rows in place) where it applies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvtier.engine import decode_kernel

if TYPE_CHECKING:
    from kvtier.engine.batch import SeqSlots

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # torch without attention biases: an explicit mask instead
    causal_lower_right = None

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    DECODE_BACKENDS = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    """Backends a decode call may use: not cuDNN, whose per-call graph set-up measured 2.2 ms
    of CPU per call on an H200 (32 layers: 70 ms a step, against 13.5 ms of GPU work)."""
except ImportError:  # older torch: its default choice
    sdpa_kernel = None


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[C, kv_heads, d]`` → ``[heads, C, d]``: query head ``h`` reads kv head
    ``h // (heads // kv_heads)``. A view when every head has its own kv head."""
    c, kv_heads, d = x.shape
    xt = x.transpose(0, 1)
    if kv_heads == heads:
        return xt
    # Copied, not broadcast: the fused kernels take equal head counts on every torch version.
    return xt[:, None].expand(kv_heads, heads // kv_heads, c, d).reshape(heads, c, d)


def causal_mask(n: int, c: int, device: torch.device) -> object:
    """What lets the last ``n`` of ``c`` positions see positions up to their own (the causal
    mask aligned to the bottom right): a ``CausalBias`` where torch has one (the fused kernels
    take it without a materialised mask), else a boolean ``[n, c]`` mask."""
    if causal_lower_right is not None:
        return causal_lower_right(n, c)
    return torch.ones(n, c, dtype=torch.bool, device=device).tril(diagonal=c - n)


def paged_attention(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, q_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal GQA attention of one sequence.

    ``q`` is ``[n, heads, d]``; ``k_ctx``/``v_ctx`` are ``[C, kv_heads, d]`` holding positions
    ``0 .. C-1`` (``C >= n``). The queries are the context's last ``n`` positions (new tokens
    after their prefix): query ``i`` is at position ``C - n + i`` (``q_pos``, not read: the
    positions follow from the shapes, so the device is never synchronised) and sees context
    positions up to its own. Returns ``[n, heads, d]`` in ``q``'s dtype.
    """
    n, heads, d = q.shape
    c = k_ctx.shape[0]
    if n == 1:  # the context's last position sees all of it
        return decode_attention(q, k_ctx[None], v_ctx[None], None)
    k_ctx, v_ctx = k_ctx.to(q.dtype), v_ctx.to(q.dtype)
    qh = q.transpose(0, 1)[None]
    kh, vh = expand_heads(k_ctx, heads)[None], expand_heads(v_ctx, heads)[None]
    if c == n:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_mask(n, c, q.device))
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """One query per sequence, at its context's last position, for ``B`` sequences at once.

    ``q`` is ``[B, heads, d]``; ``k``/``v`` are ``[B, C, kv_heads, d]``, sequence ``b``'s
    context in its rows where ``visible[b]`` (``[B, C]`` bool; ``None``: every row) is true.
    Rows not visible must hold finite values (a masked row weighs exactly zero). Returns
    ``[B, heads, d]`` in ``q``'s dtype.
    """
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    # A kv head's query heads become its query rows: one query position per sequence, so they
    # share one mask, and K/V are read once per kv head instead of once per query head.
    qg = q.reshape(b, kv_heads, heads // kv_heads, d)
    kh, vh = k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)
    mask = None if visible is None else visible[:, None, None, :]
    if sdpa_kernel is None or not q.is_cuda:
        out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask)
    else:
        with sdpa_kernel(DECODE_BACKENDS):
            out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask)
    return out.reshape(b, heads, d)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Where a batch's decoding sequences (``num_new == 1``) read their K/V rows.

    ``rows``: their tokens' indices among the batch's ``T`` (ascending) on the device, ``None``
    when they are ``0 .. B-1``; ``locs``:
    ``[B, C_max]`` pool slots, sequence ``b``'s context then its first slot repeated (a row it
    owns, hence finite); ``visible``: ``[B, C_max]`` which of them are its context (``None``:
    every sequence has ``C_max`` positions); ``lens``: int32 ``[B]``, the contexts' lengths
    (``None`` likewise)."""

    rows: torch.Tensor | None
    locs: torch.Tensor
    visible: torch.Tensor | None
    lens: torch.Tensor | None = None


def decode_plan(seqs: Sequence[SeqSlots], device: torch.device) -> DecodePlan | None:
    """The plan of ``seqs``' decoding sequences; ``None`` when none decodes."""
    rows, locs, start = [], [], 0
    for s in seqs:
        if s.num_new == 1:  # positions from shapes: ctx_locs' last row is the query's
            rows.append(start)
            locs.append(s.ctx_locs)
        start += s.num_new
    if not rows:
        return None
    rows_t = None if rows[-1] == len(rows) - 1 else torch.tensor(rows, device=device)
    lens = [int(x.shape[0]) for x in locs]
    if min(lens) == max(lens):
        return DecodePlan(rows_t, torch.stack(locs), None)
    padded = torch.nn.utils.rnn.pad_sequence(locs, batch_first=True, padding_value=-1)
    visible = padded >= 0
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return DecodePlan(rows_t, torch.where(visible, padded, padded[:, :1]), visible, lens_t)


_plan_cache: tuple[tuple[tuple[torch.Tensor, int], ...], DecodePlan | None] | None = None
"""The last batch's plan, keyed by its sequences' ``(ctx_locs, num_new)`` (the tensors held,
so their identities cannot be reused): every layer of a forward gets the same ones, and the
plan is built once per forward instead of once per layer."""


def use_decode_plan(seqs: Sequence[SeqSlots], plan: DecodePlan) -> None:
    """Make ``plan`` the one the next calls with exactly ``seqs`` use: for a forward whose
    slots are already on the device in plan form (``kvtier.engine.graphs``)."""
    global _plan_cache
    _plan_cache = (tuple((s.ctx_locs, s.num_new) for s in seqs), plan)


def cached_decode_plan(seqs: Sequence[SeqSlots], device: torch.device) -> DecodePlan | None:
    """``decode_plan(seqs, device)``, built once for consecutive calls with the same
    sequences (the same ``ctx_locs`` tensors, which nobody writes after building them, and the
    same ``num_new``)."""
    global _plan_cache
    key = tuple((s.ctx_locs, s.num_new) for s in seqs)
    entry = _plan_cache  # one read: another thread may replace the entry meanwhile
    if (
        entry is not None
        and len(entry[0]) == len(key)
        and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(entry[0], key, strict=True))
    ):
        return entry[1]
    plan = decode_plan(seqs, device)
    _plan_cache = (key, plan)
    return plan


def batched_attention(q: torch.Tensor, seqs: Sequence[SeqSlots], kv: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a batch: ``q`` ``[T, heads, d]``, the sequences' new queries
    concatenated in ``seqs`` order, each the last ``num_new`` positions of its context
    ``ctx_locs`` in the ``[rows, 2, kv_heads, d]`` layer ``kv``. Decoding sequences share one
    call (``decode_attention``); each other sequence is one call (``paged_attention``).
    Returns ``[T, heads, d]``."""
    plan = cached_decode_plan(seqs, q.device)
    dec = None
    if plan is not None:
        b, c = plan.locs.shape
        qd = q[:b] if plan.rows is None else q.index_select(0, plan.rows)
        if decode_kernel.available(qd, kv):  # reads rows in place: no gathered copy
            dec = decode_kernel.paged_decode(qd, kv, plan.locs, plan.lens)
        else:
            ctx = kv.index_select(0, plan.locs.reshape(-1)).view(b, c, *kv.shape[1:])
            dec = decode_attention(qd, ctx[:, :, 0], ctx[:, :, 1], plan.visible)
        if b == q.shape[0]:
            return dec
    out = torch.empty_like(q) if dec is not None or len(seqs) != 1 else None
    start = 0
    for s in seqs:
        end = start + s.num_new
        if s.num_new > 1:
            ctx = kv.index_select(0, s.ctx_locs)
            o = paged_attention(q[start:end], ctx[:, 0], ctx[:, 1])
            if out is None:  # the batch's one sequence: no copy into a batch-sized result
                return o
            out[start:end] = o
        start = end
    if out is None:  # one sequence without new tokens
        return q.new_empty(q.shape)
    if dec is not None:
        if plan.rows is None:
            out[: dec.shape[0]] = dec
        else:
            out.index_copy_(0, plan.rows, dec)
    return out
