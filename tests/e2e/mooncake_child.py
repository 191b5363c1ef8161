"""An engine process on a Mooncake cluster: runs prompts, prints what it saw as JSON.

Usage: python mooncake_child.py FAMILY STORAGE_URL CASE_FILE
CASE_FILE (torch.save) holds ``prompts`` (run and reported) and optionally ``write`` (prompts
run afterwards so their pages reach the store before the process exits).
"""

from __future__ import annotations

import json
import sys

import torch
from test_mooncake_e2e import GREEDY, make_llm


def main(family: str, url: str, case_file: str) -> None:
    case = torch.load(case_file)
    llm = make_llm(family, url)
    outputs, storage_tokens = [], []
    for prompt in case["prompts"]:
        (out,) = llm.generate([prompt], GREEDY)
        outputs.append(list(out.output_ids))
        storage_tokens.append(out.cached_storage)
    for prompt in case.get("write", []):
        llm.generate([prompt], GREEDY)
    llm.cache.drain()
    stats = llm.cache.stats()
    llm.close()
    print(
        json.dumps(
            {
                "outputs": outputs,
                "storage_tokens": storage_tokens,
                "backed_up": stats["storage_backup_pages"],
                "errors": stats.get("storage_errors", {}),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
