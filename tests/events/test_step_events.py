"""An engine step ends with its KV events published: the pages a finished request leaves in
the cache are announced when ``step`` returns, not at a later step's poll, which an engine
going idle (a server between requests) may never take."""

from __future__ import annotations

from factories import make_llm

from kvtier.engine import SamplingParams
from kvtier.events.hashing import chain_hashes


class Recorder:
    """An ``EventSink`` keeping every batch."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, batch: list) -> bool:
        self.batches.append(batch)
        return True

    def close(self) -> None:
        pass


def stored(batches: list[list], medium: str) -> set[int]:
    out: set[int] = set()
    for _ts, events, _rank in batches:
        for ev in events:
            if ev[0] == "BlockStored" and ev[6] == medium:
                out.update(ev[1])
    return out


def test_a_finished_requests_pages_are_announced_by_the_end_of_its_step() -> None:
    with make_llm("tiny") as llm:
        sink = Recorder()
        llm.cache.controller.publish_events(sink)
        prompt = list(range(1, 41))
        out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        page = llm.cache.tree_page_tokens
        want = set(chain_hashes(prompt + out.output_ids[:-1], page))
        # generate returned after its last step: no poll since, yet every whole page is out
        assert want and want <= stored(sink.batches, "device")
