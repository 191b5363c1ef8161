"""``kvtier serve`` on the command line: the cache flags against ``CacheConfig`` (every field a
flag or refused with a reason, the defaults and choices ``--help`` states), booleans as
``--x/--no-x``, byte sizes with suffixes, bad values refused naming the flag (exit 2), the
model argument, and modules that ``kvtier --help`` imports without torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_harness import DEADLINE_S

from kvtier import config as cache_config_module
from kvtier.cli import build_parser, main
from kvtier.config import CacheConfig
from kvtier.server.options import (
    CACHE_FLAGS,
    NOT_FLAGS,
    SIZING_FIELDS,
    cache_config_from_args,
    cache_kwargs_from_args,
    size_request_from_args,
)
from kvtier.server.sizing import SizeRequest

ROOT = Path(__file__).resolve().parents[2]


def _serve_parser():  # noqa: ANN202 - argparse's parser
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001


def test_every_cache_config_field_is_a_flag_or_refused_with_a_reason() -> None:
    flagged = {f.field for f in CACHE_FLAGS}
    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    assert flagged | SIZING_FIELDS | set(NOT_FLAGS) == fields
    assert not flagged & set(NOT_FLAGS) and not flagged & SIZING_FIELDS
    dests = {a.dest for a in _serve_parser()._actions}  # noqa: SLF001
    assert {f"cache_{f}" for f in flagged} <= dests
    assert {"device_pages", "device_bytes", "host_pages", "host_bytes", "host_ratio"} <= dests


def test_flag_defaults_and_choices_are_the_configs() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    for f in CACHE_FLAGS:
        assert f.default == defaults[f.field], f.name
    choices = {f.field: f.choices for f in CACHE_FLAGS if f.kind == "choice"}
    c = cache_config_module
    assert choices == {
        "host_mode": c.HOST_MODES,
        "host_layout": c.HOST_LAYOUTS,
        "host_compaction": c.COMPACTIONS,
        "kv_codec": c.KV_CODECS,
        "prefetch_policy": c.PREFETCH_POLICIES,
        "restore_policy": c.RESTORE_POLICIES,
        "storage_admission": c.STORAGE_ADMISSIONS,
        "write_policy": c.WRITE_POLICIES,
        "eviction_policy": c.EVICTION_POLICIES,
        "backup_timing": c.BACKUP_TIMINGS,
        "transfer_mechanism": c.TRANSFER_MECHANISMS,
        "compaction": c.COMPACTIONS,
    }
    bools = {f.field for f in CACHE_FLAGS if f.kind == "bool"}
    assert bools == {
        "enable_host",
        "pin_host",
        "cache_partial_pages",
        "debug_checks",
        "storage_encryption",
    }


def test_flags_convert_to_the_config() -> None:
    args = build_parser().parse_args(
        [
            "serve", "tiny",
            "--page-size", "8",
            "--no-host-tier",
            "--no-pin-host",
            "--storage-bytes", "10G",
            "--write-policy", "write_back",
            "--prefetch-timeout-s", "2",
            "--debug-checks",
        ]
    )  # fmt: skip
    assert cache_kwargs_from_args(args) == {
        "page_size": 8,
        "enable_host": False,
        "pin_host": False,
        "storage_bytes": 10 << 30,
        "write_policy": "write_back",
        "prefetch_timeout_s": 2.0,
        "debug_checks": True,
    }
    args = build_parser().parse_args(["serve", "tiny", "--host-bytes", "1GiB"])
    assert cache_config_from_args(args) == CacheConfig(host_bytes=1 << 30)
    assert cache_config_from_args(build_parser().parse_args(["serve", "tiny"])) == CacheConfig()


def test_sizing_flags_and_aliases() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "tiny", "--device-bytes", "512M", "--host-ratio", "1.5",
         "--mem-fraction", "0.5", "--max-running-requests", "3"]
    )  # fmt: skip
    assert size_request_from_args(args) == SizeRequest(
        device_bytes=512 << 20, mem_fraction=0.5, host_ratio=1.5
    )
    assert args.model_flag == "tiny" and args.model is None and args.max_running == 3
    assert args.host == "127.0.0.1"  # --host is the listen address, not a tier size


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--host-bytes", "1GB!"], "argument --host-bytes: '1GB!' is not a byte size"),
        (["--storage-bytes", "0"], "argument --storage-bytes: '0' must be at least one byte"),
        (["--page-size", "big"], "argument --page-size: 'big' is not an integer"),
        (["--write-policy", "bogus"], "argument --write-policy: invalid choice: 'bogus'"),
        (["--host-tier", "true"], "unrecognized arguments: true"),
    ],
)
def test_unparsable_flags_exit_2_naming_the_flag(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "tiny", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--page-size", "0"], "page_size must be a positive integer, got 0"),
        (["--backup-share", "2"], "backup_share must be a number in [0, 1], got 2.0"),
        (["--no-host-tier", "--storage", "file"], "storage requires enable_host=True"),
        (["--mem-fraction", "1.5"], "--mem-fraction must be a number in (0, 1], got 1.5"),
        (["--host-pages", "4", "--host-bytes", "4K"], "--host-pages and --host-bytes all size"),
        (["--device-pages", "0"], "--device-pages must be at least 1, got 0"),
        (["--max-running", "0"], "max_running must be a positive integer"),
        (["--max-queue", "0"], "max_queue must be a positive integer"),
        (["--max-model-len", "5000"], "--max-model-len 5000 exceeds the model's context"),
        (["--tokenizer", "no/such"], "--tokenizer no/such: no tokenizer.json there"),
        (["--chat-template", "nofile"], "--chat-template 'nofile': no such file"),
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, flags, message) -> None:
    assert main(["serve", "tiny", "--device", "cpu", "--device-pages", "256", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier serve: ") and message in err and "\n" not in err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("meta-llama/Llama-3.1-8B", "huggingface-cli download meta-llama/Llama-3.1-8B --local-dir"),
        ("no/such/dir", "no such checkpoint directory"),
        ("gpt9", "neither a checkpoint directory nor a model preset"),
    ],
)
def test_model_arguments_that_are_no_model(capsys, model, message) -> None:
    assert main(["serve", model, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_warns_at_start(tmp_path, caplog) -> None:
    from kvtier.engine.families import build_model, preset
    from kvtier.engine.weights import save_hf_checkpoint
    from kvtier.server.lifecycle import EngineSpec, build_engine

    save_hf_checkpoint(build_model(preset("tiny")), tmp_path)
    spec = EngineSpec(str(tmp_path), {"device": "cpu", "page_size": 4}, SizeRequest(1024))
    with caplog.at_level("WARNING", logger="kvtier"):
        engine = build_engine(spec)
    engine.llm.close()
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "no tokenizer.json" in warned[0].getMessage()
    assert "text prompts and chat requests will be refused" in warned[0].getMessage()
    assert engine.llm.tokenizer is None and engine.chat_template is None
    assert "tokenizer: none" in engine.summary[-1]


def test_help_and_option_modules_import_without_torch() -> None:
    """``kvtier.server.command`` and ``kvtier.server.options`` (what ``kvtier --help``
    imports of the server) import neither torch nor the server extra; the ``kvtier``
    package's own ``__init__`` is bypassed so that only these modules are measured."""
    code = (
        "import sys, types, pathlib\n"
        f"pkg = types.ModuleType('kvtier'); pkg.__path__ = [{str(ROOT / 'kvtier')!r}]\n"
        "sys.modules['kvtier'] = pkg\n"
        "import kvtier.server.command, kvtier.server.options, kvtier.server.sizing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'fastapi', 'uvicorn', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=DEADLINE_S)


def test_serve_help_names_no_internal_modules() -> None:
    text = _serve_parser().format_help()
    for internal in ("kvtier.", "seed 0", "issue", "CacheConfig", "STR|NONE", "``"):
        assert internal not in text, internal


def test_import_kvtier_needs_no_server_extra() -> None:
    code = (
        "import sys, kvtier, kvtier.cli, kvtier.server, kvtier.server.engine_loop, "
        "kvtier.server.options; assert 'fastapi' not in sys.modules and 'uvicorn' not in "
        "sys.modules, sorted(m for m in sys.modules if m.startswith(('fastapi', 'uvicorn')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=DEADLINE_S * 3)


def test_log_level_sets_kvtiers_own_loggers() -> None:
    import logging

    from kvtier.server.lifecycle import configure_logging

    before = logging.getLogger("kvtier").level
    try:
        configure_logging("debug")
        assert logging.getLogger("kvtier.server").getEffectiveLevel() == logging.DEBUG
        configure_logging("warning")
        assert logging.getLogger("kvtier.engine").getEffectiveLevel() == logging.WARNING
    finally:
        logging.getLogger("kvtier").setLevel(before)
