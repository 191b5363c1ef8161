"""Greedy speculative decoding with a model's draft head (``kvtier.engine.mtp``).

A decode step of a greedy request with ``Work.spec_k = k`` (the scheduler reserved slots for
its last token and ``k`` more):

1. ``propose``: ``k`` autoregressive draft steps, batched over the step's requests; each reads
   and writes only the ``draft_kv`` component (rows ``num_computed .. num_computed + k - 1``).
2. The step's one target forward runs ``[last token, d_1 .. d_k]`` at positions
   ``n .. n + k`` (``n = num_computed``) and returns their ``k + 1`` logit rows.
3. ``accept``: the longest prefix of the draft agreeing with the target's greedy choices, then
   the target's own next token: between 1 and ``k + 1`` new tokens, exactly those plain greedy
   decoding produces. The rows of rejected positions are overwritten by later forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvtier.engine import cp
from kvtier.engine.batch import SeqSlots
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler import Work
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.parallel.group import Group


def check_option(speculative_tokens: Any, model: Any) -> int:
    """``speculative_tokens`` if the engine can speculate that far with ``model``; else
    ``ConfigError`` naming the option."""
    k = speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"speculative_tokens must be an integer >= 0 (0: off), got {k!r}")
    if k and not hasattr(model, "draft_step"):
        raise ConfigError(
            f"speculative_tokens={k} needs a model with a draft head (a dense config with "
            f"mtp_layers > 0, e.g. preset 'tiny-mtp'); {type(model).__name__} has none"
        )
    return k


@torch.inference_mode()
def propose(model: Any, kv: Any, work: list[Work]) -> None:
    """Fill ``w.draft`` with ``w.spec_k`` greedy draft tokens for every item that has one.

    Step ``i`` of a request with ``n = num_computed`` embeds its token at position ``n + i``
    (the last real token at step 0, then the previous draft token) together with the target's
    hidden state ``h_{n-1}`` at step 0 and the head's own output after that."""
    items = [w for w in work if w.spec_k > 0]
    if not items:
        return
    dev = model.device
    base = [w.req.num_computed for w in items]
    group = cp.cp_group(kv)
    if group is None:
        # physical slots up to the last draft row of each request (reserved by the scheduler)
        phys = [kv.slots(w.req.locs[: w.req.num_computed + w.spec_k]).to(dev) for w in items]
        last_rows = torch.stack([p[n - 1] for p, n in zip(phys, base, strict=True)])
        h_prev = model.hidden_rows(kv, last_rows)

        def seq(i: int, p: int) -> SeqSlots:
            return SeqSlots(1, phys[i][p : p + 1], phys[i][: p + 1])

    else:
        # this rank's rows only; h_{n-1} comes from the rank holding its page
        locs = [w.req.locs[: n + w.spec_k] for w, n in zip(items, base, strict=True)]
        ctx = [cp.seq_slots(kv, lc[:n], n - 1, dev) for lc, n in zip(locs, base, strict=True)]
        h_prev = model.hidden_at(kv, ctx, [n - 1 for n in base])

        def seq(i: int, p: int) -> SeqSlots:
            return cp.seq_slots(kv, locs[i][: p + 1], p, dev)

    toks = [w.req.tokens[n] for w, n in zip(items, base, strict=True)]
    active = list(range(len(items)))
    for step in range(max(w.spec_k for w in items)):
        pos = [base[i] + step for i in active]
        seqs = [seq(i, p) for i, p in zip(active, pos, strict=True)]
        logits, g = model.draft_step(
            torch.tensor([toks[i] for i in active], dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            seqs,
            kv,
            h_prev,
        )
        for i, d in zip(active, logits.argmax(-1).tolist(), strict=True):
            items[i].draft.append(d)
            toks[i] = d
        keep = [j for j, i in enumerate(active) if items[i].spec_k > step + 1]
        active = [active[j] for j in keep]
        h_prev = g[keep]
    for w in items:
        w.num_new = 1 + len(w.draft)


def agree_drafts(group: Group | None, work: list[Work]) -> None:
    """Make every CP rank verify the same drafts: each item's draft becomes the elementwise
    minimum over the group (any token list is a valid draft: verification keeps only what the
    target agrees with), and an item without a draft on some rank (its proposal failed
    there) decodes one token on every rank. Ranks with equal merged logits already propose
    equal drafts; this makes it a decision rather than a coincidence. Without CP: nothing."""
    if group is None:
        return
    items = [w for w in work if w.spec_k > 0]
    flat = [t for w in items for t in (w.draft if len(w.draft) == w.spec_k else [-1] * w.spec_k)]
    agreed = group.all_reduce_min_many(flat)
    at = 0
    for w in items:
        d = agreed[at : at + w.spec_k]
        at += w.spec_k
        w.draft = d if min(d) >= 0 else []
        w.num_new = 1 + len(w.draft)


def agree_tokens(
    group: Group | None, sampled: list[list[int]], widths: list[int]
) -> list[list[int]]:
    """The tokens every CP rank appends per item, from each rank's ``sampled`` (an item's
    ``accept`` result, ``[-1]`` where it failed) and ``widths`` (its draft length, equal on
    every rank after :func:`agree_drafts`), in one MIN-reduce: the accepted count is the
    smallest any rank accepted, every token up to it the minimum over ranks (they are the
    agreed draft's up to the last, which each rank holds at that place), so a rank that
    failed (``-1``) makes the item fail everywhere. Without CP: ``sampled``."""
    if group is None:
        return sampled
    unset = 2**62  # a place past a rank's accepted tokens: never the minimum
    flat: list[int] = []
    for t, k in zip(sampled, widths, strict=True):
        flat += [len(t) - 1, *t, *[unset] * (k + 1 - len(t))]
    agreed = group.all_reduce_min_many(flat)
    out, at = [], 0
    for k in widths:
        a = agreed[at]
        out.append(agreed[at + 1 : at + a + 2])
        at += k + 2
    return out


def accept(w: Work, rows: torch.Tensor) -> list[int]:
    """The tokens a verified item appends: the agreeing prefix of ``w.draft`` and the target's
    next token, chosen from ``rows`` (its ``1 + len(draft)`` CPU logit rows) by the request's
    own (greedy) sampler, so they equal what decoding one token at a time gives. Counts the
    request's proposed and accepted draft tokens and keeps the logits of each new token."""
    req = w.req
    out: list[int] = []
    for i, row in enumerate(rows):
        tok = sample(row, req.params, req.generator)
        req.record_logits(row)
        out.append(tok)
        if i == len(w.draft) or tok != w.draft[i]:
            break
    req.draft_proposed += len(w.draft)
    req.draft_accepted += len(out) - 1
    return out
