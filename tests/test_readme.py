"""The README's commands, copied out of it when the test runs, so that they stay true.

A fenced block the tests run is marked by an HTML comment right before its fence,
``<!-- test: NAME -->``:

* ``setup``: the README's first block, ``make demo`` and ``make test``. ``make demo`` is run as
  the ``kvtier`` command its Makefile recipe runs (``make -n demo``, which the README names);
  ``make test`` is not run (it runs this file), only checked to run pytest, as CI does.
* ``serve``, ``client``, ``client-output``, ``restart-output``: the five-minute path. The
  ``kvtier serve`` line of ``serve`` is started as written plus ``--port 0`` (any free port;
  the client's ``127.0.0.1:8000`` becomes that port) and ``--device cpu`` (a GPU host's tests
  share the GPU); the ``client`` block runs as a script and must print ``client-output``; the
  server is stopped with SIGINT, started again with the same command, and the client must then
  print ``restart-output``.
* ``api``: the engine-author snippet; every cache call and admission field it names exists.
* ``llm``: the reference engine's snippet runs as a script.

Commands run in a temporary directory, so ``kvtier-data/`` lands there.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the demo and two server processes

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKED = re.compile(r"^<!-- test: ([\w-]+) -->\n```[\w-]*\n(.*?)^```", re.M | re.S)
FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", re.M | re.S)
URL = "http://127.0.0.1:8000/v1"
START_S = 120.0
"""Deadline of one server start or one client run (a loaded CI host imports torch slowly)."""


def blocks() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    found = MARKED.findall(text)
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a test name is used twice in README.md: {names}"
    return dict(found)


def commands(block: str) -> list[str]:
    """The block's shell commands: its lines without comments and blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def kvtier(argv: list[str]) -> list[str]:
    """``kvtier ARGS`` as this interpreter runs it (the venv's ``kvtier`` script)."""
    assert argv[0] == "kvtier", argv
    return [sys.executable, "-m", "kvtier", *argv[1:]]


def make_recipe(target: str) -> str:
    """The target's own command, as ``make -n TARGET`` prints it: the last line (what sets up
    ``.venv`` first, when it is not current, comes before it)."""
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.strip().splitlines()[-1]


def test_setup_block_is_the_first_and_stays_true(tmp_path) -> None:
    text = README.read_text(encoding="utf-8")
    setup = blocks()["setup"]
    assert FENCE.search(text).group(1) == setup, "the setup block is no longer the first"
    assert commands(setup) == ["make demo", "make test"], commands(setup)
    demo_line = next(line for line in setup.splitlines() if line.startswith("make demo"))
    assert (ROOT / ".ci" / "run").read_text().count("make test") == 1

    test_recipe = shlex.split(make_recipe("test"))
    assert test_recipe[1:3] == ["-m", "pytest"] and "tests" in test_recipe, test_recipe

    demo = make_recipe("demo")
    argv = shlex.split(demo)
    argv[0] = Path(argv[0]).name
    assert argv[:2] == ["kvtier", "demo"], demo
    assert f"`{' '.join(argv)}`" in demo_line, "the README no longer says what make demo runs"
    r = subprocess.run(
        kvtier(argv), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "oracle: PASS" in r.stdout, r.stdout[-3000:]
    assert any((tmp_path / "kvtier-data" / "demo").rglob("*")), "the demo stored nothing"


def _serve_argv() -> list[str]:
    """The README's ``kvtier serve`` command; the block holds nothing else but activating the
    venv that the tests already run in."""
    cmds = commands(blocks()["serve"])
    serve = [c for c in cmds if c.startswith("kvtier serve ")]
    assert len(serve) == 1, cmds
    assert set(cmds) - set(serve) <= {"source .venv/bin/activate"}, cmds
    return shlex.split(serve[0])


def _start(argv: list[str], cwd: Path) -> tuple[subprocess.Popen, str]:
    cmd = [*kvtier(argv), "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # the start-up summary, then where it listens
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.wait(timeout=START_S)
    raise AssertionError("the server exited before listening:\n" + "".join(lines))


def _stop(proc: subprocess.Popen) -> str:
    """Ctrl-C, as the README says; returns the rest of the server's log."""
    proc.send_signal(signal.SIGINT)
    try:
        rest = proc.communicate(timeout=START_S)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest[-3000:]
    return rest


def _chat(client: Path, url: str, cwd: Path) -> list[str]:
    script = client.read_text().replace(URL, f"{url}/v1")
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_five_minute_path_serves_then_restarts_from_storage(tmp_path) -> None:
    b = blocks()
    argv = _serve_argv()
    assert URL in b["client"], f"the client no longer talks to {URL}, the server's default"
    client = tmp_path / "client.py"
    client.write_text(b["client"])
    for expected in ("client-output", "restart-output"):
        proc, url = _start(argv, tmp_path)
        try:
            printed = _chat(client, url, tmp_path)
        finally:
            log = _stop(proc)
        assert printed == b[expected].strip().splitlines(), (expected, printed)
        assert "shut down:" in log
    stored = [p for p in (tmp_path / "kvtier-data" / "serve").rglob("*") if p.is_file()]
    assert stored, "the server stored nothing under the README's --storage-dir"


def test_engine_snippet_names_what_the_cache_has() -> None:
    from kvtier import Admission, TieredCache

    snippet = blocks()["api"]
    calls = set(re.findall(r"\bcache\.(\w+)\(", snippet))
    fields = set(re.findall(r"\badm\.(\w+)", snippet))
    assert {"admit", "admit_ready", "abandon", "alloc", "finish", "write_kv"} <= calls
    assert [c for c in calls if not callable(getattr(TieredCache, c, None))] == []
    assert [f for f in fields if not hasattr(Admission, f)] == []


def test_reference_engine_snippet_runs(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", blocks()["llm"]],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device_hit_tokens" in r.stdout, r.stdout[-3000:]


def test_readme_links_resolve() -> None:
    text = FENCE.sub("", README.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    local = [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and t[0] != "#"]
    assert local, "no relative links found: the pattern is wrong"
    missing = [t for t in local if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
