"""What every model family's config shares: the common decoder fields, element types, field
validation whose errors name the concrete config class, RoPE frequencies as configured, and the
fingerprint that names a model inside kvtier's L3 key namespace (with the digest of a
checkpoint's weight bytes)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvtier.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ConfigBase:
    """Base of the families' frozen config dataclasses: the fields every family has (the shared
    decoder pieces in ``kvtier.engine.model`` read them), element types, validation whose errors
    name the concrete class, and the fingerprint. A family adds its own fields after these and
    may redeclare one to change its default."""

    family: ClassVar[str] = ""
    """Tag hashed into the fingerprint so that two families' configs with equal field values
    do not collide. Empty for the dense config, whose digests predate the other families."""
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"eos_token_ids"})
    """Fields that change neither the pool bytes nor their meaning, so that deployments
    differing only in them (stop tokens, say) still share L3 objects."""
    fingerprint_omit_default: ClassVar[frozenset[str]] = frozenset()
    """Fields left out of the fingerprint while they hold their default value: options added
    after digests were in use, so that configs not using them keep their digests."""

    vocab_size: int = 512
    """Number of token ids; valid ids are ``[0, vocab_size)``."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    num_layers: int = 4
    """Decoder layers (each holds one layer in every pool that has them)."""
    num_heads: int = 4
    """Query (attention) heads."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    max_position: int = 4096
    """Context length: prompt plus generated tokens never exceed it."""
    dtype: str = "float32"
    """Weights, activations and pool element type: ``float32``, ``bfloat16``, ``float16`` or
    ``float64``."""
    seed: int = 0
    """Seed of the deterministic random weights (ignored once a checkpoint is loaded)."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless a request sets ``ignore_eos``."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def fingerprint(self) -> str:
        """Stable hex digest of everything that determines the model's pool bytes."""
        fields: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.fingerprint_exclude
            and not (f.name in self.fingerprint_omit_default and getattr(self, f.name) == f.default)
        }
        if self.family:
            fields = {"family": self.family, **fields}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    def _error(self, message: str) -> ConfigError:
        return ConfigError(f"{type(self).__name__}.{message}")

    def _check_sizes(self, *not_sizes: str) -> None:
        """Every ``int`` field except ``not_sizes`` is a size or count, hence positive."""
        for f in dataclasses.fields(self):
            if f.type not in ("int", int) or f.name in not_sizes:
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise self._error(f"{f.name} must be a positive integer, got {v!r}")

    def _check_even(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) % 2:
                raise self._error(f"{name}={getattr(self, name)} must be even for RoPE")

    def _check_choice(self, name: str, known: Iterable[str]) -> None:
        known = tuple(known)
        if getattr(self, name) not in known:
            raise self._error(f"{name}={getattr(self, name)!r} is not one of {', '.join(known)}")

    def _check_eos(self) -> None:
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise self._error(f"eos_token_ids={self.eos_token_ids} outside vocab")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """RoPE's float32 inverse frequencies (``[head_dim // 2]``, on the CPU), computed step by
    step as HF transformers does for ``rope_type`` ``default``, ``linear`` (every frequency
    divided by ``factor``), ``llama3`` (long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between, with the band edges at ``original_max_position`` over
    ``low_freq_factor`` and ``high_freq_factor``) and ``yarn`` (dims that turn fewer than
    ``beta_slow`` times over ``original_max_position`` divided by ``factor``, those turning
    more than ``beta_fast`` times kept, a linear ramp between; ``truncate`` rounds the ramp's
    ends to whole dims). YaRN's attention factor is applied to the RoPE tables, not here."""
    if rope_type == "yarn":
        return _yarn_inv_freq(
            head_dim, theta, factor, original_max_position, beta_fast, beta_slow, truncate
        )
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ConfigError(f"rope_type={rope_type!r} is not one of default, linear, llama3, yarn")
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> torch.Tensor:
    """YaRN's inverse frequencies, in transformers' order of float operations."""

    def dim_of(rotations: float) -> float:
        # the dim whose wavelength fits ``rotations`` times into the pretraining context
        return (dim * math.log(original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor``: ``0.1 * mscale * ln(factor) + 1``,
    ``1.0`` for a factor of at most one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's default attention factor (the RoPE tables' scale) for a context ``factor``;
    with both ``mscale`` and ``mscale_all_dim`` (DeepSeek's fields) their ratio, as transformers
    computes it."""
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_softmax_scale_factor(factor: float, mscale_all_dim: float = 0.0) -> float:
    """What DeepSeek's YaRN multiplies the attention softmax scale by: ``mscale(factor,
    mscale_all_dim) ** 2``, or ``1.0`` without ``mscale_all_dim`` (as transformers does)."""
    if not mscale_all_dim:
        return 1.0
    m = yarn_mscale(factor, mscale_all_dim)
    return m * m


DIGEST_FILE = ".kvtier-weights-digest.json"
"""Beside a checkpoint's weights: each file's content digest, keyed by its size, mtime and
inode, so that a checkpoint is read in full once rather than at every start."""
_CHUNK = 8 << 20
_PROGRESS_BYTES = 1 << 30


def _file_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def hash_file(path: Path, progress: Any = None) -> str:
    """blake2b of ``path``'s bytes, read in large chunks (hashlib releases the GIL, so files
    hash in parallel threads). ``progress(n)`` is called with each chunk's size. Raises
    ``ConfigError`` naming the file when it cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                if progress is not None:
                    progress(n)
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint file {path}: {e}") from e
    return h.hexdigest()


def _memo_files(directory: Path) -> list[Path]:
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory: only the checkpoint's own memo
        return [directory / DIGEST_FILE]
    name = hashlib.blake2b(str(directory.resolve()).encode(), digest_size=16).hexdigest()
    return [directory / DIGEST_FILE, cache / "kvtier" / "weights-digest" / f"{name}.json"]


def _read_memos(files: list[Path]) -> list[dict[str, Any]]:
    memos = []
    for file in files:
        try:
            memo = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(memo, dict):
            memos.append(memo)
    return memos


def _write_memo(files: list[Path], memo: dict[str, Any]) -> None:
    # the directory's copy first; a read-only checkpoint falls back to the user's cache
    for file in files:
        tmp = file.with_name(f"{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
            os.replace(tmp, file)
            return
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


class _Progress:
    """Hashing progress on stderr, in tenths of ``total`` bytes."""

    def __init__(self, directory: Path, total: int) -> None:
        self.directory, self.total, self.done, self.shown = directory, total, 0, 0
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            tenth = self.done * 10 // self.total
            if tenth > self.shown:
                self.shown = tenth
                print(
                    f"kvtier: hashing {self.directory} weights: {self.done / 1e9:.1f}/"
                    f"{self.total / 1e9:.1f} GB",
                    file=sys.stderr,
                    flush=True,
                )


def weights_digest(directory: Path) -> str:
    """Digest of the names, sizes and bytes of ``directory``'s ``*.safetensors`` files (empty
    without any). Files whose size, mtime and inode match the remembered ones (``DIGEST_FILE``,
    or the user's cache when the directory is read-only) are not read again."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return ""
    keys = {f.name: _file_key(f.stat()) for f in files}
    memo_files = _memo_files(directory)
    digests: dict[str, str] = {}
    for memo in _read_memos(memo_files):
        for f in files:
            m = memo.get(f.name)
            ok = isinstance(m, dict) and isinstance(m.get("digest"), str)
            if ok and m.get("key") == keys[f.name]:
                digests.setdefault(f.name, m["digest"])
    todo = [f for f in files if f.name not in digests]
    if todo:
        total = sum(keys[f.name][0] for f in todo)
        progress = _Progress(directory, total) if total > _PROGRESS_BYTES else None
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
            hashed = pool.map(lambda f: hash_file(f, progress), todo)
            digests.update((f.name, d) for f, d in zip(todo, hashed, strict=True))
        new = {f.name: {"key": keys[f.name], "digest": digests[f.name]} for f in files}
        _write_memo(memo_files, new)
    blob = "\n".join(f"{f.name}:{keys[f.name][0]}:{digests[f.name]}" for f in files)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()
