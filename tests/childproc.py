"""Run a test helper script in a fresh process and read the JSON it prints last.

The process is forked from kvtier's ``forkserver`` (``kvtier.parallel.launch``), which imported
torch and kvtier once: it starts without importing them again, and holds no state of the test
that runs it (no cache, no open storage), as a restarted server would not."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

from kvtier.parallel.launch import fresh_process_context

HERE = Path(__file__).parent


def _run_script(path: str, args: list[str], out: str, err: str) -> None:
    """In the child: the script as ``__main__`` with ``args``, its output into ``out``/``err``."""
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [path, *args]
    sys.path[:0] = [str(Path(path).parent), str(HERE)]
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_json(script: str, *args: str, timeout: float = 300) -> dict:
    """``python tests/<script> args...`` (``script`` relative to ``tests/``), with ``tests/`` and
    the script's folder importable; its last stdout line as JSON. A non-zero exit or a child
    still running after ``timeout`` seconds fails the calling test with the child's stderr."""
    with tempfile.TemporaryDirectory(prefix="kvtier-child-") as tmp:
        out, err = str(Path(tmp) / "stdout"), str(Path(tmp) / "stderr")
        child = fresh_process_context().Process(
            target=_run_script, args=(str(HERE / script), list(args), out, err)
        )
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
        stderr = Path(err).read_text() if Path(err).exists() else ""
        assert child.exitcode == 0, f"exit {child.exitcode}: {stderr[-4000:]}"
        return json.loads(Path(out).read_text().strip().splitlines()[-1])
