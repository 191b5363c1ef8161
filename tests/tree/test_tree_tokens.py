"""Token containers at the tree's boundary and the packed token storage."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from tree_helpers import NS, PS, L, P, kids, seq, snapshot

from kvtier.errors import RequestError
from kvtier.keys import chain_keys
from kvtier.tree import RadixTree
from kvtier.tree.tokens import TOKEN_BYTES, as_array, packed

BASE = seq(1, 2, 3) + [7, 8]  # three whole pages and a partial tail of two tokens
CONTAINERS = {
    "list": lambda t: list(t),
    "tuple": lambda t: tuple(t),
    "array_q": lambda t: array("q", t),
    "array_i": lambda t: array("i", t),
    "numpy_int64": lambda t: np.array(t, dtype=np.int64),
    "numpy_int32": lambda t: np.array(t, dtype=np.int32),
    "numpy_strided": lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],
    "tensor_int64": lambda t: torch.tensor(t, dtype=torch.int64),
    "tensor_int32": lambda t: torch.tensor(t, dtype=torch.int32),
    "tensor_strided": lambda t: torch.tensor(t, dtype=torch.int64).repeat_interleave(2)[::2],
}


def build(box) -> tuple[RadixTree, list]:
    tree = RadixTree(PS)
    outs = [
        tree.insert(box(BASE), P(0, 1, 2, 3)),
        tree.insert(box(seq(1, 2, 9)), P(4, 5, 6)),
        tree.insert(box(seq(1, 2, 3) + [7, 8, 5]), P(7, 8, 9, 10)),
        tree.insert(box(seq(1, 2, 3)), P(11, 12, 13), tier="host"),
    ]
    tree.check_integrity()
    summary = [(o.cached_len, L(o.duplicates), [n.id for n in o.taken], o.last.id) for o in outs]
    return tree, summary


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_every_container_gives_the_same_tree_and_matches(name: str) -> None:
    ref_tree, ref_summary = build(CONTAINERS["list"])
    tree, summary = build(CONTAINERS[name])
    assert summary == ref_summary
    assert snapshot(tree) == snapshot(ref_tree)
    box = CONTAINERS[name]
    for q in (BASE, seq(1, 2, 3) + [7, 8, 5, 6], seq(1, 2), seq(1, 4), [1, 1], seq(1, 2, 9, 9), []):
        a, b = tree.match(box(q)), ref_tree.match(list(q))
        assert (a.device_len, a.host_len, a.tail, a.last_pages) == (
            b.device_len,
            b.host_len,
            b.tail,
            b.last_pages,
        )
        assert [n.id for n in a.path] == [n.id for n in b.path]


def test_nodes_pack_their_tokens_as_int32_bytes() -> None:
    assert TOKEN_BYTES == 4
    tree, _ = build(CONTAINERS["list"])
    (trunk,) = tree.root.children.values()
    assert trunk.tokens == tuple(seq(1, 2)) and trunk.num_tokens == 2 * PS
    assert trunk.buf == np.array(seq(1, 2), dtype=np.int32).tobytes()
    assert sorted(kids(trunk)) == [tuple(seq(3)), tuple(seq(9))]
    for n in tree.nodes():
        assert isinstance(n.buf, bytes) and len(n.buf) == 4 * len(n.tokens)


def test_keys_are_the_chain_of_the_unpacked_tokens() -> None:
    # keys hash tokens as int64 whatever the tree stores: the int32 tree keeps every key
    tree = RadixTree(PS)
    big = [2**31 - 1 - i for i in range(3 * PS)] + [-(2**31)]
    out = tree.insert(array("i", big), P(0, 1, 2, 3))
    assert tree.ensure_keys(out.last, NS) == chain_keys(NS, big, PS, tail=True)


def test_matching_does_not_keep_or_alter_the_callers_buffer() -> None:
    tree = RadixTree(PS)
    toks = np.array(seq(1, 2), dtype=np.int64)
    tree.insert(toks, P(0, 1))
    toks[:] = 9  # the caller reuses its buffer
    assert tree.match(seq(1, 2)).matched_len == 2 * PS
    q = array("i", seq(1, 2))
    tree.match(q)
    q.append(3)  # no export still held: the array can grow
    assert list(q) == seq(1, 2) + [3]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1.0, 2.0]),
        np.zeros((2, 2), dtype=np.int64),
        torch.tensor([True, False]),
        torch.tensor([1.5, 2.5]),
        [1, 2.5],
        (2**63,),
    ],
)
def test_non_integer_or_multi_dimensional_tokens_are_refused(bad: object) -> None:
    with pytest.raises(RequestError):
        as_array(bad)  # type: ignore[arg-type]
    with pytest.raises(RequestError):
        RadixTree(PS).match(bad)  # type: ignore[arg-type]


EDGES = [0, 2**31 - 1, -(2**31), 7]
"""The int32 extremes: stored and read back exactly."""


@pytest.mark.parametrize(
    "box",
    [
        lambda t: np.array(t, dtype=np.int32),
        lambda t: array("i", t),
        lambda t: torch.tensor(t, dtype=torch.int32),
        lambda t: torch.tensor(t, dtype=torch.int32)[1:],  # an offset view, still contiguous
    ],
    ids=["numpy_int32", "array_i", "tensor_int32", "tensor_int32_offset"],
)
def test_int32_containers_are_viewed_without_a_copy(box) -> None:
    toks = box(EDGES * PS)
    arr = as_array(toks)
    assert arr.dtype == np.int32 and arr.tolist() == list(toks)
    if isinstance(toks, np.ndarray):
        assert arr is toks
    elif isinstance(toks, torch.Tensor):
        assert arr.ctypes.data == toks.data_ptr() and np.shares_memory(arr, toks.numpy())
    else:
        assert arr.ctypes.data == toks.buffer_info()[0]
    view = np.frombuffer(packed(toks), dtype=np.uint8)
    assert view.ctypes.data == arr.ctypes.data and view.size == 4 * len(toks)


@pytest.mark.parametrize(
    "box",
    [
        list,
        lambda t: array("q", t),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.int64)[::-1][::-1],
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: np.array([x & 0xFFFF for x in t], dtype=np.uint16),
    ],
    ids=["list", "array_q", "numpy_int64", "numpy_view", "tensor_int64", "numpy_uint16"],
)
def test_wider_containers_holding_int32_values_are_cast_once_and_equal(box) -> None:
    toks = box(EDGES * PS)
    want = [int(x) for x in toks]
    arr = as_array(toks)
    assert arr.dtype == np.int32 and arr.flags.c_contiguous and arr.tolist() == want
    tree = RadixTree(PS)
    tree.insert(toks, torch.arange(len(want) // PS))
    (node,) = tree.root.children.values()
    assert node.tokens == tuple(want)
    assert tree.match(array("i", want)).matched_len == len(want)


@pytest.mark.parametrize(
    ("toks", "index", "value"),
    [
        ([1, 2, 3, 4, 5, 2**32], 5, 2**32),
        ((1, 2**31), 1, 2**31),
        ([0, -(2**31) - 1], 1, -(2**31) - 1),
        (np.array([0, 1, 2, -(2**40)], dtype=np.int64), 3, -(2**40)),
        (np.array([0, 2**31], dtype=np.uint32), 1, 2**31),
        (np.array([2**63], dtype=np.uint64), 0, 2**63),
        (torch.tensor([9, 2**31, 2**33], dtype=torch.int64), 1, 2**31),
        (array("q", [5, 5, 2**40]), 2, 2**40),
    ],
    ids=[
        "list",
        "tuple",
        "list_low",
        "numpy_int64",
        "numpy_uint32",
        "numpy_uint64",
        "tensor",
        "array_q",
    ],
)
def test_a_token_outside_int32_is_refused_naming_its_index_and_value(toks, index, value) -> None:
    msg = f"token {index} is {value}: token ids must fit in int32"
    with pytest.raises(RequestError, match=msg):
        as_array(toks)
    tree = RadixTree(PS)
    with pytest.raises(RequestError, match=msg):
        tree.insert(toks, torch.arange(-(-len(toks) // PS)))
    assert not list(tree.nodes())
    # a list whose first page misses is answered without reading the rest: cache that page
    head = [int(x) for x in toks][: index // PS * PS]
    if head:
        tree.insert(head, torch.arange(len(head) // PS))
    with pytest.raises(RequestError, match=msg):
        tree.match(toks)
