"""A byte-level tokenizer that needs no file and no download: what the model presets (random
weights, no checkpoint) encode text and chat with.

Ids ``0..255`` are the UTF-8 bytes; the special tokens (``SPECIAL_TOKENS``: begin and end of
text, end of turn, the chat roles) follow from 256. A preset's other ids, which its random
weights emit as readily as any, read as byte ``id % 256``, so every generated token shows as
text. It offers what ``kvtier.engine.weights.Tokenizer`` offers: ``encode``, ``decode`` (which
the server's streaming decodes windows of, a character cut between tokens showing as a
trailing replacement character until its last byte arrives) and the special tokens' ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvtier.errors import ConfigError

BOS, EOS, END_OF_TURN = "<s>", "</s>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|developer|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (BOS, EOS, END_OF_TURN, *ROLE_TOKENS)
"""Special tokens in id order from ``FIRST_SPECIAL``; text holding them (a rendered chat
template) encodes each to its single id."""
FIRST_SPECIAL = 256

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The built-in chat template the byte tokenizer's special tokens spell: each message as
``<|role|>content<|end|>`` after one ``<s>``, then ``<|assistant|>`` to answer."""

_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


class ByteTokenizer:
    """UTF-8 bytes as token ids below ``vocab_size`` (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        """Raises ``ConfigError`` when ``vocab_size`` leaves no room for the bytes and the
        special tokens."""
        need = FIRST_SPECIAL + len(SPECIAL_TOKENS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < need:
            raise ConfigError(
                f"the byte tokenizer needs a vocabulary of at least {need} ids (256 bytes and "
                f"{len(SPECIAL_TOKENS)} special tokens), got vocab_size={vocab_size!r}"
            )
        self.vocab_size = vocab_size
        self.special_ids = {t: FIRST_SPECIAL + i for i, t in enumerate(SPECIAL_TOKENS)}
        self.bos_token, self.eos_token = BOS, EOS
        self.bos_id, self.eos_id = self.special_ids[BOS], self.special_ids[EOS]
        self.end_of_turn_id = self.special_ids[END_OF_TURN]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``: its UTF-8 bytes, each special token's text as its one id, and
        with ``add_special_tokens`` a leading ``<s>`` (text a chat template rendered holds its
        own)."""
        ids = [self.bos_id] if add_special_tokens else []
        for i, piece in enumerate(_SPLIT.split(text)):
            if i % 2:  # the split's captured separators: the special tokens
                ids.append(self.special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; bytes that are no UTF-8 (a character cut at the end, or ids
        that never formed one) read as U+FFFD. Special tokens are left out unless
        ``skip_special_tokens`` is false."""
        out, run = [], bytearray()
        last_special = FIRST_SPECIAL + len(SPECIAL_TOKENS)
        for t in ids:
            t = int(t)
            if FIRST_SPECIAL <= t < last_special:
                if not skip_special_tokens:
                    out.append(run.decode("utf-8", errors="replace"))
                    out.append(SPECIAL_TOKENS[t - FIRST_SPECIAL])
                    run.clear()
                continue
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")
            run.append(t % 256)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a special token's text in UTF-8)."""
        if FIRST_SPECIAL <= token < FIRST_SPECIAL + len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token - FIRST_SPECIAL].encode()
        return bytes([token % 256])
