"""Context-parallel (CP) attention pieces of the reference engine.

Under context parallelism a sequence's KV pages are spread over the ranks of a CP group (page
``i`` on rank ``layout.owner(i)``; ``kvtier.parallel.layout``), and a rank's device pool holds
only its lane's pages. Every rank runs the same model on the same tokens, but

* writes the new tokens' rows only into the slots whose page it holds (:func:`seq_slots`);
* attends, per query, over the context rows it holds only, producing a *partial*: the output
  over its visible local columns and their log-sum-exp (``lse``, ``-inf`` when none is visible,
  the output then 0; :func:`softmax_partial`);
* exchanges the partials with ``group.all_gather`` and merges them in rank order
  (:func:`merge_partials`), so every rank holds bitwise-identical outputs for the next layer.

Sparse selections (the DSA indexer's top-k) must be the same on every rank: each rank scores
its own columns into a full ``-inf`` matrix, and :func:`gather_max` combines them (columns are
disjoint) before every rank runs the same top-k.

Without a CP group (``kv.group`` is ``None`` or of size 1) none of this runs: the engine's
single-rank path is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.engine.batch import SeqSlots
from kvtier.errors import ConfigError, IntegrityError, RequestError

if TYPE_CHECKING:
    from kvtier.parallel.group import Group

QUERY_CHUNK = 1024
"""Queries per attention block in long prefills under context parallelism."""


def cp_group(kv: object) -> Group | None:
    """The CP group ``kv`` (a ``DeviceKV``) is a shard of, or ``None`` without context
    parallelism (no group, or a group of one rank)."""
    group = getattr(kv, "group", None)
    if group is None or group.size <= 1:
        return None
    return group


def check_supported(model: Any, group: Group | None) -> None:
    """Raise ``ConfigError`` when ``model`` cannot run sharded over ``group`` (a model whose
    class says ``supports_cp = False``: recurrent state or sliding windows)."""
    if group is None or group.size <= 1 or getattr(model, "supports_cp", False):
        return
    family = getattr(getattr(model, "config", None), "family", type(model).__name__)
    raise ConfigError(
        f"model family {family!r} ({type(model).__name__}) does not support context "
        f"parallelism: cp_size={group.size} needs cp_size=1 for this family"
    )


def seq_slots(kv: Any, locs: torch.Tensor, start: int, device: torch.device) -> SeqSlots:
    """This rank's ``SeqSlots`` for a sequence whose logical slots are ``locs`` (the whole
    context, cached prefix and new tokens), the new tokens being ``locs[start:]``.

    ``ctx_locs`` are the physical slots of the context rows this rank holds, ``ctx_cols`` their
    positions (ascending); ``out_locs``/``out_rows`` the physical slots and indices (among the
    new tokens) of the new tokens this rank writes. ``ctx_locs[-len(out_locs):] == out_locs``
    still holds, since the new tokens are the context's last positions.
    """
    flat = locs.reshape(-1).cpu().long()
    owned = kv.owned(flat)
    if owned is None:  # a pool holding every page: all columns are local
        owned = torch.ones(flat.shape[0], dtype=torch.bool)
    cols = torch.nonzero(owned.cpu()).reshape(-1)
    phys = kv.slots(flat.index_select(0, cols)).to(device, non_blocking=True)
    new_rows = cols[cols >= start] - start
    n_out = new_rows.shape[0]
    return SeqSlots(
        flat.shape[0] - start,
        phys[phys.shape[0] - n_out :],
        phys,
        ctx_cols=cols.to(device),
        out_rows=new_rows.to(device),
        context_len=flat.shape[0],
    )


def batch_out_rows(seqs: Any) -> torch.Tensor:
    """Indices into the batch's tokens of the rows this rank writes (aligned with the
    concatenated ``out_locs``): each sequence's ``out_rows`` offset by the tokens before it."""
    rows, offset = [], 0
    for s in seqs:
        r = s.out_rows if s.out_rows is not None else torch.arange(s.num_new)
        rows.append(r.to(s.out_locs.device) + offset)
        offset += s.num_new
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)


def group_slots(s: SeqSlots, first: int, last: int, g: int) -> torch.Tensor:
    """``[groups, g]`` physical slots of the ``g``-token groups ``first .. last - 1`` of ``s``
    that this rank holds (all of them without CP). A group lies inside one page (pages are
    multiples of ``g``), so a rank holds all of a group's tokens or none."""
    if s.ctx_cols is None:
        return s.ctx_locs[first * g : last * g].view(last - first, g)
    # position -> this rank's slot (-1: held by another rank)
    by_pos = torch.full((s.seq_len,), -1, dtype=torch.int64, device=s.ctx_locs.device)
    by_pos[s.ctx_cols] = s.ctx_locs
    slots = by_pos[first * g : last * g].view(last - first, g)
    return slots[slots[:, 0] >= 0]


def local_visible(s: SeqSlots, q_pos: torch.Tensor) -> torch.Tensor:
    """Bool ``[n, C_local]``: causal visibility of this rank's context rows to the queries."""
    return require_cols(s)[None, :] <= q_pos[:, None]


def softmax_partial(
    scores: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, lse)`` of ``scores`` (``[..., n, c]``, float32 or wider) over the ``visible``
    columns (broadcast to ``scores``): ``probs = exp(scores - lse)``, 0 where not visible, and
    ``lse`` the log-sum-exp over the visible columns (``[..., n]``), ``-inf`` (all ``probs``
    0, no NaN) for a row without one."""
    masked = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    # a row with no visible column: subtract 0 so exp(-inf) gives 0 instead of exp(nan)
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    return torch.exp(masked - safe[..., None]), lse


def partial_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    q_pos: torch.Tensor,
    cols: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's part of ``paged_attention`` under context parallelism: ``k_ctx``/``v_ctx``
    hold only the context rows at positions ``cols``. Returns ``(out [n, heads, d], lse [n,
    heads])``, ``out`` over the visible local rows and ``lse`` their log-sum-exp (float32,
    ``-inf`` with ``out`` 0 for a query that sees none); ``merge_partials`` combines them."""
    n, heads, d = q.shape
    if n > QUERY_CHUNK:
        # bounded memory (QUERY_CHUNK x local context scores) for long prefills
        parts = [
            partial_attention(
                q[lo : lo + QUERY_CHUNK], k_ctx, v_ctx, q_pos[lo : lo + QUERY_CHUNK], cols
            )
            for lo in range(0, n, QUERY_CHUNK)
        ]
        return torch.cat([o for o, _ in parts]), torch.cat([x for _, x in parts])
    kv_heads = k_ctx.shape[1]
    qg = q.view(n, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("nkgd,ckd->kgnc", qg, k_ctx) * (1.0 / math.sqrt(d))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    probs, lse = softmax_partial(scores, cols[None, :] <= q_pos[:, None])
    out = torch.einsum("kgnc,ckd->nkgd", probs.to(v_ctx.dtype), v_ctx).reshape(n, heads, d)
    return out, lse.permute(2, 0, 1).reshape(n, heads).float()


def dense_attention(
    q: torch.Tensor,
    positions: torch.Tensor,
    seqs: Sequence[SeqSlots],
    kv: torch.Tensor,
    group: Group,
) -> torch.Tensor:
    """Dense GQA attention of a batch under CP: every sequence's partial over this rank's rows
    of the ``[rows, 2, kv_heads, d]`` layer ``kv``, merged over ``group`` in one exchange."""
    outs, lses, start = [], [], 0
    for s in seqs:
        end = start + s.num_new
        ctx = kv.index_select(0, s.ctx_locs)
        o, lse = partial_attention(
            q[start:end], ctx[:, 0], ctx[:, 1], positions[start:end], require_cols(s)
        )
        outs.append(o)
        lses.append(lse)
        start = end
    return merge_partials(group, torch.cat(outs), torch.cat(lses))[0]


def require_cols(s: SeqSlots) -> torch.Tensor:
    """``s.ctx_cols``; a CP forward of slots not built by :func:`seq_slots` is a
    ``RequestError``."""
    if s.ctx_cols is None:
        raise RequestError("a CP forward needs every sequence's ctx_cols (cp.seq_slots)")
    return s.ctx_cols


def merge_partials(
    group: Group, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial attention: ``out`` ``[T, H, D]`` (any float dtype) and its
    ``lse`` ``[T, H]`` (float32), the same shapes on every rank. Returns ``(out, lse)`` over
    the whole context: ``lse = logsumexp_r lse_r``, ``out = sum_r exp(lse_r - lse) * out_r``
    (in rank order), ``out`` in the input's dtype and device. Every rank gets bitwise the same
    result (the same gathered values, the same operations). A query no rank saw keeps out 0
    and lse ``-inf``."""
    wide = torch.promote_types(out.dtype, torch.float32)
    d = out.shape[-1]
    # one gather per call: the partial output and its lse travel as one tensor
    packed = torch.cat((out.to(wide), lse.to(wide)[..., None]), dim=-1).cpu()
    parts = group.all_gather(packed, "cp attention partials")
    lses = torch.stack([p[..., d] for p in parts])
    total = torch.logsumexp(lses, dim=0)
    safe = total.masked_fill(torch.isneginf(total), 0.0)
    merged = torch.zeros_like(parts[0][..., :d])
    for r, p in enumerate(parts):
        merged = merged + torch.exp(lses[r] - safe)[..., None] * p[..., :d]
    return merged.to(device=out.device, dtype=out.dtype), total.to(lse.device, torch.float32)


def owner_rows(
    group: Group, buf: torch.Tensor, seqs: Sequence[SeqSlots], positions: Sequence[int]
) -> torch.Tensor:
    """``[len(seqs), *row]``: the row of the component layer ``buf`` (``[slots, *row]``) at
    position ``positions[i]`` of sequence ``seqs[i]`` (from :func:`seq_slots`), on every rank.
    Each row is read on the one rank holding its page and shared in one gather; a negative
    position gives a zero row. Every rank gets bitwise the owner's values. A row held by no
    rank, or by several, is an ``IntegrityError`` naming the sequence and position."""
    n = len(seqs)
    if all(p < 0 for p in positions):  # the same on every rank: no gather
        return buf.new_zeros((n, *buf.shape[1:]))
    wide = torch.promote_types(buf.dtype, torch.float32)
    local = torch.zeros((n, 1 + buf[0].numel()), dtype=wide)
    for i, (s, p) in enumerate(zip(seqs, positions, strict=True)):
        hit = torch.nonzero(require_cols(s) == p).reshape(-1)
        if p >= 0 and hit.numel():
            local[i, 0] = 1.0
            local[i, 1:] = buf.index_select(0, s.ctx_locs[hit[:1]]).reshape(-1).to(wide).cpu()
    parts = torch.stack(group.all_gather(local, "cp owner rows"))
    held = parts[:, :, 0] > 0  # [ranks, n]
    counts = held.sum(0)
    for i, p in enumerate(positions):
        if int(counts[i]) != (1 if p >= 0 else 0):
            raise IntegrityError(
                f"cp owner rows: sequence {i} position {p} held by {int(counts[i])} ranks "
                f"(rank {group.rank} of {group.size})"
            )
    owner = held.to(torch.int8).argmax(0)  # the holding rank (rank 0 for a zero row)
    rows = parts[owner, torch.arange(n), 1:]
    return rows.to(device=buf.device, dtype=buf.dtype).reshape(n, *buf.shape[1:])


def gather_max(group: Group, full: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks of ``full`` (a score matrix each rank filled at its own
    columns and left ``-inf`` elsewhere): every rank gets the whole matrix."""
    parts = group.all_gather(full.cpu(), "cp indexer scores")
    return torch.stack(parts).amax(dim=0).to(full.device)


def scatter_cols(
    local: torch.Tensor, cols: torch.Tensor, width: int, fill: float = float("-inf")
) -> torch.Tensor:
    """``[n, width]`` filled with ``fill`` except at columns ``cols``, which take ``local``
    (``[n, len(cols)]``)."""
    full = torch.full((local.shape[0], width), fill, dtype=local.dtype, device=local.device)
    full[:, cols] = local
    return full
