"""The command line: ``--help`` of every command and ``--version`` answer without importing torch
(in a fresh process, ``python -m kvtier``), ``kvtier bench NAME`` has each benchmark's own
described flags, and those flags reach the benchmark."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.bench import commands

ROOT = Path(__file__).resolve().parents[1]
BENCHES = (
    "tree",
    "transfer",
    "storage",
    "ttft",
    "step",
    "backup",
    "window",
    "compute",
    "serve",
    "multiturn",
    "load-or-recompute",
)
HELPS = [[], ["demo"], ["serve"], ["route"], ["plot"], ["bench"], *(["bench", b] for b in BENCHES)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_parsing_every_help_imports_no_torch() -> None:
    """In a fresh interpreter: import the command line, print every command's help and
    ``--version``; torch stays out (the serve flags' module promises to stay torch-free)."""
    code = f"""
import contextlib, io, sys
import kvtier.cli
for argv in {HELPS!r} + [["--version"]]:
    parser = kvtier.cli.build_parser(serve=argv[:1] == ["serve"])
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv + (["--help"] if argv != ["--version"] else []))
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
assert not heavy, heavy
assert "kvtier.config" not in sys.modules and "kvtier.cache" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=60)


@pytest.mark.parametrize("argv", HELPS, ids=lambda a: " ".join(a) or "kvtier")
def test_python_m_kvtier_help_runs_without_torch(argv: list[str]) -> None:
    """``python -m kvtier ... --help`` in its own process: exit 0, a usage line, and no torch
    module among what ``-X importtime`` reports imported."""
    cmd = [sys.executable, "-X", "importtime", "-m", "kvtier", *argv, "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: kvtier {' '.join(argv)}".rstrip())
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_version_is_the_package_metadata() -> None:
    want = f"kvtier {importlib.metadata.version('kvtier')}\n"
    cmd = [sys.executable, "-m", "kvtier", "--version"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=60)
    assert (out.returncode, out.stdout) == (0, want)
    import kvtier

    assert kvtier.__version__ == importlib.metadata.version("kvtier")


def test_the_demo_backup_timings_are_the_configs() -> None:
    from kvtier.config import BACKUP_TIMINGS

    assert cli.BACKUP_TIMINGS == BACKUP_TIMINGS


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    root = cli.build_parser(serve=False)
    top = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    bench = top.choices["bench"]
    names = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return dict(names.choices)


def test_each_benchmark_has_its_own_described_flags() -> None:
    parsers = _bench_parsers()
    assert tuple(parsers) == BENCHES
    flags = {}
    for name, p in parsers.items():
        assert p.description, name
        opts = [a for a in p._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001
        for a in opts:
            assert a.help and a.help != argparse.SUPPRESS, (name, a.option_strings)
        flags[name] = {a.option_strings[0] for a in opts}
    assert flags["step"] == {"--json"}
    assert flags["tree"] == {"--json", "--peer-python", "--rounds"}
    assert "--family" in flags["transfer"] and "--family" not in flags["serve"]
    assert {"--url", "--model", "--api-key", "--clients"} <= flags["serve"]


def test_a_flag_of_another_benchmark_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "step", "--family", "all"])
    assert e.value.code == 2
    assert "unrecognized arguments: --family all" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "module", "function", "kwargs"),
    [
        (
            ["transfer", "--family", "mla", "--target-mib", "4", "--device", "cpu"],
            "kvtier.bench.transfer",
            "bench_transfer",
            {"family": "mla", "target_mib": 4, "device": "cpu", "num_pages": 512, "repeats": 5},
        ),
        (
            ["backup"],
            "kvtier.bench.backup_timing",
            "run",
            {"model": "small", "batch": 8, "prompt_tokens": 2048, "page_size": 16},
        ),
        (
            ["window", "--window", "64"],
            "kvtier.bench.window_memory",
            "run",
            {"context": 8192, "window": 64, "page_size": 16, "device": None},
        ),
        (
            ["compute", "--context", "512"],
            "kvtier.bench.compute",
            "bench_compute",
            {"prompt_tokens": 32768, "batch": 32, "decode_context": 512, "page_size": 16},
        ),
        (
            ["storage", "--dir", "/x", "--backend", "mooncake"],
            "kvtier.bench.storage",
            "bench_storage",
            {"directory": "/x", "backend": "mooncake", "url": None, "peer_python": None},
        ),
    ],
)
def test_bench_flags_reach_the_benchmark(
    monkeypatch, tmp_path, argv, module, function, kwargs
) -> None:
    mod = pytest.importorskip(module)
    seen: list[dict] = []

    def fake(**kw):
        seen.append(kw)
        return {"bench": argv[0], "ok": True}

    monkeypatch.setattr(mod, function, fake)
    out = tmp_path / "r.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["bench", *argv, "--json", str(out)]) == 0
    [got] = seen
    assert {k: got[k] for k in kwargs} == kwargs
    assert json.loads(out.read_text()) == json.loads(printed.getvalue()) == fake()


def test_serve_failure_names_the_first_error() -> None:
    ok = {"requests": 4, "requests_ok": 4, "errors_by_status": {}, "first_error": None}
    assert commands.serve_failure(ok) is None
    bad = {
        "requests": 6,
        "requests_ok": 0,
        "errors_by_status": {"404": 6},
        "first_error": {"status": "404", "message": "model 'tiny' is not served here"},
    }
    assert commands.serve_failure(bad) == (
        "6 of 6 requests failed (404: 6); first: 404 model 'tiny' is not served here"
    )
    none = {"requests": 0, "requests_ok": 0, "errors_by_status": {}, "first_error": None}
    assert commands.serve_failure(none) == "no request was sent"


def test_serve_help_lists_the_cache_flags(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    assert "--page-size" in capsys.readouterr().out
