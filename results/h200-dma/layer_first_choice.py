"""Both directions at once with a layer-first host, under variants of the mechanism choice:
``auto`` (as built), ``gain1`` (staging whenever its blocks are at least as large as direct
ones), ``copy_engine`` (every component forced to copy engines: staged where multi-layer),
``few64`` (copy-engine lists of up to 64 blocks queued as single copies). Every family, page
sizes from argv (default 1 16 64), 1 GiB per direction, churned host pages; VARIANTS (default
``auto gain1 copy_engine``) picks the variants, each run once per page size, interleaved. Prints
one line per family and variant; ``$OUT/layer_first_choice.json``."""

from __future__ import annotations

import json
import os
import sys

from kvtier.bench.pool_sets import FAMILIES
from kvtier.bench.transfer import bench_transfer
from kvtier.transfer import dma, mechanisms, plan

OUT = os.environ.get("OUT", "/tmp")
built = mechanisms.choose
BUILT_GAIN, BUILT_FEW = plan.STAGE_GAIN, dma.FEW_BLOCKS


def forced(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    kwargs["mechanism"] = "copy_engine"
    return built(*args, **kwargs)


def gain1(geo, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    plan.STAGE_GAIN = 1
    try:
        return built(geo, *args, **kwargs)
    finally:
        plan.STAGE_GAIN = BUILT_GAIN


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1, 16, 64]
    variants = os.environ.get("VARIANTS", "auto gain1 copy_engine").split()
    results: dict = {}
    for ps in sizes:
        for variant in variants:
            mechanisms.choose = {"copy_engine": forced, "gain1": gain1}.get(variant, built)
            dma.FEW_BLOCKS = 64 if variant == "few64" else BUILT_FEW
            for fam in FAMILIES:
                run = bench_transfer(
                    page_size=ps, family=fam, host_layout="layer_first", target_mib=1024
                )
                cell = {d: run[d] for d in ("d2h", "h2d", "both") if run.get(d)}
                results.setdefault(f"{fam} ps{ps}", {})[variant] = cell
                print(
                    f"{fam:16s} ps {ps:3d} {variant:12s}",
                    *(f"{d} {c['ratio']:.3f} {c['paths']}" for d, c in cell.items()),
                    flush=True,
                )
    mechanisms.choose, dma.FEW_BLOCKS = built, BUILT_FEW
    with open(os.path.join(OUT, "layer_first_choice.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
