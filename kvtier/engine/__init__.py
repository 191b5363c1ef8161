"""Reference engine: a Llama/Qwen-style model whose attention reads K/V from kvtier's paged pool,
with a runner, a continuous-batching scheduler over ``TieredCache`` and an ``LLM`` front end.

The names below load on first use (PEP 562), so that a process needing only a light piece of
the engine (``kvtier route`` and its byte tokenizer) does not load the model code and torch's
kernels with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.engine.batch import SeqSlots
    from kvtier.engine.llm import LLM
    from kvtier.engine.model import CausalLM
    from kvtier.engine.model_config import ModelConfig
    from kvtier.engine.request import RequestOutput
    from kvtier.engine.sampling import SamplingParams
    from kvtier.engine.weights import CheckpointError, load_model, save_hf_checkpoint

_HOMES = {
    "CausalLM": "kvtier.engine.model",
    "CheckpointError": "kvtier.engine.weights",
    "LLM": "kvtier.engine.llm",
    "ModelConfig": "kvtier.engine.model_config",
    "RequestOutput": "kvtier.engine.request",
    "SamplingParams": "kvtier.engine.sampling",
    "SeqSlots": "kvtier.engine.batch",
    "load_model": "kvtier.engine.weights",
    "save_hf_checkpoint": "kvtier.engine.weights",
}
"""Where each exported name is defined."""

__all__ = [
    "CausalLM",
    "CheckpointError",
    "LLM",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SeqSlots",
    "load_model",
    "save_hf_checkpoint",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtier.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
