"""Batched page copies between the device pool and the host pool, on a side stream when on GPU.
Logical page ids are translated to physical ones here and nowhere else."""

from kvtier.transfer.mover import Mover
from kvtier.transfer.op import TransferOp
from kvtier.transfer.translate import (
    DeviceKV,
    IdentityTranslator,
    PageTranslator,
    PermutationTranslator,
)

__all__ = [
    "DeviceKV",
    "IdentityTranslator",
    "Mover",
    "PageTranslator",
    "PermutationTranslator",
    "TransferOp",
]
