"""Child processes import the kvtier that started them, not a ``kvtier/`` folder in their
working directory: the demo's restart child (``kvtier_command``) and the CP ranks' fork server,
run from a directory holding a decoy ``kvtier`` (``kvtier demo`` run from the folder that holds
the clone sees the clone's folder there)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.demo.run import kvtier_command
from kvtier.parallel.launch import package_root

DECOY = 'raise SystemExit("decoy kvtier imported")\n'
VERSION = f"kvtier {importlib.metadata.version('kvtier')}\n"


def _decoy(cwd: Path, kind: str) -> Path:
    if kind == "package":  # a regular package: first on sys.path, it wins over any install
        (cwd / "kvtier").mkdir()
        (cwd / "kvtier" / "__init__.py").write_text(DECOY)
    else:  # a clone's folder: no __init__.py, a namespace package beside an editable install
        (cwd / "kvtier" / "kvtier").mkdir(parents=True)
        (cwd / "kvtier" / "kvtier" / "__init__.py").write_text(DECOY)
        (cwd / "kvtier" / "results").mkdir()
    return cwd


def test_a_plain_python_m_child_would_import_the_decoy(tmp_path: Path) -> None:
    """The failure the pinned command avoids (the control)."""
    cwd = _decoy(tmp_path, "package")
    cmd = [sys.executable, "-m", "kvtier", "--version"]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "decoy kvtier imported" in out.stderr


@pytest.mark.parametrize("kind", ["package", "clone folder"])
def test_the_restart_child_imports_the_running_kvtier(tmp_path: Path, kind: str) -> None:
    cwd = _decoy(tmp_path, kind)
    cmd = kvtier_command("--version")  # the demo's restart child, running a tiny command
    assert cmd[-1] == "--version" and package_root() in cmd
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, VERSION), out.stderr[-2000:]
    assert package_root() == str(Path(__file__).resolve().parents[2])  # this checkout


@pytest.mark.slow  # the fork server preloads torch and the engine (seconds)
def test_cp_ranks_started_from_a_decoy_directory_import_the_running_kvtier(
    tmp_path: Path,
) -> None:
    cwd = _decoy(tmp_path, "package")
    code = (
        f"import sys, operator; sys.path[0] = {package_root()!r}\n"
        "from kvtier.parallel.launch import launch, results\n"
        "print(results(launch(2, operator.attrgetter('rank'), timeout=30)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert (out.returncode, out.stdout) == (0, "[0, 1]\n"), out.stderr[-2000:]
