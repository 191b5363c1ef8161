"""Stand-in ``sglang.srt.utils.common`` for the copy ``scripts/peer_file_only.sh`` makes.

SGLang's file evictor imports ``human_readable_int`` from this module, whose real file imports
most of SGLang's serving stack. The evictor calls it only to parse a size given as a string; the
storage peer passes its size cap as an int, so it is never called, and any call fails loudly.
"""

from __future__ import annotations


def human_readable_int(value: str) -> int:
    raise RuntimeError("sglang.srt.utils.common is a stand-in here (scripts/peer_file_only.sh)")
