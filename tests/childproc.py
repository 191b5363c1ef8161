"""Run a test helper script in a fresh Python process and read the JSON it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_json(script: str, *args: str, timeout: float = 300) -> dict:
    """``python tests/<script> args...`` (``script`` relative to ``tests/``) with ``tests/`` importable; its last stdout line as
    JSON. A non-zero exit fails the calling test with the child's stderr."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
