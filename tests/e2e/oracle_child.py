"""Storage-restore half of the content oracle, run in a fresh process.

Usage: python oracle_child.py STORAGE_DIR CASE_FILE → prints JSON with the greedy outputs, their
max logit difference to the cold runs, the tokens restored from storage, the cached tokens, and
whether the restored KV bytes (each prompt's, then the whole base) equal the originals.
"""

from __future__ import annotations

import json
import sys

import torch
from test_oracle import GREEDY, make_llm, prefix_kv, restored_prefix

from kvtier.demo.oracle import Expected, compare


def main(storage_dir: str, case_file: str) -> None:
    case = torch.load(case_file)
    llm = make_llm(storage_dir)
    outputs, diffs, pages_equal, storage_tokens, cached = [], [], [], [], []
    cold = [Expected(t, lg) for t, lg in zip(case["cold_tokens"], case["cold_logits"], strict=True)]
    for prompt, want, pages in zip(case["prompts"], cold, case["written"], strict=True):
        (out,) = llm.generate([prompt], GREEDY)
        outputs.append(list(out.output_ids))
        diffs.append(compare(out.output_ids, out.logits, want)[1])
        pages_equal.append(bool(torch.equal(restored_prefix(llm, prompt), pages)))
        storage_tokens.append(out.cached_storage)
        cached.append(out.cached_tokens)
    llm.cache.drain()
    restored = prefix_kv(llm, case["base"])
    same = bool(torch.equal(restored.view(torch.uint8), case["kv"].view(torch.uint8)))
    llm.close()
    print(
        json.dumps(
            {
                "outputs": outputs,
                "logit_diffs": diffs,
                "pages_equal": pages_equal,
                "storage_tokens": storage_tokens,
                "cached": cached,
                "kv_equal": same,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
