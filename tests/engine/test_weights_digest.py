"""The weights digest in a checkpoint's fingerprint comes from the weights' bytes: fine-tunes
of one base with equal shapes get different L3 namespaces. It is remembered beside the
checkpoint and recomputed only for files that changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from factories import engine_config

from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams, common, save_hf_checkpoint
from kvtier.engine.common import DIGEST_FILE, weights_digest
from kvtier.engine.hf_config import read_hf_config

CFG = ModelConfig(num_layers=2, vocab_size=128, max_position=256)


def _checkpoint(directory: Path, seed: int, **kw: int) -> Path:
    model = CausalLM(ModelConfig(**{**CFG.__dict__, "seed": seed}))
    save_hf_checkpoint(model, directory, **kw)
    return directory


@pytest.fixture
def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    hashed: list[str] = []
    real = common.hash_file

    def counting(path: Path, progress: object = None) -> str:
        hashed.append(path.name)
        return real(path, progress)

    monkeypatch.setattr(common, "hash_file", counting)
    return hashed


def test_equal_shapes_different_values_differ(tmp_path: Path) -> None:
    a, b = _checkpoint(tmp_path / "a", 1), _checkpoint(tmp_path / "b", 2)
    assert [f.stat().st_size for f in a.glob("*.safetensors")] == [
        f.stat().st_size for f in b.glob("*.safetensors")
    ]
    fa, fb = read_hf_config(a, dense_only=True), read_hf_config(b, dense_only=True)
    assert fa.weights_digest != fb.weights_digest
    assert fa.fingerprint() != fb.fingerprint()
    same = _checkpoint(tmp_path / "c", 1)  # same bytes elsewhere: same namespace
    assert read_hf_config(same, dense_only=True).fingerprint() == fa.fingerprint()


def test_digest_is_remembered_and_refreshed(tmp_path: Path, count_hashes: list[str]) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 1, max_shard_bytes=100_000)
    shards = sorted(f.name for f in ckpt.glob("*.safetensors"))
    assert len(shards) > 1
    first = weights_digest(ckpt)
    assert sorted(count_hashes) == shards
    memo = json.loads((ckpt / DIGEST_FILE).read_text())
    assert sorted(memo) == shards
    count_hashes.clear()
    assert weights_digest(ckpt) == first
    assert count_hashes == []  # nothing read again

    # rewrite one shard with other values of the same shape, under a new mtime
    victim = ckpt / shards[0]
    from safetensors.torch import load_file, save_file

    tensors = {k: v + 1 for k, v in load_file(str(victim)).items()}
    save_file(tensors, str(victim), metadata={"format": "pt"})
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = weights_digest(ckpt)
    assert count_hashes == [shards[0]]
    assert changed != first

    count_hashes.clear()
    victim.touch()  # same bytes, new mtime: re-hashed, same digest
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert weights_digest(ckpt) == changed
    assert count_hashes == [shards[0]]


def test_read_only_directory_falls_back_to_user_cache(
    tmp_path: Path, count_hashes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 3)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_write = common._write_memo

    def no_dir_write(files: list[Path], memo: dict) -> None:
        # the checkpoint's own memo path is unwritable; only the user cache remains
        real_write([f for f in files if f.parent != ckpt], memo)

    monkeypatch.setattr(common, "_write_memo", no_dir_write)
    first = weights_digest(ckpt)
    assert not (ckpt / DIGEST_FILE).exists()
    assert list((tmp_path / "cache" / "kvtier").rglob("*.json"))
    count_hashes.clear()
    assert weights_digest(ckpt) == first and count_hashes == []


def test_unwritable_memo_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 3)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: the cache dir can't exist
    (ckpt / DIGEST_FILE).mkdir()  # a directory: the memo can't be written there either
    assert weights_digest(ckpt) == weights_digest(ckpt)


def test_progress_only_for_large_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 4)
    weights_digest(ckpt)
    assert capsys.readouterr().err == ""
    (ckpt / DIGEST_FILE).unlink()
    monkeypatch.setattr(common, "_PROGRESS_BYTES", 1000)
    weights_digest(ckpt)
    err = capsys.readouterr().err
    assert "hashing" in err and str(ckpt) in err


def test_fine_tunes_never_share_storage_hits(tmp_path: Path) -> None:
    a, b = _checkpoint(tmp_path / "a", 1), _checkpoint(tmp_path / "b", 2)
    cache = engine_config(tmp_path / "l3", page_size=4, device="cpu", debug_checks=False)
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    first = LLM(a, cache)
    first.generate([prompt], greedy)
    first.cache.drain()
    first.close()
    with LLM(a, cache) as again:  # the pages did land: the same model hits them
        assert again.generate([prompt], greedy)[0].cached_storage > 0
    with LLM(b, cache) as other:
        assert other.generate([prompt], greedy)[0].cached_storage == 0
