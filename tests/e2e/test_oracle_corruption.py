"""The content oracle catches corrupted restores that leave the greedy tokens unchanged: small
deliberate corruptions of host-restored KV (a mid-page row zeroed, 1% noise in one page, one
value negated) move the logits far past the oracle's tolerance, while clean restores stay well
inside it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from test_oracle import BASE_LEN, PS, base_tokens, make_llm

from kvtier.demo.oracle import Expected, compare, default_tolerance
from kvtier.transfer.mover import Mover

PARAMS_MAX_TOKENS = 8
CUTS = [PS + 1, 2 * PS + 5, 3 * PS + 7, BASE_LEN]
KINDS = ("zero_row", "noise", "flip")


def corrupt(kind: str, page: torch.Tensor, gen: torch.Generator) -> None:
    """Damage one host page (``[layers, rows, *row_shape]``) in place."""
    if kind == "zero_row":
        page[:, PS // 2].zero_()
    elif kind == "noise":
        noise = torch.randn(page.shape, generator=gen, dtype=torch.float32)
        page.mul_(1 + 0.01 * noise.to(page.dtype))
    else:
        row = page[page.shape[0] // 2, PS // 2]
        row.view(-1)[row.numel() // 2].neg_()


@contextlib.contextmanager
def corrupted_loads(monkeypatch: pytest.MonkeyPatch, kind: str) -> Iterator[list[int]]:
    """While active, every host → device load copies a corrupted middle page of the anchor
    component (the host copy itself is restored afterwards, so storage and later loads stay
    clean). Yields a list that counts the corrupted loads."""
    original = Mover.host_to_device
    gen = torch.Generator().manual_seed(0)
    loads: list[int] = []

    def load(self: Mover, host_pages, device_pages, overlap: bool = False):  # noqa: ANN202
        buf = self.host.buffers[self.dev.specs[0].name]
        page = int(host_pages[host_pages.numel() // 2])
        saved = buf[page].clone()
        corrupt(kind, buf[page], gen)
        op = original(self, host_pages, device_pages, overlap=overlap)
        if self.cuda:
            torch.cuda.synchronize(self.dev.device)
        buf[page].copy_(saved)
        loads.append(page)
        return op

    with monkeypatch.context() as m:
        m.setattr(Mover, "host_to_device", load)
        yield loads


def prompts() -> list[list[int]]:
    base = base_tokens()
    return [base[:d] + [d % 251, 3] for d in CUTS]


def run(llm, prompt: list[int]):
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=PARAMS_MAX_TOKENS, ignore_eos=True, return_logits=True)
    return llm.generate([prompt], params)[0]


def test_logits_flag_corrupted_restores_that_tokens_miss(monkeypatch) -> None:
    llm = make_llm()
    tol = default_tolerance(llm.model_config.dtype)
    assert tol == 1e-4
    cold = []
    for p in prompts():
        llm.cache.flush()
        out = run(llm, p)
        cold.append(Expected(list(out.output_ids), out.logits))
    run(llm, base_tokens())

    def restored(kind: str | None) -> list[tuple[bool, float]]:
        results = []
        for p, want in zip(prompts(), cold, strict=True):
            llm.cache.flush(host=False)  # the prefix comes back from the host tier
            if kind is None:
                out = run(llm, p)
            else:
                with corrupted_loads(monkeypatch, kind) as loads:
                    out = run(llm, p)
                assert len(loads) == 1
            assert out.cached_host == (len(p) - 1) // PS * PS
            results.append(compare(out.output_ids, out.logits, want))
        return results

    clean = restored(None)
    assert all(same for same, _ in clean)
    assert max(diff for _, diff in clean) <= tol / 10  # measured: <= 3e-6
    missed_by_tokens = 0
    for kind in KINDS:
        results = restored(kind)
        # every corrupted restore is caught by the logits (measured: 2e-3 to 0.5)
        assert min(diff for _, diff in results) > tol, (kind, results)
        missed_by_tokens += sum(same for same, _ in results)
    # ... while the tokens alone pass most of them (measured: all 12 keep their tokens)
    assert missed_by_tokens >= len(KINDS) * len(CUTS) // 2
    llm.close()


def test_compare_stops_at_the_first_differing_token() -> None:
    want = Expected([1, 2, 3], torch.zeros(3, 4))
    logits = torch.zeros(3, 4)
    logits[2, 0] = 5.0  # after the divergence at step 1: not a difference of its own
    logits[1, 3] = 0.5
    assert compare([1, 9, 3], logits, want) == (False, 0.5)
    assert compare([1, 2, 3], logits, want) == (True, 5.0)
    assert compare([1, 2, 3], None, want) == (True, float("inf"))
    assert compare([1, 2, 3], torch.zeros(3, 5), want) == (True, float("inf"))
