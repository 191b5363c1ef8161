"""Model families beyond the dense decoder (MLA, sparse attention with an indexer, hybrid
recurrent, sliding window) and the registry that maps preset names and configs to models."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError

# preset name -> (config factory's module, config factory name, model class); modules import
# lazily so a family's code loads only when it is used (its model code only when a model is
# built).
_PRESETS: dict[str, tuple[str, str, str]] = {
    "tiny": ("kvtier.engine.model_config", "tiny_dense", "kvtier.engine.model:CausalLM"),
    "tiny-mtp": ("kvtier.engine.mtp", "tiny_mtp_preset", "kvtier.engine.mtp:MTPCausalLM"),
    "small": ("kvtier.engine.model_config", "small_dense", "kvtier.engine.model:CausalLM"),
    "mla": (
        "kvtier.engine.families.mla_config",
        "mla_preset",
        "kvtier.engine.families.mla:MLAModel",
    ),
    "dsa": (
        "kvtier.engine.families.mla_config",
        "dsa_preset",
        "kvtier.engine.families.mla:MLAModel",
    ),
    "dsa-compressed": (
        "kvtier.engine.families.mla_config",
        "dsa_compressed_preset",
        "kvtier.engine.families.mla:MLAModel",
    ),
    "hybrid": (
        "kvtier.engine.families.hybrid_config",
        "hybrid_preset",
        "kvtier.engine.families.hybrid:HybridModel",
    ),
    "swa": (
        "kvtier.engine.families.swa_config",
        "swa_preset",
        "kvtier.engine.families.swa:SWAModel",
    ),
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def preset(name: str, **overrides: Any) -> Any:
    """The config of preset ``name`` (a family's frozen config dataclass)."""
    if name not in _PRESETS:
        raise ConfigError(f"model preset {name!r} is not one of {', '.join(_PRESETS)}")
    module, factory, _ = _PRESETS[name]
    make: Callable[..., Any] = getattr(importlib.import_module(module), factory)
    return make(**overrides)


def build_model(config: Any) -> Any:
    """The model for ``config`` (its family is the config's type; a dense config with a draft
    head, ``mtp_layers > 0``, gets the dense model with that head)."""
    if getattr(config, "mtp_layers", 0):
        return _load("kvtier.engine.mtp:MTPCausalLM")(config)
    for _, _, model_path in _PRESETS.values():
        cls = _load(model_path)
        if isinstance(config, cls.config_class):
            return cls(config)
    raise ConfigError(f"no model family takes a {type(config).__name__}")
