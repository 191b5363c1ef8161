"""``kvtier bench serve --url``: against a running server it requests the model the server lists
at ``/v1/models``, names a model the server does not serve before sending anything, and exits
non-zero naming the first error when requests fail. The server here is a small stdlib stand-in
speaking the same streaming protocol (no engine, no torch: fast)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.bench.serve import ServeBenchConfig, bench_serve, served_model
from kvtier.cli import main
from kvtier.errors import ConfigError


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the benchmark's clients expect
    server: _Stub

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message}}).encode())

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            self._send(200, b"{}")
        elif self.path == "/v1/models":
            if self.server.models_status != 200:
                self._error(self.server.models_status, "missing or wrong API key")
                return
            cards = [{"id": m, "object": "model"} for m in self.server.models]
            self._send(200, json.dumps({"object": "list", "data": cards}).encode())
        else:
            self._error(404, "not found")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requested.append(body["model"])
        if body["model"] not in self.server.models or self.server.broken:
            self._error(404, f"The model {body['model']!r} does not exist")
            return
        n = body["max_tokens"]
        chunks = [
            {"choices": [{"index": 0, "token_ids": list(range(1, n + 1))}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": n,
                    "prompt_tokens_details": {
                        "cached_tokens_by_tier": {"device": 0, "host": 0, "storage": 0},
                        "recomputed_tokens": len(body["prompt"]),
                    },
                },
            },
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, sse.encode(), "text/event-stream")


class _Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, models: list[str], broken: bool, models_status: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models, self.broken, self.models_status = models, broken, models_status
        self.requested: list[str] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def stub(
    models: tuple[str, ...] = ("my-model",), broken: bool = False, models_status: int = 200
) -> Iterator[_Stub]:
    server = _Stub(list(models), broken, models_status)
    # a short poll interval only makes shutdown() return sooner
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_model_comes_from_the_server_and_every_request_succeeds(capsys) -> None:
    with stub() as s:
        cfg = ServeBenchConfig(clients=2, conversations=1, turns=2, max_tokens=3, url=s.url)
        r = bench_serve(cfg)
    assert s.requested == ["my-model"] * 4  # not the in-process default "tiny"
    assert r["config"]["model"] == "my-model"
    assert (r["requests"], r["requests_ok"], r["errors_by_status"]) == (4, 4, {})
    assert r["completion_tokens"] == 12 and r["first_error"] is None
    err = capsys.readouterr().err
    assert "serve: 4/4 requests" in err  # the progress line, on stderr


def test_requests_that_fail_exit_1_naming_the_first_error(capsys) -> None:
    with stub(broken=True) as s:
        code = main(["bench", "serve", "--url", s.url, "--clients", "2", "--conversations", "1"])
    out = capsys.readouterr()
    assert code == 1
    result = json.loads(out.out)
    assert (result["requests"], result["requests_ok"]) == (2, 0)  # a failed turn ends its chat
    assert out.err.rstrip().endswith(
        "kvtier bench serve: 2 of 2 requests failed (404: 2); "
        "first: 404 The model 'my-model' does not exist"
    )
    assert "2 failed" in out.err  # the progress line counts them


def test_a_model_the_server_does_not_serve_is_named_before_any_request(capsys) -> None:
    with stub() as s:
        assert main(["bench", "serve", "--url", s.url, "--model", "tiny"]) == 2
        assert s.requested == []
    assert capsys.readouterr().err.strip() == (
        f"kvtier bench serve: --model 'tiny' is not served by {s.url}; it serves my-model"
    )


def test_a_server_of_several_models_needs_model_named() -> None:
    with stub(models=("a", "b")) as s:
        with pytest.raises(ConfigError, match=r"serves 2 models \(a, b\): name one with --model"):
            served_model(s.url, None, None, 5.0)
        assert served_model(s.url, "b", None, 5.0) == "b"


def test_a_models_list_refused_for_want_of_a_key_says_so() -> None:
    with stub(models_status=401) as s, pytest.raises(ConfigError) as e:
        bench_serve(ServeBenchConfig(clients=1, turns=1, url=s.url))
    assert str(e.value) == (
        f"{s.url}/v1/models answered 401: missing or wrong API key "
        "(does the server expect --api-key?)"
    )
