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

from typing import Any

import torch

from kvtier.engine.batch import SeqSlots
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler import Work
from kvtier.errors import ConfigError


def check_option(speculative_tokens: Any, model: Any, cp_size: int) -> int:
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
    if k and cp_size > 1:
        raise ConfigError(
            f"speculative_tokens={k} is not supported with context parallelism "
            f"(cp_size={cp_size}); use speculative_tokens=0"
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
    # physical slots up to the last draft row of each request (reserved by the scheduler)
    phys = [kv.slots(w.req.locs[: w.req.num_computed + w.spec_k]).to(dev) for w in items]
    base = [w.req.num_computed for w in items]
    last_rows = torch.stack([p[n - 1] for p, n in zip(phys, base, strict=True)])
    h_prev = model.hidden_rows(kv, last_rows)
    toks = [w.req.tokens[n] for w, n in zip(items, base, strict=True)]
    active = list(range(len(items)))
    for step in range(max(w.spec_k for w in items)):
        pos = [base[i] + step for i in active]
        seqs = [
            SeqSlots(1, phys[i][p : p + 1], phys[i][: p + 1])
            for i, p in zip(active, pos, strict=True)
        ]
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
