"""The presets' byte tokenizer: any UTF-8 text round-trips, special tokens are one id each,
every id decodes, and streamed decoding (``TextStream``, what the server streams with) joins to
the whole text however tokens are grouped, a character cut between tokens waiting for its last
byte."""

from __future__ import annotations

import random

import pytest

from kvtier.engine.byte_tokenizer import CHAT_TEMPLATE, FIRST_SPECIAL, SPECIAL_TOKENS, ByteTokenizer
from kvtier.engine.families import preset, preset_names
from kvtier.engine.sampling import TextStream
from kvtier.errors import ConfigError

TOK = ByteTokenizer(512)
SAMPLES = [
    "",
    "plain ascii, with\ttabs\nand newlines",
    "naïve café — 東京タワー 🚀🚀 résumé; e\u0301 (combining), \x00 NUL, \U0010ffff",
    "<|user|> looks special but <|user| is not",
]


def _random_text(rng: random.Random, n: int) -> str:
    """Code points from every UTF-8 length (1 to 4 bytes), surrogates left out."""
    ranges = [(0x20, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.mark.parametrize("text", SAMPLES)
def test_text_round_trips(text) -> None:
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    assert TOK.encode(text) == [TOK.bos_id, *ids]


def test_random_utf8_round_trips_as_its_bytes() -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randint(0, 40))
        ids = TOK.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert TOK.decode(ids) == text


def test_special_tokens_are_one_id_each_and_skipped_by_default() -> None:
    assert FIRST_SPECIAL == 256 and len(SPECIAL_TOKENS) == 8
    ids = TOK.encode("<s><|user|>hi<|end|>", add_special_tokens=False)
    assert ids == [256, 261, ord("h"), ord("i"), 258]
    assert TOK.decode(ids) == "hi"
    assert TOK.decode(ids, skip_special_tokens=False) == "<s><|user|>hi<|end|>"
    assert (TOK.bos_id, TOK.eos_id, TOK.end_of_turn_id) == (256, 257, 258)


def test_every_id_of_the_vocabulary_decodes() -> None:
    assert TOK.decode([65, 264, 321, 511]) == "A\x08A\ufffd"  # 264, 321: byte 8, byte 65
    assert TOK.token_bytes(300) == bytes([300 % 256]) and TOK.token_bytes(257) == b"</s>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([512])


def test_every_preset_has_room_for_it() -> None:
    for name in preset_names():
        assert ByteTokenizer(preset(name).vocab_size).vocab_size >= 264
    with pytest.raises(ConfigError, match="at least 264 ids"):
        ByteTokenizer(263)


def test_streamed_decoding_holds_cut_characters_back() -> None:
    """One byte per token: a multi-byte character arrives in pieces, and no chunk shows a
    replacement character for it."""
    text = "é東🚀"
    ids = TOK.encode(text, add_special_tokens=False)
    stream = TextStream(TOK)
    assert [stream.feed([i]) for i in ids] == ["", "é", "", "", "東", "", "", "", "🚀"]


def test_streamed_chunks_join_to_the_whole_text_however_grouped() -> None:
    rng = random.Random(1)
    for _ in range(100):
        text = _random_text(rng, rng.randint(1, 30))
        ids = TOK.encode(text)
        stream, out, i = TextStream(TOK), [], 0
        while i < len(ids):
            n = rng.randint(0, 4)  # the engine may report a step without new tokens
            out.append(stream.feed(ids[i : i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == text
        assert all("\ufffd" not in piece for piece in out)


def test_a_cut_character_at_the_end_shows_once_final() -> None:
    ids = TOK.encode("a🚀", add_special_tokens=False)[:-1]  # the rocket's last byte missing
    stream = TextStream(TOK)
    assert stream.feed(ids[:1]) == "a"
    assert stream.feed(ids[1:]) == ""  # the cut character waits for its last byte
    assert stream.feed([], final=True) == "\ufffd"  # which never came


def test_the_built_in_template_speaks_the_special_tokens() -> None:
    from kvtier.server.chat import ChatTemplate

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = ChatTemplate.builtin().render(msgs)
    assert text == "<s><|system|>S<|end|><|user|>U<|end|><|assistant|>"
    assert "{% for m in messages %}" in CHAT_TEMPLATE
    ids = TOK.encode(text, add_special_tokens=False)
    assert ids == [256, 259, ord("S"), 258, 261, ord("U"), 258, 262]
    assert ChatTemplate.builtin().render(msgs, add_generation_prompt=False).endswith("<|end|>")
