"""What a newcomer meets: ``kvtier serve tiny`` as a real process, driven by the official
``openai`` client (text completion, chat, streaming, stop strings), its start-up summary's
capacities against the pools it reports on ``/metrics``, and its shutdown line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_harness import DEADLINE_S, http, wait_ready

from kvtier.engine.byte_tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow  # a server process

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4
STORAGE_BYTES = 64 << 20
TIER = re.compile(r"(device|host) tier: (\d+) pages, (\d+) tokens, .* \((\d+) bytes\);")
STORAGE = re.compile(r"storage tier: file at (\S+): budget .* \((\d+) bytes\), about (\d+) tokens")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def _start(tmp_path: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """``kvtier serve tiny`` with no size flag (the CPU default device pool) on a free port;
    returns the process, its URL and the log lines before it listened."""
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "tiny", "--port", "0", "--device", "cpu"]
    cmd += ["--page-size", str(PAGE), "--storage", "file", "--storage-dir", str(tmp_path)]
    cmd += ["--storage-bytes", "64M"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    for line in proc.stderr:  # the summary comes first, then where it listens
        lines.append(line.rstrip("\n"))
        m = re.search(r"INFO kvtier.server: listening on (http://\S+)", line)
        if m:
            return proc, m.group(1), lines
    proc.wait(timeout=DEADLINE_S)
    raise AssertionError("the server exited before listening:\n" + "\n".join(lines))


def test_serve_tiny_chats_through_the_openai_client(tmp_path) -> None:
    proc, url, startup = _start(tmp_path)
    try:
        wait_ready(url)
        assert not [ln for ln in startup if " WARNING " in ln], startup
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        tok = ByteTokenizer(512)

        r = c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
        text, ids = r.choices[0].text, r.choices[0].model_extra["token_ids"]
        assert r.usage.prompt_tokens == len(tok.encode("Hello")) == 6
        assert len(ids) == 12 and text == tok.decode(ids) and text
        # a stop string from the greedy output: the text ends where it starts
        cut = next(i for i, ch in enumerate(text) if i and ch.isascii() and ch.isprintable())
        stop = text[cut]
        r = c.completions.create(
            model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop]
        )
        assert r.choices[0].text == text[: text.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra["stop_reason"] == stop
        stopped = r.choices[0].model_extra["token_ids"]
        assert stopped == ids[: len(stopped)] and tok.decode(stopped).endswith(stop)
        stream = c.completions.create(
            model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=stop, stream=True
        )
        chunks = [ch.choices[0] for ch in stream]
        assert "".join(ch.text for ch in chunks) == text[: text.index(stop)]
        assert [ch.finish_reason for ch in chunks][-1] == "stop"

        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
        want = tok.encode("<s><|system|>Be brief.<|end|><|user|>Hi!<|end|><|assistant|>", False)
        assert r.usage.prompt_tokens == len(want) == 18
        answer = r.choices[0].message.content
        assert r.choices[0].message.role == "assistant" and answer
        assert answer == tok.decode(r.choices[0].model_extra["token_ids"])
        stream = c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == answer
        # the repeated chat prompt was served from the cache
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 16  # whole pages before the last

        metrics = http().get(f"{url}/metrics").text
        tiers = {m.group(1): m for m in map(TIER.search, startup) if m}
        for tier in ("device", "host"):
            pages, tokens, nbytes = (int(tiers[tier].group(i)) for i in (2, 3, 4))
            assert pages == _metric(metrics, f'kvtier_pool_pages{{state="total",tier="{tier}"}}')
            assert nbytes == _metric(metrics, f"kvtier_cache_{tier}_bytes_total")
            assert tokens == pages * PAGE
        assert int(tiers["device"].group(3)) == 16384  # the CPU default
        assert int(tiers["host"].group(2)) == 2 * int(tiers["device"].group(2))
        storage = next(m for m in map(STORAGE.search, startup) if m)
        assert Path(storage.group(1)) == tmp_path
        assert int(storage.group(2)) == STORAGE_BYTES
        assert _metric(metrics, 'kvtier_storage_bytes{state="budget"}') == STORAGE_BYTES
        page_bytes = int(tiers["device"].group(4)) // int(tiers["device"].group(2))
        assert int(storage.group(3)) == STORAGE_BYTES // page_bytes * PAGE
        assert any("healthy, 0 errors so far" in ln for ln in startup)
        assert any("context length 4096 tokens" in ln for ln in startup)
        assert any("tokenizer: the built-in byte tokenizer" in ln for ln in startup)

        health = http().get(f"{url}/health").json()
        assert health["storage"]["storage_errors"] == {} and health["storage"]["healthy"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S * 3) == 0
        tail = proc.stderr.read()
        assert re.search(
            r"shut down: 0 unfinished request\(s\) ended; at close \d+ host backup page\(s\) and "
            r"\d+ storage page write\(s\) \(.*\) were in flight and landed; storage holds \d+ object",
            tail,
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    objects = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert objects, "the shutdown did not flush the storage writes"
