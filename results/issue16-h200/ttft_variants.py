"""`kvtier bench ttft` with one piece of the engine switched off, to find what moves the
per-layer-overlap TTFT: VARIANT=cpu_read (logits read with a plain ``.cpu()``) or
VARIANT=no_triton (Triton hidden: no decode kernel, no graphs)."""

from __future__ import annotations

import os
import sys

variant = os.environ.get("VARIANT", "")
if variant == "no_triton":
    sys.modules["triton"] = None  # import triton -> ImportError
from kvtier.engine import runner  # noqa: E402

if variant == "cpu_read":
    runner._to_host = lambda t: t.cpu()
from kvtier.cli import main  # noqa: E402

sys.exit(main(["bench", "ttft", *sys.argv[1:]]))
