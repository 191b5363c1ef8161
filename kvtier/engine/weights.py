"""HF safetensors checkpoints for the Llama/Qwen family: load into ``CausalLM``, save from it,
and an optional tokenizer (only when the ``tokenizers`` package happens to be installed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtier.engine.config import ModelConfig
from kvtier.engine.model import CausalLM
from kvtier.errors import ConfigError

_INDEX = "model.safetensors.index.json"


class CheckpointError(ConfigError):
    """A checkpoint does not match its architecture; the message names the tensor(s)."""


def _ignored(name: str) -> bool:
    # Older exports store RoPE's inverse frequencies; they are derived from the config here.
    return name.endswith("rotary_emb.inv_freq")


def _shard_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at ``path`` into ``model`` (cast to its dtype).

    Raises ``CheckpointError`` naming the tensor on an unexpected, duplicated or wrongly shaped
    tensor, and naming the missing ones when some parameter was not in the checkpoint.
    """
    path = Path(path)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _ignored(name):
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: some exports store the shared matrix twice
                if name not in params:
                    raise CheckpointError(f"{file.name}: unexpected tensor {name!r}")
                if name in seen:
                    raise CheckpointError(f"{file.name}: tensor {name!r} appears twice")
                tensor = f.get_tensor(name)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing}")


def load_model(
    path: str | Path, device: torch.device | str | None = None, dtype: str | None = None
) -> CausalLM:
    """Build the model a HF checkpoint directory describes and load its weights."""
    config = ModelConfig.from_hf(path, dtype=dtype)
    model = CausalLM(config)
    load_weights(model, path)
    return model.to(device) if device is not None else model


def save_hf_checkpoint(
    model: CausalLM, path: str | Path, max_shard_bytes: int | None = None
) -> None:
    """Write ``config.json`` and safetensors weights that ``load_model`` (and HF) can read.

    With ``max_shard_bytes``, tensors are split over ``model-0000i-of-0000n.safetensors`` files
    plus ``model.safetensors.index.json``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / _INDEX).write_text(json.dumps(index, indent=2))


class Tokenizer:
    """Text <-> token ids through a ``tokenizer.json`` (needs the ``tokenizers`` package)."""

    def __init__(self, file: Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The directory's tokenizer, or ``None`` without ``tokenizer.json`` or ``tokenizers``."""
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    try:
        return Tokenizer(file)
    except ImportError:
        return None
