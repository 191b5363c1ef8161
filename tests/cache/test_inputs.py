"""Request inputs are taken exactly or refused with an error naming the value: prompt token
types, every ``SamplingParams`` field, the cache's device on this host; and
``SamplingParams(return_logits=True)`` returns the logits each output token was sampled from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from factories import make_llm as _make_llm

from kvtier.config import CacheConfig, resolve_device
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine.request import Request, checked_tokens, token_ids
from kvtier.errors import ConfigError, RequestError

MODEL = ModelConfig(num_layers=2, max_position=512)
PS = 4


def make_llm(max_running: int = 16, **kw) -> LLM:
    base = dict(
        page_size=PS, device_pages=96, device="cpu", prefetch_policy="timeout", debug_checks=False
    )
    return _make_llm(MODEL, max_running=max_running, **{**base, **kw})


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([3, 1.7, 4], r"prompt token 1 is 1.7 \(float\)"),
        ([3, 4, "5"], r"prompt token 2 is '5' \(str\)"),
        ([True, 2], r"prompt token 0 is True \(bool\)"),
        ([1, np.float32(2.0)], r"prompt token 1 is .*2.0.* \(float32\)"),
        ([1, np.bool_(True)], r"prompt token 1 is .*True.* \(bool"),
        ([1, torch.tensor(2.5)], r"prompt token 1 is tensor\(2.5000\) \(Tensor\)"),
        (torch.tensor([1.0, 2.0]), r"prompt token 0 is tensor\(1.\) \(Tensor\)"),
        ([1, [2, 3]], r"prompt token 1 is \[2, 3\] \(list\)"),
        (torch.tensor(3), r"a prompt tensor must be 1-D, got shape \(\)"),
        (torch.tensor([[1, 2]]), r"a prompt tensor must be 1-D, got shape \(1, 2\)"),
        (7, "prompt must be text or a sequence of token ids, got int"),
        (b"\x01\x02", "prompt must be text or a sequence of token ids, got bytes"),
        ({1, 2}, "prompt must be text or a sequence of token ids, got set"),
    ],
)
def test_prompt_tokens_of_the_wrong_type_are_refused(prompt, needle) -> None:
    with pytest.raises(RequestError, match=needle):
        token_ids(prompt)


def test_integer_scalars_of_numpy_and_torch_are_taken() -> None:
    mixed = [1, np.int64(2), np.uint16(3), torch.tensor(4), torch.tensor(5, dtype=torch.int32)]
    assert token_ids(mixed) == [1, 2, 3, 4, 5]
    assert all(type(t) is int for t in token_ids(mixed))
    assert token_ids(np.array([7, 8], dtype=np.int32)) == [7, 8]
    assert token_ids(torch.tensor([9, 10])) == [9, 10]
    assert token_ids((11,)) == [11]


def test_a_list_of_plain_ints_is_copied_and_a_late_bad_token_still_named() -> None:
    prompt = list(range(1000))
    got = token_ids(prompt)
    assert got == prompt and got is not prompt
    with pytest.raises(RequestError, match=r"prompt token 999 is True \(bool\)"):
        token_ids([*range(999), True])


@pytest.mark.parametrize(
    "prompt", [[5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7]), [5, np.int64(6), torch.tensor(7)]]
)
def test_checked_tokens_hand_back_the_int32_container_with_the_ids(prompt) -> None:
    ids, held = checked_tokens(prompt)
    assert ids == [5, 6, 7] and held.typecode == "i" and held.tolist() == ids
    with pytest.raises(RequestError, match=r"prompt token 1 is 4294967296: token ids must fit"):
        checked_tokens([1, 1 << 32])


def test_the_engine_refuses_a_float_prompt_token_before_queueing() -> None:
    llm = make_llm()
    with pytest.raises(RequestError, match=r"prompt token 2 is 1.7"):
        llm.add_request([5, 6, 1.7])
    assert not llm.has_unfinished()
    # the same ids as numpy and torch integers give the same output as Python ints
    want = llm.generate([[5, 6, 1]], SamplingParams(max_tokens=4))[0].output_ids
    got = llm.generate([np.array([5, 6, 1])], SamplingParams(max_tokens=4))[0].output_ids
    assert got == want
    got = llm.generate([torch.tensor([5, 6, 1])], SamplingParams(max_tokens=4))[0].output_ids
    assert got == want


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([*range(10), 2**31], "prompt token 10 is 2147483648: token ids must fit in int32"),
        ([1, -(2**31) - 1], "prompt token 1 is -2147483649: token ids must fit in int32"),
        ([1, np.int64(2**40)], "prompt token 1 is 1099511627776: token ids must fit in int32"),
        (np.array([0, 0, 2**31]), "prompt token 2 is 2147483648: token ids must fit in int32"),
        (torch.tensor([2**33, 1]), "prompt token 0 is 8589934592: token ids must fit in int32"),
    ],
)
def test_prompt_tokens_outside_int32_are_refused_naming_index_and_value(prompt, needle) -> None:
    with pytest.raises(RequestError, match=needle):
        token_ids(prompt)


def test_the_engine_refuses_a_token_past_int32_before_queueing() -> None:
    llm = make_llm()
    with pytest.raises(RequestError, match="prompt token 1 is 2147483648: token ids must fit"):
        llm.add_request([5, 2**31, 6])
    assert not llm.has_unfinished()
    with pytest.raises(RequestError, match="prompt token 0 is 2147483648"):  # built directly
        Request(0, [2**31], SamplingParams(), 0.0, None)
    with pytest.raises(RequestError, match="prompt token ids must be integers"):
        Request(0, [1, 2.5], SamplingParams(), 0.0, None)


def test_a_request_holds_its_tokens_as_int32_and_outputs_python_ints() -> None:
    edge = [0, 2**31 - 1, -(2**31), 5]
    req = Request(0, edge, SamplingParams(), 0.0, None)
    assert req.tokens.typecode == "i" and req.tokens.itemsize == 4 and req.tokens.tolist() == edge
    req.tokens.extend([7, 8])
    assert req.output == [7, 8] and all(type(t) is int for t in req.output)
    out = req.to_output()
    assert out.prompt == edge and out.output_ids == [7, 8]
    assert all(type(t) is int for t in out.output_ids + out.prompt)
    assert Request(1, [1], SamplingParams(), 0.0, None, tokens=[1, 2]).tokens.typecode == "i"
    llm = make_llm()
    (res,) = llm.generate([[5, 6, 1]], SamplingParams(max_tokens=4))
    assert type(res.output_ids) is list and all(type(t) is int for t in res.output_ids)
    assert len(res.output_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
        ({"temperature": "0.5"}, "temperature must be a finite number >= 0, got '0.5'"),
        ({"temperature": True}, "temperature must be a finite number >= 0, got True"),
        ({"top_p": float("nan")}, r"top_p must be a number in \(0, 1\], got nan"),
        ({"top_p": "1"}, r"top_p must be a number in \(0, 1\], got '1'"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0, got 2.5"),
        ({"top_k": True}, "top_k must be an integer >= 0, got True"),
        ({"top_k": -1}, "top_k must be an integer >= 0, got -1"),
        ({"max_tokens": 4.0}, "max_tokens must be an integer >= 1, got 4.0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"seed": 1.5}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\), got 1.5"),
        ({"seed": "7"}, "seed must be None or an integer .* got '7'"),
        ({"seed": False}, "seed must be None or an integer .* got False"),
        ({"seed": 1 << 64}, "seed must be None or an integer .* got 18446744073709551616"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False, got 1"),
        ({"return_logits": 1}, "return_logits must be True or False, got 1"),
        ({"stop_token_ids": [3]}, r"stop_token_ids must be a tuple of integers, got \[3\]"),
        ({"stop_token_ids": (3, 4.0)}, r"stop_token_ids must be .* got \(3, 4.0\)"),
        ({"stop_token_ids": (True,)}, r"stop_token_ids must be .* got \(True,\)"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a tuple of integers, got 3"),
    ],
)
def test_sampling_params_name_the_bad_value(kwargs, needle) -> None:
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_edges_that_are_valid() -> None:
    p = SamplingParams(temperature=1, top_p=1, top_k=0, seed=-(1 << 63), stop_token_ids=(0,))
    assert not p.greedy and p.make_generator() is not None
    assert SamplingParams(seed=(1 << 64) - 1).seed == (1 << 64) - 1


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("tpu", "device='tpu' is not a torch device name"),
        ("cuda:x", "device='cuda:x' is not a torch device name"),
        ("meta", "device='meta': kvtier runs on cpu or cuda"),
    ],
)
def test_device_names_that_no_host_has(name, needle) -> None:
    have = ", ".join(["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))])
    with pytest.raises(ConfigError, match=f"^{needle}; this host has {have}$"):
        resolve_device(name)


def test_cuda_devices_this_host_lacks() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        with pytest.raises(ConfigError, match="device='cuda' but CUDA is not available"):
            resolve_device("cuda")
    beyond = f"cuda:{count}"
    with pytest.raises(ConfigError, match=f"device='{beyond}'.* this host has cpu"):
        resolve_device(beyond)
    assert resolve_device("cpu") == torch.device("cpu")
    # the config itself is host-independent; the cache start checks it
    cfg = CacheConfig(device=beyond)
    with pytest.raises(ConfigError, match=f"device='{beyond}'"):
        LLM(MODEL, cfg)


def test_return_logits_gives_the_rows_each_token_was_sampled_from() -> None:
    ps = prompts(3, 5, 20, seed=3)
    plain = make_llm().generate(ps, SamplingParams(max_tokens=6))
    assert all(o.logits is None for o in plain)
    outs = make_llm().generate(ps, SamplingParams(max_tokens=6, return_logits=True))
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    for o in outs:
        assert o.logits is not None
        assert o.logits.shape == (6, MODEL.vocab_size)
        assert o.logits.dtype == torch.float32 and o.logits.device.type == "cpu"
        assert o.logits.argmax(-1).tolist() == o.output_ids  # greedy: argmax of each row
    # Row 0 is the prompt's last-position logits: the same forward gives the same bits, and a
    # batch of one differs from the batch of three only in float rounding.
    alone = make_llm().generate([ps[0]], SamplingParams(max_tokens=6, return_logits=True))[0]
    first = make_llm().generate([ps[0]], SamplingParams(max_tokens=1, return_logits=True))[0]
    assert first.logits.shape == (1, MODEL.vocab_size)
    assert torch.equal(first.logits[0], alone.logits[0])
    assert (alone.logits - outs[0].logits).abs().max().item() <= 1e-4


def test_return_logits_stays_aligned_through_preemptions() -> None:
    ps = prompts(4, 10, 14, seed=6)
    params = SamplingParams(max_tokens=24, return_logits=True)
    roomy = make_llm().generate(ps, params)
    tight = make_llm(device_pages=24, enable_host=False).generate(ps, params)
    assert sum(o.preemptions for o in tight) > 0
    for a, b in zip(roomy, tight, strict=True):
        assert b.output_ids == a.output_ids
        assert b.logits.shape == (24, MODEL.vocab_size)
        assert b.logits.argmax(-1).tolist() == b.output_ids
        # re-admission recomputes the same context: the rows agree with the unpreempted run
        assert (b.logits - a.logits).abs().max().item() <= 1e-4
