"""Stop strings, streaming-safe: text that may still turn into a stop string is held back, the
stop string itself is never returned, and the answer does not depend on how the text was cut
into pieces; the engine ends a request on the token that completes one, and the server's
stream shows exactly the engine's text."""

from __future__ import annotations

import json
import random

import pytest

from kvtier.engine import SamplingParams
from kvtier.engine.byte_tokenizer import ByteTokenizer
from kvtier.engine.sampling import StopScan, StopStrings

TOK = ByteTokenizer(512)


def _scan(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], StopScan]:
    scan = StopScan(stops)
    return [scan.push(p) for p in pieces], scan


def test_a_stop_string_split_across_pieces_is_never_shown() -> None:
    out, scan = _scan(["Hello wo", "r", "ld: STO", "P now"], ("STOP",))
    assert out == ["Hello wo", "r", "ld: ", ""]
    assert (scan.matched, scan.cut, scan.flush()) == ("STOP", 13, "")
    assert scan.push("more") == ""  # nothing after a match


def test_a_prefix_that_turns_out_no_stop_is_released() -> None:
    out, scan = _scan(["abc S", "T", "x", " end ST"], ("STOP",))
    assert out == ["abc ", "", "STx", " end "]
    assert scan.matched is None and scan.flush() == "ST"


def test_the_stop_string_completed_first_wins() -> None:
    out, scan = _scan(["xxab", "cd"], ("bcd", "abcde", "cd"))  # bcd and cd end together
    assert (scan.matched, scan.cut) == ("bcd", 3)
    assert "".join(out) == "xxa"
    _, scan = _scan(["abcd"], ("abcd", "bc"))  # bc completes before abcd would
    assert (scan.matched, scan.cut) == ("bc", 1)


def test_any_cut_of_the_text_gives_the_same_answer() -> None:
    rng = random.Random(0)
    alphabet = "ab\n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)}
        )
        whole = StopScan(stops)
        expect = whole.push(text) + whole.flush()
        found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
        assert expect == (text[: min(found)[1]] if found else text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, scan = _scan(pieces, stops)
        assert "".join(out) + scan.flush() == expect
        assert scan.matched == whole.matched
        assert not any(s in "".join(out) for s in stops)  # a stop string was never shown


def test_the_engine_stops_on_the_token_that_completes_a_stop_string() -> None:
    """Byte tokens: the two characters of the stop string come as two tokens."""
    stops = StopStrings(("lo",), TOK)
    ids = TOK.encode("Hello, world", add_special_tokens=False)
    hits = [stops.feed(t) for t in ids]
    assert hits.index(True) == 4  # the 'o' of "Hello"
    assert (stops.matched, stops.text) == ("lo", "Hel")


def test_llm_cuts_its_text_at_the_stop_string() -> None:
    from server_harness import cache_config

    from kvtier.server.lifecycle import build_llm

    llm = build_llm("tiny", cache_config(debug_checks=False))
    try:
        p = TOK.encode("Hello")
        free = llm.generate([p], SamplingParams(max_tokens=20))[0]
        at = next(i for i in range(1, 19) if free.text[i : i + 2].isascii())
        stop = free.text[at : at + 2]  # two one-byte tokens
        assert len(stop) == 2
        out = llm.generate([p], SamplingParams(max_tokens=20, stop=(stop, "never")))[0]
        start = free.text.index(stop)
        assert out.text == free.text[:start]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        n = len(out.output_ids)
        assert out.output_ids == free.output_ids[:n]
        assert TOK.decode(out.output_ids).endswith(stop)
        assert stop not in TOK.decode(out.output_ids[:-1])  # the last token completed it
    finally:
        llm.close()


@pytest.mark.slow  # a live server
def test_the_stream_never_shows_a_stop_string_split_across_tokens() -> None:
    pytest.importorskip("fastapi")
    from server_harness import http, start

    server = start()
    try:
        url = f"{server.url}/v1/completions"
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "temperature": 0}
        text = http().post(url, json=body).json()["choices"][0]["text"]
        # three printable one-byte characters: three tokens
        at = next(
            i
            for i in range(1, len(text))
            if text[i : i + 3].isascii()
            and len(text[i : i + 3]) == 3
            and text[i : i + 3].isprintable()
        )
        stop = text[at : at + 3]
        body.update(stream=True, stop=[stop])
        with http().stream("POST", url, json=body) as r:
            lines = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
        pieces = [c["choices"][0]["text"] for c in lines]
        assert "".join(pieces) == text[: text.index(stop)]
        assert lines[-1]["choices"][0]["finish_reason"] == "stop"
        assert lines[-1]["choices"][0]["stop_reason"] == stop
        ids = [t for c in lines for t in c["choices"][0]["token_ids"]]
        assert TOK.decode(ids).endswith(stop)  # the tokens went on to the stop; the text not
    finally:
        server.stop()
