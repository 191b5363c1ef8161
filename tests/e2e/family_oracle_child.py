"""Storage-restore half of the family oracle, run in a fresh process.

Usage: python family_oracle_child.py FAMILY STORAGE_DIR CASE_FILE → prints JSON with the greedy
outputs, their max logit difference to the cold runs, the tokens restored from storage, and
whether the restored rows equal the originals.
"""

from __future__ import annotations

import json
import sys

import torch
from test_family_oracle import GREEDY, make_llm, max_logit_diff, rows_equal, snapshot

from kvtier.demo.oracle import Expected


def main(family: str, storage_dir: str, case_file: str) -> None:
    case = torch.load(case_file)
    llm = make_llm(family, storage_dir)
    # Restore the shared context from storage alone first and compare it before any request
    # recomputes (and rewrites) part of it.
    m = llm.cache.match(case["base"])
    pf = llm.cache.prefetch(m)
    pf.future.result()
    llm.cache.finish_prefetch(pf)
    rows = snapshot(llm, case["base"])
    outs, storage_tokens = [], []
    for prompt in case["prompts"]:
        (out,) = llm.generate([prompt], GREEDY)
        outs.append(out)
        storage_tokens.append(out.cached_storage)
    storage_tokens.append(llm.cache.stats()["storage_hit_tokens"])
    llm.cache.drain()
    same, compared = rows_equal(rows, case["rows"])
    llm.close()
    cold = [Expected(t, lg) for t, lg in zip(case["cold_tokens"], case["cold_logits"], strict=True)]
    outputs = [list(o.output_ids) for o in outs]
    # tokens are compared by the parent: a difference must show there, not as a crash here
    diff = max_logit_diff(outs, cold) if outputs == [e.tokens for e in cold] else float("inf")
    print(
        json.dumps(
            {
                "outputs": outputs,
                "max_logit_diff": diff,
                "storage_tokens": storage_tokens,
                "rows_equal": same,
                "rows_compared": compared,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
