"""Storage-restore half of the buffer-only oracle, run in a fresh process.

Usage: python buffer_oracle_child.py STORAGE_DIR CASE_FILE WRITTEN_FILE → prints JSON with the
greedy output, its max logit difference to the cold run, the tokens restored from storage (per
request and in the cache's stats), the tokens recomputed, whether the restored pages' KV bytes
equal the first run's, and the host pages still in use after a drain.
"""

from __future__ import annotations

import json
import sys

import torch
from test_buffer_only import GREEDY, HOST_PAGES, first_pages_bytes, make_llm

from kvtier.demo.oracle import Expected, compare


def main(storage_dir: str, case_file: str, written_file: str) -> None:
    case = torch.load(case_file)
    written = torch.load(written_file)
    llm = make_llm(storage_dir)
    (out,) = llm.generate([case["prompt"]], GREEDY)
    diff = compare(out.output_ids, out.logits, Expected(case["tokens"], case["logits"]))[1]
    llm.cache.drain()
    llm.cache.check_integrity()
    restored = first_pages_bytes(llm, case["prompt"], HOST_PAGES)
    stats = llm.cache.stats()
    llm.close()
    print(
        json.dumps(
            {
                "outputs": list(out.output_ids),
                "logit_diff": diff,
                "storage_tokens": out.cached_storage,
                "stats_storage_hit_tokens": stats["storage_hit_tokens"],
                "recomputed": out.recomputed,
                "restored_equal": bool(torch.equal(restored, written)),
                "host_pages_used": stats["host_pages_used"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
