"""L3 storage: one backend contract (``base``), a registry of backends by name, and the
local ``file`` backend."""

from kvtier.storage.base import StorageBackend, StorageCapabilities
from kvtier.storage.registry import available_backends, create_backend, register_backend

__all__ = [
    "StorageBackend",
    "StorageCapabilities",
    "available_backends",
    "create_backend",
    "register_backend",
]
