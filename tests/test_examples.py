"""Every script under ``examples/`` runs as a user runs it (``python examples/NAME.py``, a
subprocess): the engine loop restores a prefix from storage, the OpenAI chat example against a
running server sees its second request cached, and the checkpoint the checkpoint example writes
is served by ``kvtier serve DIR``."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TESTED = {"engine_loop.py", "openai_chat.py", "make_checkpoint.py"}
DEADLINE_S = 180.0
"""One example's or one server start's deadline (a loaded CI host imports torch slowly)."""


def run_example(name: str, *args: str, cwd: Path = ROOT) -> str:
    """``python examples/NAME args...`` (from the repository root unless ``cwd``); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r.stdout


def test_every_example_is_tested_and_says_what_it_shows() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == TESTED, "an example without a test here, or a test of a missing one"
    for name in scripts:
        tree = ast.parse((EXAMPLES / name).read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(doc.split()) >= 20, f"{name}: a module docstring says what it shows"
        assert "__main__" in (EXAMPLES / name).read_text(), f"{name} runs as a script"


def test_engine_loop_restores_from_storage(tmp_path) -> None:
    out = run_example("engine_loop.py", "--storage-dir", str(tmp_path / "l3"))
    rows = re.findall(
        r"^(.+?)\s+(\d+) tokens: device\s+(\d+), host\s+(\d+), storage\s+(\d+)", out, re.M
    )
    tiers = {name.strip(): tuple(map(int, nums[1:])) for name, *nums in rows}
    assert tiers["first request"] == (0, 0, 0)
    assert tiers["same prefix, from device"][0] > 0
    assert tiers["same prefix, from host"][1] > 0
    assert tiers["second cache, same dir"][2] > 0
    assert "the restored K/V equals what was written" in out
    assert any((tmp_path / "l3").rglob("*")), "nothing was stored"


@pytest.mark.slow  # a server
def test_openai_chat_sees_the_shared_system_prompt_cached() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from server_harness import start

    server = start("tiny")
    try:
        out = run_example("openai_chat.py", "--base-url", f"{server.url}/v1")
    finally:
        server.stop()
    cached = [int(n) for n in re.findall(r"cached_tokens=(\d+)", out)]
    device = [int(n) for n in re.findall(r"'device': (\d+)", out)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, out
    assert device == cached, out  # nothing was evicted: every hit is on the device


@pytest.mark.slow  # transformers, then a server process
def test_make_checkpoint_is_served_by_kvtier_serve(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from tokenizers import Tokenizer

    # as the README says: `python examples/make_checkpoint.py ckpt`, then `kvtier serve ckpt`
    out = run_example("make_checkpoint.py", "ckpt", cwd=tmp_path)
    ckpt = tmp_path / "ckpt"
    assert "Llama" in out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in ckpt.iterdir()
    }

    cmd = [sys.executable, "-m", "kvtier", "serve", "ckpt", "--port", "0", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                break
        else:
            raise AssertionError("kvtier serve exited before listening:\n" + "".join(log))
        assert not [ln for ln in log if " WARNING " in ln], log
        assert any("(checkpoint)" in ln for ln in log), log
        assert any("chat template: the checkpoint's" in ln for ln in log), log

        client = openai.OpenAI(base_url=f"{m.group(1)}/v1", api_key="unused", max_retries=0)
        prompt = "A KV cache keeps the attention keys"
        r = client.completions.create(model="ckpt", prompt=prompt, max_tokens=8, temperature=0)
        ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(prompt).ids
        assert r.usage.prompt_tokens == len(ids)
        assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
