"""HF safetensors checkpoints of the Llama/Qwen/Mistral decoders (dense or sliding-window): load
into ``CausalLM`` (or its sliding-window subclass), save from it, and an optional tokenizer
(only when the ``tokenizers`` package happens to be installed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvtier.engine.families import build_model
from kvtier.engine.hf_config import read_hf_config
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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid shard index ({e!r})") from e
        files = [path / f for f in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def _tensor_files(files: list[Path]) -> dict[str, Path]:
    """Which file holds each tensor (headers only: no tensor data is read)."""
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read the safetensors file ({e})") from e
        for name in names:
            if name in where and not _ignored(name):
                raise CheckpointError(f"{file.name}: tensor {name!r} appears twice")
            where[name] = file
    return where


def _get(file: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from e


def stores_separate_head(path: str | Path, dtype: torch.dtype) -> bool:
    """Whether the checkpoint at ``path`` holds an ``lm_head.weight`` that differs (at
    ``dtype``) from ``model.embed_tokens.weight``: transformers 5 then leaves the two untied
    whatever ``tie_word_embeddings`` says. (transformers 4 used the embeddings for both.)"""
    where = _tensor_files(_shard_files(Path(path)))
    head, embed = where.get("lm_head.weight"), where.get("model.embed_tokens.weight")
    if head is None or embed is None:
        return False
    a, b = _get(head, "lm_head.weight"), _get(embed, "model.embed_tokens.weight")
    return a.shape != b.shape or not torch.equal(a.to(dtype), b.to(dtype))


def _copy(param: torch.Tensor, tensor: torch.Tensor, file: Path, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at ``path`` into ``model`` (cast to its dtype).

    Raises ``CheckpointError`` naming the tensor on an unexpected, duplicated or wrongly shaped
    tensor, naming the missing ones when some parameter was not in the checkpoint, and naming
    the file when one is not a readable safetensors file. A tied model takes its embeddings
    from ``lm_head.weight`` when only that is stored (as transformers does).
    """
    path = Path(path)
    params = dict(model.named_parameters())
    where = _tensor_files(_shard_files(path))
    stored = {name: name for name in where if not _ignored(name)}
    if model.lm_head is None:
        if "model.embed_tokens.weight" not in where and "lm_head.weight" in where:
            stored["model.embed_tokens.weight"] = stored.pop("lm_head.weight")
        else:
            stored.pop("lm_head.weight", None)  # tied: exports may store the matrix twice
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, source in stored.items():
        if name not in params:
            raise CheckpointError(f"{where[source].name}: unexpected tensor {name!r}")
        by_file.setdefault(where[source], []).append((name, source))
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name, source in names:
                    _copy(params[name], f.get_tensor(source), file, source)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read the safetensors file ({e})") from e
    missing = sorted(set(params) - set(stored))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing}")


def load_model(
    path: str | Path, device: torch.device | str | None = None, dtype: str | None = None
) -> CausalLM:
    """Build the model a HF checkpoint directory describes and load its weights: the dense
    decoder, the sliding-window family (``SWAModel``) where layers slide, or the MLA family
    for ``deepseek_v3`` (``kvtier.engine.hf_config.read_hf_config``).

    A ``tie_word_embeddings`` checkpoint that stores a distinct ``lm_head.weight`` loads
    untied, as transformers 5 loads it. Raises ``ConfigError`` when ``path`` is not a directory (a weights file passed instead of
    its directory says so), ``CheckpointError`` on unreadable or mismatched weights."""
    path = Path(path)
    if not path.is_dir():
        if path.is_file():
            raise ConfigError(
                f"{path} is a file; pass the checkpoint directory (holding config.json and "
                "the *.safetensors files)"
            )
        raise ConfigError(f"no such checkpoint directory: {path}")
    config = read_hf_config(path, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False) and stores_separate_head(
        path, config.torch_dtype
    ):
        config = dataclasses.replace(config, tie_word_embeddings=False)
    model: CausalLM = build_model(config)
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False``: text a chat template rendered already holds them."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

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
