"""``kvtier bench serve --url``: against a running server it requests the model the server lists
at ``/v1/models``, names a model the server does not serve before sending anything, and exits
non-zero naming the first error when requests fail; the multiturn and longdoc workloads send
``bench multiturn``'s prompts, each turn's history with the answer the server gave, at most
``concurrency`` at a time. The server here is a small stdlib stand-in speaking the same
streaming protocol (no engine, no torch: fast)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.bench.multiturn import MultiTurnConfig
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
            if self.server.context is not None:
                for card in cards:
                    card["max_model_len"] = self.server.context
            self._send(200, json.dumps({"object": "list", "data": cards}).encode())
        else:
            self._error(404, "not found")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requested.append(body["model"])
            self.server.prompts.append(body["prompt"])
            self.server.in_flight += 1
            self.server.peak = max(self.server.peak, self.server.in_flight)
        try:
            self._answer(body)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _answer(self, body: dict) -> None:
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

    def __init__(
        self, models: list[str], broken: bool, models_status: int, context: int | None
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models, self.broken, self.models_status = models, broken, models_status
        self.context = context
        self.requested: list[str] = []
        self.prompts: list[list[int]] = []
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def stub(
    models: tuple[str, ...] = ("my-model",),
    broken: bool = False,
    models_status: int = 200,
    context: int | None = None,
) -> Iterator[_Stub]:
    server = _Stub(list(models), broken, models_status, context)
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


LOOP = MultiTurnConfig(
    workload="multiturn", clients=3, rounds=3, concurrency=2, system_tokens=8, new_tokens=4,
    output_tokens=2, progress=False,
)  # fmt: skip


def test_the_multiturn_workload_sends_each_history_with_the_servers_answers() -> None:
    with stub(context=64) as s:
        r = bench_serve(ServeBenchConfig(workload="multiturn", url=s.url, closed_loop=LOOP))
    assert list(r["configs"]) == ["server"] and r["url"] == s.url and r["model"] == "my-model"
    assert (r["requests"], r["requests_ok"], r["errors_by_status"]) == (9, 9, {})
    assert r["outputs_match"] is True and r["tokens_add_up"] is True
    assert "device_tokens" not in r["workload"] and r["workload"]["configs"] == ["server"]
    c = r["configs"]["server"]
    assert c["cache"] is None and c["server_stats"] is None
    assert c["tokens"] == {"device": 0, "host": 0, "storage": 0, "recomputed": 162, "prompt": 162}
    assert c["output_tokens"] == 18 and c["first_round_tokens"]["prompt"] == 3 * 12
    # 8 system + 4 user tokens, then each turn adds the stub's answer [1, 2] and 4 more
    assert sorted(len(p) for p in s.prompts) == [12] * 3 + [18] * 3 + [24] * 3
    system = s.prompts[0][:8]
    by_len = {n: [p for p in s.prompts if len(p) == n] for n in (12, 18, 24)}
    assert all(p[:8] == system for p in s.prompts)
    for shorter, longer in ((12, 18), (18, 24)):
        assert sorted(p[: shorter + 2] for p in by_len[longer]) == sorted(
            [*p, 1, 2] for p in by_len[shorter]
        )
    assert 1 <= s.peak <= 2  # never more than --concurrency in flight


def test_a_failed_turn_ends_its_conversation_and_the_command_exits_1(capsys) -> None:
    with stub(broken=True) as s:
        argv = ["bench", "serve", "--url", s.url, "--workload", "multiturn", "--clients", "3"]
        loop = ["--rounds", "4", "--system-tokens", "8", "--new-tokens", "4", "--output-tokens"]
        assert main([*argv, *loop, "2"]) == 1
    out = capsys.readouterr()
    assert len(s.prompts) == 3  # every first turn, and no turn after a failed one
    assert json.loads(out.out)["configs"]["server"]["errors_by_status"] == {"404": 3}
    assert "kvtier bench serve: 3 of 3 requests failed (404: 3)" in out.err


def test_a_failed_warm_up_question_still_releases_the_later_ones() -> None:
    loop = MultiTurnConfig(
        workload="longdoc", documents=2, document_tokens=8, question_tokens=2, rounds=3,
        output_tokens=2, concurrency=2, progress=False,
    )  # fmt: skip
    with stub(broken=True) as s:
        r = bench_serve(ServeBenchConfig(workload="longdoc", url=s.url, closed_loop=loop))
    assert (r["requests"], r["requests_ok"], len(s.prompts)) == (6, 0, 6)
    assert r["first_error"] == {"status": "404", "message": "The model 'my-model' does not exist"}


def test_a_workload_longer_than_the_servers_context_is_refused_before_any_request() -> None:
    with stub(context=23) as s, pytest.raises(ConfigError) as e:
        bench_serve(ServeBenchConfig(workload="multiturn", url=s.url, closed_loop=LOOP))
    assert s.prompts == []
    assert str(e.value) == (
        "the workload's longest request has 26 tokens (prompt + output tokens) but "
        f"{s.url} serves a context of 23 tokens"
    )


def test_bench_multiturn_with_a_url_runs_the_closed_loop_over_http(tmp_path, capsys) -> None:
    """``kvtier bench multiturn --url``: the same requests as ``bench serve --workload
    multiturn --url``, and its exit status."""
    out = tmp_path / "r.json"
    flags = ["--clients", "3", "--rounds", "2", "--system-tokens", "8", "--new-tokens", "4"]
    flags += ["--output-tokens", "2", "--concurrency", "2"]
    with stub() as s:
        assert main(["bench", "multiturn", "--url", s.url, *flags, "--json", str(out)]) == 0
        sent = sorted(map(tuple, s.prompts))
    with stub() as s:
        assert main(["bench", "serve", "--url", s.url, "--workload", "multiturn", *flags]) == 0
        assert sorted(map(tuple, s.prompts)) == sent and len(sent) == 6
    r = json.loads(out.read_text())
    assert r["url"] is not None and r["requests_ok"] == 6 and r["model"] == "my-model"
    with stub(broken=True) as s:
        assert main(["bench", "multiturn", "--url", s.url, *flags]) == 1
    assert "kvtier bench multiturn: 3 of 3 requests failed (404: 3)" in capsys.readouterr().err
    with stub() as s:
        assert main(["bench", "multiturn", "--url", s.url, "--model", "other", *flags]) == 2


def test_bench_multiturn_refuses_the_flags_of_the_other_mode(capsys) -> None:
    with stub() as s:
        assert main(["bench", "multiturn", "--url", s.url, "--device-tokens", "64"]) == 2
        assert s.prompts == []
    assert "--device-tokens: for the in-process engines, not with --url" in capsys.readouterr().err
    assert main(["bench", "multiturn", "--prompt-format", "text"]) == 2
    assert "--prompt-format: for --url" in capsys.readouterr().err
