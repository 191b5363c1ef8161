"""Logical → physical page translation, applied only at the transfer boundary (contract 1)."""

from __future__ import annotations

from typing import Protocol

import torch


class PageTranslator(Protocol):
    def device_physical(self, pages: torch.Tensor) -> torch.Tensor:
        """Physical device page ids for logical ``pages``."""
        ...


class IdentityTranslator:
    """The plain allocator: logical page ids are physical page ids."""

    def device_physical(self, pages: torch.Tensor) -> torch.Tensor:
        return pages
