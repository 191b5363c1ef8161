"""Dense attention through SDPA equals plain softmax attention, for every batch shape the
engine forms: decoding sequences of equal and unequal contexts batched together, prefills with
and without a cached prefix, all mixed in one batch over scattered pool slots."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from factories import DEVICE

from kvtier.engine.attention import batched_attention, cached_decode_plan, paged_attention
from kvtier.engine.batch import SeqSlots

HEADS, KV_HEADS, D = 4, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA softmax attention of the context's last ``len(q)`` positions, written out."""
    n, c = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, kk) / math.sqrt(D)
    q_pos = torch.arange(c - n, c)[:, None]
    scores = scores.masked_fill(torch.arange(c)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), vv)


def batch(
    ctx_lens: list[int],
    num_new: list[int],
    gen: torch.Generator,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
):
    rows = sum(ctx_lens) + 16
    # every row finite: the padding of unequal contexts reads real rows, masked out
    kv = torch.randn(rows, 2, KV_HEADS, D, generator=gen).to(device, dtype)
    perm = torch.randperm(rows, generator=gen)
    seqs, start = [], 0
    for c, n in zip(ctx_lens, num_new, strict=True):
        locs = perm[start : start + c].to(device)
        seqs.append(SeqSlots(n, locs[c - n :], locs))
        start += c
    q = torch.randn(sum(num_new), HEADS, D, generator=gen).to(device, dtype)
    return q, seqs, kv


def check(ctx_lens: list[int], num_new: list[int], seed: int = 0) -> None:
    q, seqs, kv = batch(ctx_lens, num_new, torch.Generator().manual_seed(seed))
    got = batched_attention(q, seqs, kv)
    assert got.shape == q.shape
    start = 0
    for s in seqs:
        ctx = kv[s.ctx_locs]
        want = reference(q[start : start + s.num_new], ctx[:, 0], ctx[:, 1])
        torch.testing.assert_close(got[start : start + s.num_new], want, rtol=0, atol=1e-12)
        start += s.num_new


def test_decode_batch_equal_contexts() -> None:
    check([9, 9, 9], [1, 1, 1])


def test_decode_batch_unequal_contexts() -> None:
    check([3, 17, 1, 8], [1, 1, 1, 1])


def test_prefill_cold_and_after_a_prefix() -> None:
    check([12], [12])
    check([20], [7])


def test_mixed_batch_with_decodes_between_prefills() -> None:
    check([5, 14, 6, 30, 11, 2], [1, 14, 1, 9, 1, 1], seed=3)


def test_single_sequence_helper_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, HEADS, D, generator=gen, dtype=torch.float64)
    k = torch.randn(10, KV_HEADS, D, generator=gen, dtype=torch.float64)
    v = torch.randn(10, KV_HEADS, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(paged_attention(q, k, v), reference(q, k, v), rtol=0, atol=1e-12)


def test_plan_is_built_once_per_batch() -> None:
    _, seqs, _ = batch([4, 6], [1, 1], torch.Generator().manual_seed(1))
    plan = cached_decode_plan(seqs, torch.device("cpu"))
    assert plan is not None and cached_decode_plan(seqs, torch.device("cpu")) is plan
    assert plan.locs.shape == (2, 6) and plan.visible is not None
    assert plan.visible.sum(dim=1).tolist() == [4, 6]
    # the padding repeats the sequence's own first slot
    assert plan.locs[0, 4:].tolist() == [int(seqs[0].ctx_locs[0])] * 2
    # the same slots with another split between cached and new tokens: a new plan
    other = [SeqSlots(2, s.ctx_locs[-2:], s.ctx_locs) for s in seqs]
    assert cached_decode_plan(other, torch.device("cpu")) is None


CASES = {
    "decode_equal": ([40, 40, 40], [1, 1, 1]),
    "decode_unequal": ([3, 70, 17, 40], [1, 1, 1, 1]),
    "cold_prefill": ([64], [64]),
    "prefix_prefill": ([96], [24]),
    "mixed": ([5, 33, 6, 80, 11], [1, 33, 1, 20, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_on_the_test_device_uses_fused_kernels(case: str) -> None:
    """In bf16 on ``KVTIER_TEST_DEVICE``; on CUDA only the flash and memory-efficient kernels
    are allowed, so a call they do not take fails instead of falling back to the math one."""
    ctx_lens, num_new = CASES[case]
    q, seqs, kv = batch(ctx_lens, num_new, torch.Generator().manual_seed(7), torch.bfloat16, DEVICE)
    fused = contextlib.nullcontext()
    if DEVICE.startswith("cuda"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    with fused:
        got = batched_attention(q, seqs, kv).float().cpu()
    start = 0
    for s in seqs:
        ctx = kv[s.ctx_locs].double().cpu()
        want = reference(q[start : start + s.num_new].double().cpu(), ctx[:, 0], ctx[:, 1])
        torch.testing.assert_close(got[start : start + s.num_new], want.float(), rtol=0, atol=3e-2)
        start += s.num_new
