"""Which forwards read their logits back to the host: a greedy batch on CUDA reads only each
row's argmax; sampling, drafts and ``return_logits`` read the rows."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import SamplingParams
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import Work

cuda = pytest.mark.gpu


def _work(params: SamplingParams, draft: list[int] | None = None) -> Work:
    gen = params.make_generator()
    req = Request(0, [1, 2, 3], params, 0.0, gen)
    return Work(req, 1 + len(draft or []), draft=list(draft or []))


def test_only_a_greedy_batch_leaves_its_logits_on_the_device() -> None:
    greedy = _work(SamplingParams())
    assert not ModelRunner.needs_logits([greedy, _work(SamplingParams(max_tokens=3))])
    assert ModelRunner.needs_logits([greedy, _work(SamplingParams(return_logits=True))])
    assert ModelRunner.needs_logits([greedy, _work(SamplingParams(), draft=[5, 6])])
    sampled = Request(1, [1, 2], SamplingParams(temperature=0.7), 0.0, torch.Generator())
    assert ModelRunner.needs_logits([greedy, Work(sampled, 1)])
    # a sampled request without a generator is sampled by argmax (``sample``'s own rule)
    no_gen = Request(2, [1, 2], SamplingParams(temperature=0.7), 0.0, None)
    assert not ModelRunner.needs_logits([greedy, Work(no_gen, 1)])
    assert not ModelRunner.needs_logits([])


@cuda
def test_an_argmax_only_read_keeps_the_rows_on_the_device() -> None:
    from test_decode_graphs import _llm

    llm = _llm(cuda_graphs=False)
    runner = llm.runner
    logits = torch.randn(37, 1000, device="cuda")
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the first index wins
    ran: list[int] = []
    host = runner._to_host(logits, lambda: ran.append(1), full=False)
    assert ran == [1] and host.shape == (37, 0) and host.device.type == "cpu"
    assert runner._argmax is not None and runner._argmax[0] is host
    assert runner._argmax[1].tolist() == logits.cpu().argmax(dim=-1).tolist()
    assert runner._argmax[1][3].item() == 7
    llm.close()


@cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_greedy_outputs_without_logits_equal_those_with_them(cuda_graphs: bool) -> None:
    from test_decode_graphs import _llm

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 130, 300)]
    outs = []
    for keep in (True, False):
        llm = _llm(cuda_graphs)
        params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=keep)
        outs.append([o.output_ids for o in llm.generate(prompts, params)])
        llm.cache.check_integrity()
        llm.close()
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[1])
