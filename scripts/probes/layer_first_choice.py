"""Both directions at once with a layer-first host: the mechanism choice as built (``auto``),
staging whenever its blocks are at least as large as direct ones (``STAGE_GAIN`` 1), and every
component forced to copy engines (``copy_engine``: staged where multi-layer). Every family,
page sizes from argv (default 1 16 64), 1 GiB per direction, churned host pages. Prints one line
per family and variant; ``$OUT/layer_first_choice.json``."""

from __future__ import annotations

import json
import os
import sys

from kvtier.bench.transfer import bench_transfer
from kvtier.transfer import mechanisms, plan

OUT = os.environ.get("OUT", "/tmp")
built = mechanisms.choose


def forced(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    kwargs["mechanism"] = "copy_engine"
    return built(*args, **kwargs)


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1, 16, 64]
    results: dict = {}
    for ps in sizes:
        for variant in ("auto", "gain1", "copy_engine"):
            plan.STAGE_GAIN = 1 if variant == "gain1" else 8
            mechanisms.choose = forced if variant == "copy_engine" else built
            r = bench_transfer(
                page_size=ps, family="all", host_layout="layer_first", target_mib=1024
            )
            for fam, run in r["families"].items():
                cell = {d: run[d] for d in ("d2h", "h2d", "both") if run.get(d)}
                results.setdefault(f"{fam} ps{ps}", {})[variant] = cell
                print(
                    f"{fam:16s} ps {ps:3d} {variant:12s}",
                    *(f"{d} {c['ratio']:.3f} {c['paths']}" for d, c in cell.items()),
                    flush=True,
                )
    plan.STAGE_GAIN = 8
    mechanisms.choose = built
    with open(os.path.join(OUT, "layer_first_choice.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
