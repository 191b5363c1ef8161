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
    key = None
    if config.storage_encryption:  # the key first: a missing key fails before the store opens
        from kvtier.storage.encrypted import load_master_key, tenant_key

        key = tenant_key(load_master_key(config.storage_key_file), config.tenant_salt)
    backend = _REGISTRY[name](config, namespace)
    if key is None:
        return backend
    from kvtier.storage.encrypted import EncryptedBackend

    try:
        return EncryptedBackend(backend, key, namespace)
    except ConfigError:
        backend.close()
        raise


def check_capabilities(backend: StorageBackend, config: CacheConfig, tree_page: int) -> None:
    """Gate features on what ``backend`` declares (contract 9); refuse a namespace that
    is not bound to the model's weights unless the config accepts one (contract 7)."""
    if not config.model_fingerprint and not config.unbound_namespace:
        raise ConfigError(
            f"storage={backend.name!r} without model_fingerprint: every model sharing the "
            "store would read the others' KV. Set model_fingerprint (LLM does) or "
            "unbound_namespace=True for a store only one model uses"
        )
    if tree_page != config.page_size and not backend.capabilities.page_spans:
        raise ConfigError(
            f"storage backend {backend.name!r} does not support page spans, but this "
            f"model's tree page is {tree_page} tokens ({tree_page // config.page_size}"
            f" pages of page_size={config.page_size}): one storage object must span them"
        )


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
