"""Reference engine: a Llama/Qwen-style model whose attention reads K/V from kvtier's paged pool,
with a runner, a continuous-batching scheduler over ``TieredCache`` and an ``LLM`` front end."""

from kvtier.engine.batch import SeqSlots
from kvtier.engine.llm import LLM
from kvtier.engine.model import CausalLM
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.request import RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weights import CheckpointError, load_model, save_hf_checkpoint

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
