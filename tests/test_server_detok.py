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


def test_streamed_chunks_join_to_the_whole_decode() -> None:
    tok = _byte_level()
    ids = tok.encode(TEXT).ids
    whole = tok.decode(ids)
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # characters do get cut
    rng = random.Random(0)
    for _ in range(20):
        detok, out, i = _Detokenizer(tok), [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out.append(detok.feed(ids[i : i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == whole
        assert all("\ufffd" not in piece for piece in out)


def test_without_a_tokenizer_there_is_no_text() -> None:
    assert _Detokenizer(None).feed([1, 2]) is None
