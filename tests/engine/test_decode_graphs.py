"""Decode steps replayed from CUDA graphs give the tokens and logits of eager steps (CUDA)."""

from __future__ import annotations

import pytest
import torch
from factories import make_llm

from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams, decode_kernel, graphs
from kvtier.engine.batch import SeqSlots


def cuda(test):  # noqa: ANN001, ANN201 - a test function
    """On CUDA with Triton only."""
    return pytest.mark.gpu(
        pytest.mark.skipif(decode_kernel.triton is None, reason="needs Triton")(test)
    )


def _llm(cuda_graphs: bool) -> LLM:
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        max_position=2048,
        dtype="bfloat16",
    )
    return make_llm(
        cfg,
        max_running=8,
        cuda_graphs=cuda_graphs,
        device="cuda",
        device_pages=256,
        enable_host=False,
        prefetch_policy="timeout",
        debug_checks=False,
    )


def _run(cuda_graphs: bool):  # noqa: ANN202
    gen = torch.Generator().manual_seed(3)
    # contexts crossing a 256-column bucket, requests ending at different steps (batch shrinks)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 240, 250, 700)]
    params = [
        SamplingParams(max_tokens=m, ignore_eos=True, return_logits=True) for m in (30, 12, 20, 3)
    ]
    llm = _llm(cuda_graphs)
    outs = llm.generate(prompts, params)
    g = llm.runner.graphs
    counts = None if g is None else (g.captures, g.replays, g.padded)
    st = llm.stats()
    assert (st.get("graph_captures"), st.get("graph_replays"), st.get("graph_padded")) == (
        counts or (None, None, None)
    )
    # only the pad page is left held by the engine once every request finished
    assert llm.cache.stats()["device_pages_engine"] == (0 if g is None else 1)
    llm.check_integrity()
    llm.close()
    return outs, counts


@cuda
def test_graph_replays_equal_eager_steps() -> None:
    eager, none = _run(False)
    replayed, counts = _run(True)
    assert none is None
    captures, replays, padded = counts
    # batch sizes 4, 3 (padded to 4), 2, 1 and contexts of 256 to 768 columns: several
    # graphs, mostly replays
    assert captures >= 3 and replays > captures and padded >= 1
    for a, b in zip(eager, replayed, strict=True):
        assert a.output_ids == b.output_ids
        assert len(a.logits) == len(b.logits)
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)


@cuda
def test_a_padded_batch_replays_the_graph_of_its_bucket() -> None:
    llm = _llm(True)
    g = llm.runner.graphs
    kv = llm.cache.kv_buffers
    pad = g.pad_slot
    gen = torch.Generator().manual_seed(5)
    locs = [llm.cache.alloc(n) for n in (40, 100, 300)]
    ctx = [kv.slots(loc) for loc in locs]
    assert all(pad not in c.tolist() for c in ctx)
    ids = torch.randint(0, 512, (3,), generator=gen).tolist()
    eager = llm.model(
        torch.tensor(ids, device="cuda"),
        torch.tensor([c.numel() - 1 for c in ctx], device="cuda"),
        [SeqSlots(1, c[-1:].cuda(), c.cuda()) for c in ctx],
        kv,
        all_logits=True,
    )
    first = g.forward(ctx, ids).clone()  # recorded for (4, 512): eager on its buffers
    again = g.forward(ctx, ids)  # replayed with one padding row
    assert (g.captures, g.replays, g.padded) == (1, 1, 1)
    assert first.shape == again.shape == (3, 512)
    torch.testing.assert_close(first, eager.float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(again, first, atol=1e-3, rtol=1e-3)
    g.forward(ctx[:2] + [ctx[2][:200]], ids)  # 4 rows again, contexts within 256: a new graph
    assert (g.captures, g.replays) == (2, 1)
    for loc in locs:
        llm.cache.free(loc)
    llm.check_integrity()
    llm.close()


def test_batch_and_context_buckets() -> None:
    assert [graphs.batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 128)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 24, 40, 128,
    ]  # fmt: skip
    sizes = [(c, graphs.context_bucket(c)) for c in (1, 256, 257, 513, 769, 1025, 1537, 2049)]
    assert sizes == [
        (1, 256), (256, 256), (257, 512), (513, 768), (769, 1024), (1025, 1536), (1537, 2048),
        (2049, 3072),
    ]  # fmt: skip
    # a decode from 2K to 32K context crosses 8 buckets (120 at a flat 256 columns)
    assert len({graphs.context_bucket(c) for c in range(2049, 32769)}) == 8
    # past 512 columns a bucket is under 1.5x the context it serves
    assert all(graphs.context_bucket(c) < 1.5 * c for c in range(513, 40000, 7))


@cuda
def test_supported_only_for_the_dense_model_on_cuda() -> None:
    llm = _llm(True)
    assert graphs.supported(llm.model, llm.cache.kv_buffers)
    llm.close()


def test_cuda_graphs_option_is_validated() -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="cuda_graphs"):
        LLM(ModelConfig(), CacheConfig(), cuda_graphs="yes")


@pytest.mark.gpu
def test_the_argmax_read_with_the_logits_is_the_hosts() -> None:
    llm = _llm(cuda_graphs=False)
    runner = llm.runner
    logits = torch.randn(37, 1000, device="cuda")
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the first index wins on both
    ran: list[int] = []
    host = runner._to_host(logits, lambda: ran.append(1))
    assert ran == [1] and torch.equal(host, logits.cpu())
    assert runner._argmax is not None and runner._argmax[0] is host
    assert runner._argmax[1].tolist() == host.argmax(dim=-1).tolist()
    assert runner._argmax[1][3].item() == 7
    llm.close()


def test_without_graphs_no_page_is_held_and_no_graph_counters() -> None:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position=64)  # fmt: skip
    llm = LLM(cfg, CacheConfig(page_size=4, device_pages=8, device="cpu", enable_host=False))
    st = llm.stats()
    assert llm.runner.graphs is None and "graph_captures" not in st
    assert st["device_pages_engine"] == 0
    # every page of the pool is a request's to use: 8 pages of 4 tokens
    out = llm.generate([[1] * 30], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].output_ids) == 2
    llm.close()


def test_the_held_padding_page_is_checked() -> None:
    from kvtier.errors import IntegrityError

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position=64)  # fmt: skip
    llm = LLM(cfg, CacheConfig(page_size=4, device_pages=8, device="cpu", enable_host=False))
    pad = llm._padding
    assert (pad.slot, pad.pages) == (None, 0)  # no graphs on the CPU: nothing held
    pad.locs = llm.cache.alloc(1)  # as on CUDA with graphs
    llm.check_integrity()
    llm.cache.free(pad.locs)  # a bug giving it back: the allocator may hand it to a request
    with pytest.raises(IntegrityError, match="no longer the engine's"):
        llm.check_integrity()
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()  # prefilled, still running
    pad.locs = llm._live[rid].locs[:4].clone()  # the engine's page, but a request's too
    with pytest.raises(IntegrityError, match=f"request {rid} holds the engine's padding page"):
        llm.check_integrity()
    llm.close()
