"""Turns a scheduled batch into one model forward and samples each sequence's next token."""

from __future__ import annotations

import torch

from kvtier.engine.model import CausalLM, KVBuffers, SeqSlots
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler import Work


class ModelRunner:
    """Flattens ``Work`` items into ``input_ids``/``positions``/``SeqSlots`` and runs the model
    against the device pool ``kv``."""

    def __init__(self, model: CausalLM, kv: KVBuffers) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device

    def run(self, work: list[Work]) -> list[int]:
        """One forward over ``work``; returns the sampled next token of each item, in order."""
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlots] = []
        for w in work:
            req = w.req
            assert req.locs is not None
            start, end = req.num_computed, req.num_computed + w.num_new
            ids.extend(req.tokens[start:end])
            positions.extend(range(start, end))
            ctx = req.locs[:end].to(self.device, non_blocking=True)
            seqs.append(SeqSlots(w.num_new, ctx[start:], ctx))
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            seqs,
            self.kv,
        ).cpu()
        return [sample(logits[i], w.req.params, w.req.generator) for i, w in enumerate(work)]
