"""Broken checkpoints and bad ``--model`` values: errors name the file and field, and the demo
reports them in one line instead of a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.engine import LLM, CausalLM, CheckpointError, ModelConfig, save_hf_checkpoint
from kvtier.engine.hf_config import read_hf_config
from kvtier.engine.weights import load_model
from kvtier.errors import ConfigError


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    save_hf_checkpoint(CausalLM(ModelConfig(num_layers=1, vocab_size=64)), directory)
    return directory


def _edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_truncated_weights_name_the_file(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(ckpt)


def test_garbage_weights_name_the_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(ckpt)


def test_broken_shard_index_names_the_index(ckpt: Path) -> None:
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"]
)
def test_missing_required_field_names_field_and_file(ckpt: Path, field: str) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg[field]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"config\.json.*{field}.*missing"):
        read_hf_config(ckpt, dense_only=True)
    with pytest.raises(ConfigError, match=field):
        load_model(ckpt)


def test_mistyped_field_names_it(ckpt: Path) -> None:
    _edit_config(ckpt, hidden_size="128")
    with pytest.raises(ConfigError, match=r"config\.json: hidden_size='128' must be an integer"):
        read_hf_config(ckpt, dense_only=True)
    _edit_config(ckpt, hidden_size=128, torch_dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match=r"config\.json: torch_dtype='float8_e4m3fn'"):
        read_hf_config(ckpt, dense_only=True)
    _edit_config(ckpt, torch_dtype="float32", num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"config\.json: .*num_kv_heads=3"):
        read_hf_config(ckpt, dense_only=True)


def test_invalid_json_names_the_file(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConfigError, match=r"config\.json: invalid JSON"):
        read_hf_config(ckpt, dense_only=True)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json: expected a JSON object"):
        read_hf_config(ckpt, dense_only=True)


def test_weights_file_instead_of_directory(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    for call in (read_hf_config, load_model, LLM):
        with pytest.raises(ConfigError, match="pass the checkpoint directory"):
            call(weights)
    binary = ckpt / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="pass the checkpoint directory"):
        read_hf_config(binary, dense_only=True)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        read_hf_config(tmp_path, dense_only=True)


def _demo(capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str) -> tuple[int, str]:
    storage = tmp_path / "l3"
    code = main(["demo", "--model", model, "--storage-dir", str(storage), "--turns", "1"])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


def test_demo_reports_a_bad_checkpoint_in_one_line(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    del_cfg = json.loads((ckpt / "config.json").read_text())
    del del_cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(del_cfg))
    code, err = _demo(capsys, tmp_path, str(ckpt))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier demo: ")
    assert "hidden_size" in lines[0] and "config.json" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_demo_path_that_is_not_a_directory(
    kind: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tmp_path / "no" / "such") if kind == "missing" else str(ckpt / "config.json")
    code, err = _demo(capsys, tmp_path, model)
    assert code == 2
    assert err.startswith(f"kvtier demo: --model {model}: no such checkpoint directory")
    assert "preset" not in err and len(err.strip().splitlines()) == 1


def test_demo_unknown_preset_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _demo(capsys, tmp_path, "gigantic")
    assert code == 2
    assert err.startswith("kvtier demo: --model 'gigantic' is neither")
    for name in ("tiny", "small", "mla", "hybrid", "swa"):
        assert name in err


def test_unreadable_weights_file_names_it(ckpt: Path) -> None:
    (ckpt / "extra.safetensors").mkdir()  # listed like a weights file, but open() fails
    with pytest.raises(ConfigError, match=r"extra\.safetensors"):
        read_hf_config(ckpt, dense_only=True)
