"""Decode steps replayed from CUDA graphs give the tokens and logits of eager steps (CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams, decode_kernel, graphs

cuda = pytest.mark.skipif(
    decode_kernel.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton"
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
    return LLM(
        cfg,
        CacheConfig(page_size=16, device_pages=256, device="cuda", enable_host=False),
        max_running=8,
        cuda_graphs=cuda_graphs,
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
    counts = None if g is None else (g.captures, g.replays)
    llm.cache.check_integrity()
    llm.close()
    return outs, counts


@cuda
def test_graph_replays_equal_eager_steps() -> None:
    eager, none = _run(False)
    replayed, counts = _run(True)
    assert none is None
    captures, replays = counts
    # batch sizes 4, 3, 2, 1 and the crossing of 256 columns: several graphs, mostly replays
    assert captures >= 4 and replays > captures
    for a, b in zip(eager, replayed, strict=True):
        assert a.output_ids == b.output_ids
        assert len(a.logits) == len(b.logits)
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)


@cuda
def test_supported_only_for_the_dense_model_on_cuda() -> None:
    llm = _llm(True)
    assert graphs.supported(llm.model, llm.cache.kv_buffers)
    llm.close()


def test_cuda_graphs_option_is_validated() -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="cuda_graphs"):
        LLM(ModelConfig(), CacheConfig(), cuda_graphs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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
