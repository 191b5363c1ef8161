"""Streamed text: the chunks' text, joined, is the whole output decoded at once (byte-level
BPE, multi-byte characters cut between tokens, any chunking)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi")
tokenizers = pytest.importorskip("tokenizers")

from kvtier.server.app import _Detokenizer  # noqa: E402

TEXT = "naïve café — 東京タワー 🚀🚀 résumé, ünïcödé; plain words and more plain words ✓ 例え"


def _byte_level():  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    return tok


def _word_level():  # noqa: ANN202 - its decoder drops the space before a decode's first word
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)} | {"<unk>": 50}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<x>"])  # id 51: decodes to nothing
    return tok


def test_byte_level_cuts_characters_between_tokens() -> None:
    tok = _byte_level()
    assert "\ufffd" in "".join(tok.decode([i]) for i in tok.encode(TEXT).ids)


@pytest.mark.parametrize(
    ("build", "text"),
    [
        (_byte_level, TEXT),
        (_word_level, " ".join(f"w{i % 50}" if i % 5 else "<x>" for i in range(0, 400, 7))),
    ],
)
def test_streamed_chunks_join_to_the_whole_decode(build, text) -> None:  # noqa: ANN001
    tok = build()
    ids = tok.encode(text).ids
    whole = tok.decode(ids)
    rng = random.Random(0)
    for _ in range(20):
        detok, out, i = _Detokenizer(tok), [], 0
        while i < len(ids):
            n = rng.randint(0, 3)  # the engine may report a step without new tokens
            out.append(detok.feed(ids[i : i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == whole
        assert all("\ufffd" not in piece for piece in out)


def test_without_a_tokenizer_there_is_no_text() -> None:
    assert _Detokenizer(None).feed([1, 2]) is None
