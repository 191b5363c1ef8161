"""One line per family of ``kvtier bench transfer`` JSON files: GB/s and ratio of each direction
alone and both at once, with the paths taken.

    python3 scripts/probes/transfer_summary.py FILE...
"""

from __future__ import annotations

import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        r = json.load(f)
    runs = r["families"].items() if "families" in r else [(path.rsplit("/", 1)[-1], r)]
    for name, run in runs:
        cells = [
            f"{d} {run[d]['gbps']:.1f} ({run[d]['ratio']:.2f}) {run[d]['paths']}"
            for d in ("d2h", "h2d", "both")
            if run.get(d)
        ]
        print(f"{name:16s} page {run['sizes']['page_size']:3d}", *cells)
