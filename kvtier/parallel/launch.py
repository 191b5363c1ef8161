"""Run one function on ``n`` local ranks of a gloo CP group (``kvtier demo --cp N``, tests).

Each rank is a fresh process (forked from a clean ``forkserver``, see ``fresh_process_context``) that joins the group on 127.0.0.1 at a free port, runs
``fn(group, *args)`` and reports its result or its error; the caller gets every rank's outcome,
so a rank that died (and the error it caused on the others, naming it) is reported rather than
taking the launcher down with it.

Children import the kvtier this process runs, not a ``kvtier/`` folder in the working
directory (a clone's folder, seen from the folder holding it, shadows an editable install): the
fork server starts with ``package_root()`` first on its ``sys.path`` and, on Python 3.11 and
later, without the working directory (``PYTHONSAFEPATH``).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.parallel.ports import free_port


@dataclass(frozen=True)
class RankOutcome:
    """How one rank ended."""

    rank: int
    """The rank."""
    result: Any = None
    """What ``fn`` returned (``None`` after an error)."""
    error: str | None = None
    """``Type: message`` of the exception ``fn`` raised, or how the process ended."""
    error_type: str | None = None
    """The exception's class name (``RankError``, ...)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _entry(
    rank: int, n: int, port: int, timeout: float, fn: Callable, args: tuple, out: str
) -> None:
    from kvtier.parallel.group import GlooGroup

    torch.set_num_threads(1)  # n ranks share the host's cores
    path = Path(out) / f"rank{rank}.pt"
    try:
        group = GlooGroup.init(rank, n, f"tcp://127.0.0.1:{port}", timeout=timeout)
        result = fn(group, *args)
        torch.save({"result": result}, path)
    except BaseException as e:  # reported to the launcher, which decides what it means
        torch.save(
            {
                "error": f"{type(e).__name__}: {e}",
                "type": type(e).__name__,
                "trace": traceback.format_exc(),
            },
            path,
        )
        os._exit(1)  # peers blocked on this rank must see it gone, not a live process
    # Skip the process group's teardown: it waits for peers that may have died.
    os._exit(0)


def package_root() -> str:
    """The directory holding the ``kvtier`` package this process runs: first on a child's
    ``sys.path``, it makes the child import the same code whatever its working directory
    holds."""
    return str(Path(__file__).resolve().parents[2])


@contextmanager
def pinned_path_env() -> Iterator[None]:
    """While it lasts, an interpreter this process starts finds ``package_root()`` before
    anything else (``PYTHONPATH``) and, on Python 3.11 and later, not the working directory
    (``PYTHONSAFEPATH``). For children started by a library that takes no environment (the
    fork server); ``os.environ`` is restored after."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root(), saved["PYTHONPATH"]) if p
    )
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fresh_process_context() -> mp.context.BaseContext:
    """Fresh rank processes forked from a server that imported torch and kvtier once per
    launching process (``forkserver``): a rank starts in milliseconds instead of importing
    torch again, and still shares no state with the launcher or other launches. Where there is
    no ``fork`` (Windows, macOS defaults aside), every rank is spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "kvtier", "kvtier.parallel.group", "kvtier.engine"])
    # Started here, not at the first rank's start: its interpreter (``python -c``) would put
    # the working directory first on its path, and the server ignores the path it is sent.
    with pinned_path_env():
        multiprocessing.forkserver.ensure_running()
    return ctx


def launch(
    n: int, fn: Callable[..., Any], *args: Any, timeout: float = 10.0, deadline: float = 600.0
) -> list[RankOutcome]:
    """``fn(group, *args)`` on ranks ``0 .. n-1`` (``fn`` and ``args`` must pickle: a
    module-level function). ``timeout`` bounds every collective (a silent peer is named within
    it); a rank still running after ``deadline`` seconds is killed and reported."""
    ctx = fresh_process_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvtier-ranks-") as out:
        procs = [
            ctx.Process(target=_entry, args=(r, n, port, timeout, fn, args, out), daemon=False)
            for r in range(n)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        outcomes = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                outcomes.append(RankOutcome(r, error=f"still running after {deadline}s: killed"))
                continue
            path = Path(out) / f"rank{r}.pt"
            if not path.exists():
                outcomes.append(RankOutcome(r, error=f"process exited with code {p.exitcode}"))
                continue
            rec = torch.load(path, weights_only=False)
            if "error" in rec:
                outcomes.append(RankOutcome(r, error=rec["error"], error_type=rec["type"]))
            else:
                outcomes.append(RankOutcome(r, result=rec["result"]))
        return outcomes


def results(outcomes: list[RankOutcome]) -> list[Any]:
    """Every rank's result; ``RuntimeError`` listing the ranks that failed, and why."""
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError("; ".join(f"rank {o.rank}: {o.error}" for o in bad))
    return [o.result for o in outcomes]
