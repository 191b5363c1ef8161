"""Storage-restore half of the family oracle, run in a fresh process.

Usage: python family_oracle_child.py FAMILY STORAGE_DIR CASE_FILE → prints JSON with the greedy
outputs, the tokens restored from storage, and whether the restored rows equal the originals.
"""

from __future__ import annotations

import json
import sys

import torch
from test_family_oracle import GREEDY, make_llm, snapshot


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
    outputs, storage_tokens = [], []
    for prompt in case["prompts"]:
        (out,) = llm.generate([prompt], GREEDY)
        outputs.append(list(out.output_ids))
        storage_tokens.append(out.cached_storage)
    storage_tokens.append(llm.cache.stats()["storage_hit_tokens"])
    llm.cache.drain()
    same = rows.keys() == case["rows"].keys()
    compared = {}
    for k in rows:
        n = min(rows[k].shape[1], case["rows"][k].shape[1])
        compared[k] = n
        a, b = rows[k][:, :n], case["rows"][k][:, :n]
        same = same and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    llm.close()
    print(
        json.dumps(
            {
                "outputs": outputs,
                "storage_tokens": storage_tokens,
                "rows_equal": same,
                "rows_compared": compared,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
