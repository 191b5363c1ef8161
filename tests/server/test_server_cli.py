"""``kvtier serve`` on the command line: one flag per ``CacheConfig`` field, bad values
refused by ``CacheConfig`` itself (exit 2, its message), and the real command end to end."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The server extra (pip install -e ".[server]") and the official client the tests drive it with.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from server_harness import DEADLINE_S, http, wait_ready

pytestmark = pytest.mark.slow  # a live server per test

from kvtier.cli import build_parser, main
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.server.options import cache_config_from_args

ROOT = Path(__file__).resolve().parents[2]


def test_every_cache_config_field_has_a_flag() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    flags = {a.dest.removeprefix("cache_") for a in serve._actions if a.dest.startswith("cache_")}
    assert flags == {f.name for f in dataclasses.fields(CacheConfig)}


def test_flags_convert_by_the_field_types() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "tiny",
            "--page-size", "8",
            "--host-ratio", "1.5",
            "--enable-host", "true",
            "--pin-host", "none",
            "--host-pages", "40",
            "--storage", "file",
            "--extra-namespace", "a,b",
            "--prefetch-timeout-s", "2",
        ]
    )  # fmt: skip
    cfg = cache_config_from_args(args)
    assert cfg == CacheConfig(
        page_size=8,
        host_ratio=1.5,
        enable_host=True,
        pin_host=None,
        host_pages=40,
        storage="file",
        extra_namespace=("a", "b"),
        prefetch_timeout_s=2.0,
    )
    assert cache_config_from_args(build_parser().parse_args(["serve", "tiny"])) == CacheConfig()


@pytest.mark.parametrize(
    ("flags", "kw"),
    [
        (["--page-size", "0"], {"page_size": 0}),
        (["--page-size", "big"], {"page_size": "big"}),
        (["--write-policy", "bogus"], {"write_policy": "bogus"}),
        (["--enable-host", "maybe"], {"enable_host": "maybe"}),
        (["--backup-share", "2"], {"backup_share": 2.0}),
        (["--host-pages", "4", "--host-bytes", "4096"], {"host_pages": 4, "host_bytes": 4096}),
        (
            ["--enable-host", "false", "--storage", "file"],
            {"enable_host": False, "storage": "file"},
        ),
    ],
)
def test_bad_cache_flags_exit_2_with_the_config_error(capsys, flags, kw) -> None:
    with pytest.raises(ConfigError) as direct:
        CacheConfig(**kw)
    assert main(["serve", "tiny", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"kvtier serve: {direct.value}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-running", "0"], "max_running must be a positive integer"),
        (["--max-queue", "0"], "max_queue must be a positive integer"),
        (["--model-dir-typo/"], None),
    ],
)
def test_bad_engine_options_exit_2(capsys, flags, message) -> None:
    argv = ["serve", "no/such/dir"] if message is None else ["serve", "tiny", *flags]
    argv += ["--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (message or "no such checkpoint directory") in err


def test_import_kvtier_needs_no_server_extra() -> None:
    code = (
        "import sys, kvtier, kvtier.cli, kvtier.server, kvtier.server.engine_loop, "
        "kvtier.server.options; assert 'fastapi' not in sys.modules and 'uvicorn' not in "
        "sys.modules, sorted(m for m in sys.modules if m.startswith(('fastapi', 'uvicorn')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=DEADLINE_S * 3)


def test_kvtier_serve_runs_and_shuts_down_cleanly(tmp_path) -> None:
    """The real command: serves a request, and on SIGTERM flushes its storage writes (the L3
    directory holds objects afterwards) and exits 0."""
    l3 = tmp_path / "l3"
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "tiny", "--port", "0"]
    cmd += ["--device", "cpu", "--page-size", "4", "--storage", "file", "--storage-dir", str(l3)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # the first thing it says is where it listens
        m = re.search(r"listening on (http://\S+) \((\d+) start-up objects kept out", line)
        assert m and int(m.group(2)) > 10_000, line  # modules, weights, pools: all frozen
        url = m.group(1)
        wait_ready(url)
        body = {"model": "tiny", "prompt": list(range(1, 30)), "max_tokens": 3}
        r = http().post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S * 3) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    objects = [p for p in l3.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert objects, "the shutdown did not flush the storage writes"
