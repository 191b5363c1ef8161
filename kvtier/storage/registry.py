"""Backends by name. A factory receives the cache configuration and the key namespace."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.config import CacheConfig
    from kvtier.keys import Namespace
    from kvtier.storage.base import StorageBackend

BackendFactory = Callable[["CacheConfig", "Namespace"], "StorageBackend"]

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory`` available as ``CacheConfig.storage=name``."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Registered backend names, sorted."""
    _register_builtins()
    return sorted(_REGISTRY)


def create_backend(name: str, config: CacheConfig, namespace: Namespace) -> StorageBackend:
    """Instantiate backend ``name``; an unknown name is a ``ConfigError`` listing the known ones."""
    _register_builtins()
    if name not in _REGISTRY:
        raise ConfigError(
            f"storage={name!r} is not a registered backend ({', '.join(sorted(_REGISTRY))})"
        )
    return _REGISTRY[name](config, namespace)


def _register_builtins() -> None:
    if "file" not in _REGISTRY:
        from kvtier.storage.file import FileBackend

        register_backend("file", FileBackend.from_config)
    if "mooncake" not in _REGISTRY:
        register_backend("mooncake", _mooncake)


def _mooncake(config: CacheConfig, namespace: Namespace) -> StorageBackend:
    # Imported on use: the Mooncake client is an optional dependency.
    from kvtier.storage.mooncake import MooncakeBackend

    return MooncakeBackend.from_config(config, namespace)
