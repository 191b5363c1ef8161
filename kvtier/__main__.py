"""``python -m kvtier``: the ``kvtier`` command line (``kvtier.cli``)."""

from __future__ import annotations

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main())
