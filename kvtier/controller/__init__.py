"""The one owner of page movement and visibility: write policies, device → host → storage
backups, host → device loads, storage → host prefetches and the L3 I/O thread."""

from kvtier.controller.core import Controller
from kvtier.controller.records import PrefetchOp

__all__ = ["Controller", "PrefetchOp"]
