"""Load or recompute (``restore_policy='cost'``): a restore is taken only where it is faster
than computing the prefix again. A file backend slowed to a chosen rate shows the switch: fast,
the prefix is fetched; slow, no fetch is issued and the prompt is recomputed; in between (a
fetch that cannot land by the prefetch deadline), the front is fetched and the rest recomputed,
with exact page counts from fixed rates. The rates are measured online and exported; a CP group
decides as one; the engine's outputs equal a cold run's in every case."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from factories import PS, SPEC, cache_config, kv_of, make_cache, make_llm, run_request

from kvtier import CacheConfig, TieredCache
from kvtier.controller.restore_cost import (
    PROBE_AFTER,
    CostModel,
    PrefillFit,
    Prefix,
    Queued,
    Rate,
)
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError, RequestError
from kvtier.parallel.group import LocalWorld
from kvtier.storage.file import FileBackend

TOKENS = list(range(200, 232))  # 8 whole pages of PS=4
NEW = [7, 8, 9]
PAGE = SPEC.page_bytes(PS)  # 256 bytes: the tier tests' page, on host and in storage


class SlowFile(FileBackend):
    """A file backend whose reads take ``bytes / rate`` seconds (a slow device, simulated),
    after ``gate`` opened when there is one."""

    rate: float = math.inf
    gate: threading.Event | None = None

    def batch_get(self, keys, buffers):
        if self.gate is not None:
            self.gate.wait()
        got = super().batch_get(keys, buffers)
        time.sleep(sum(b.numel() * b.element_size() for b in buffers[:got]) / self.rate)
        return got


def _seed(tmp_path, tokens: list[int] = TOKENS) -> torch.Tensor:
    """A first cache computes ``tokens`` and writes them through to storage; their bytes."""
    c = make_cache(tmp_path, device_pages=16, host_pages=32)
    first = run_request(c, tokens)
    orig = kv_of(c, first["locs"][: len(tokens)])
    c.close()
    return orig


def _cache(tmp_path, read_rate: float, backend_rate: float | None = None, **kw):
    """A cache over the seeded storage pricing restores at fixed rates (``weight=0``): storage
    reads at ``read_rate`` bytes/s, loads at 2^30 bytes/s, prefill at ``prefill`` tokens/s
    (default 1); its backend reads at ``backend_rate`` (default ``read_rate``)."""
    rates = dict(
        restore_policy="cost",
        restore_rate_weight=0.0,
        restore_storage_rate=read_rate,
        restore_load_rate=float(1 << 30),
        restore_prefill_rate=1.0,
    )
    c = make_cache(tmp_path, **{"device_pages": 16, "host_pages": 32, **rates, **kw})
    slow = SlowFile(c.storage.root, c.namespace, c.config.storage_bytes)
    slow.rate = backend_rate or read_rate
    c.controller.io.backend = slow
    return c


def _serve(c, tokens: list[int]):
    """One request through ``admit``, as an engine writes it: wait, allocate, count the hits and
    the recomputed tokens, write rows, finish. Returns the admission."""
    adm = c.admit(tokens)
    while not c.admit_ready(adm, timeout=5.0):
        pass
    new = c.alloc(adm.num_new, at=adm.cached_len)[: adm.num_new]
    c.record_hits(adm.handle)
    c.record_prefill(adm.num_new)
    rows = torch.randn((SPEC.num_layers, adm.num_new, *SPEC.row_shape))
    c.write_kv(new, rows)
    c.finish(tokens, torch.cat([adm.locs, new]), prefix_len=adm.cached_len, handle=adm.handle)
    return adm


# ---- the switch, at a cache -------------------------------------------------------------------
def test_a_fast_storage_tier_is_fetched(tmp_path) -> None:
    orig = _seed(tmp_path)
    c = _cache(tmp_path, read_rate=PAGE * 1e6)  # a microsecond a page against a second a token
    assert c.match(TOKENS + NEW).storage_len == 32
    adm = _serve(c, TOKENS + NEW)
    assert (adm.storage_tokens, adm.num_new) == (32, 3)
    assert torch.equal(c.read_kv(adm.locs[:32]).cpu(), orig)
    st = c.stats()
    assert (st["prefetched_pages"], st["storage_hit_tokens"], st["recomputed_tokens"]) == (8, 32, 3)
    c.close()


def test_a_slow_storage_tier_is_recomputed_without_a_fetch(tmp_path) -> None:
    _seed(tmp_path)
    # a second a page against a microsecond a token
    c = _cache(tmp_path, read_rate=PAGE, restore_prefill_rate=1e6)
    m = c.match(TOKENS + NEW)
    assert (m.cached_len, m.storage_len, m.handle.storage_keys) == (0, 0, [])
    adm = _serve(c, TOKENS + NEW)
    assert adm.prefetch is None and (adm.storage_tokens, adm.num_new) == (0, 35)
    st = c.stats()
    assert (st["storage_read_bytes"], st["prefetched_pages"]) == (0, 0)  # no fetch issued
    assert (st["storage_hit_tokens"], st["recomputed_tokens"]) == (0, len(TOKENS + NEW))
    c.close()


def test_in_between_the_front_that_lands_by_the_deadline_is_fetched(tmp_path) -> None:
    """20 ms a page to fetch, 80 ms to compute one: worth fetching, but the timeout policy
    stops waiting after 110 ms, so the 8 pages (160 ms) are cut to the 5 that land by then."""
    orig = _seed(tmp_path)
    c = _cache(
        tmp_path,
        read_rate=PAGE / 0.02,
        backend_rate=PAGE / 0.005,  # the device beats the estimate: no race with the deadline
        restore_prefill_rate=PS / 0.08,
        prefetch_policy="timeout",
        prefetch_timeout_s=0.11,
    )
    m = c.match(TOKENS + NEW)
    assert (m.storage_len, len(m.handle.storage_keys)) == (20, 5)
    adm = _serve(c, TOKENS + NEW)
    assert (adm.storage_tokens, adm.num_new) == (20, 15)
    assert torch.equal(c.read_kv(adm.locs).cpu(), orig[:, :20])
    st = c.stats()
    assert (st["prefetched_pages"], st["storage_read_bytes"]) == (5, 5 * PAGE)
    assert (st["storage_hit_tokens"], st["recomputed_tokens"]) == (20, 15)
    c.close()


def test_a_fetch_queued_ahead_on_the_io_thread_makes_the_next_one_not_pay(tmp_path) -> None:
    """100 ms a page to fetch, 125 ms to compute: 8 pages fetch in 0.8 s against 1 s, unless
    another request's 8 pages are still to be read on the same I/O thread (0.8 s more)."""
    other = list(range(300, 332))
    _seed(tmp_path)
    _seed(tmp_path, other)
    c = _cache(tmp_path, read_rate=PAGE / 0.1, backend_rate=math.inf, restore_prefill_rate=32.0)
    c.storage.gate = threading.Event()
    first = c.admit(other + NEW)
    assert first.pending  # its 8 pages wait behind the shut gate
    assert c.match(TOKENS + NEW).storage_len == 0
    c.storage.gate.set()
    assert c.admit_ready(first, timeout=5.0) and first.storage_tokens == 32
    c.abandon(first)
    assert c.match(TOKENS + NEW).storage_len == 32
    c.close()


def test_always_fetches_what_cost_recomputes(tmp_path) -> None:
    """The same slow tier as above under the default policy: fetched, whatever it costs."""
    _seed(tmp_path)
    c = _cache(tmp_path, read_rate=PAGE * 1e3, restore_prefill_rate=1e9, restore_policy="always")
    assert c.match(TOKENS + NEW).storage_len == 32
    assert _serve(c, TOKENS + NEW).storage_tokens == 32
    c.close()


def test_a_host_hit_on_a_slow_link_is_recomputed(tmp_path) -> None:
    """The same rule for host → device loads: flushed to the host tier, the prefix loads at
    2^30 bytes/s, and is recomputed where the link moves a byte a second."""
    for load_rate, host_tokens in ((float(1 << 30), 32), (1.0, 0)):
        c = make_cache(
            tmp_path / str(host_tokens),
            device_pages=16,
            host_pages=32,
            restore_policy="cost",
            restore_rate_weight=0.0,
            restore_load_rate=load_rate,
        )
        run_request(c, TOKENS)
        c.flush(host=False)  # device copies gone: the prefix is in the host tier alone
        m = c.match(TOKENS + NEW)
        assert (m.device_len, m.host_len) == (0, host_tokens)
        adm = _serve(c, TOKENS + NEW)
        assert (adm.host_tokens, adm.num_new) == (host_tokens, 35 - host_tokens)
        assert c.stats()["host_hit_tokens"] == host_tokens
        c.close()


def test_a_host_front_is_loaded_and_a_slow_storage_rest_recomputed(tmp_path) -> None:
    """Per tier: 4 pages in the host tier load; the 4 after them, in storage alone, are
    slower to fetch than to compute."""
    _seed(tmp_path)
    c = _cache(tmp_path, read_rate=PAGE, restore_prefill_rate=1e3)
    run_request(c, TOKENS[:16])  # the first 4 pages computed here: device and host copies
    c.flush(host=False)
    m = c.match(TOKENS + NEW)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 16, 0)
    adm = _serve(c, TOKENS + NEW)
    assert (adm.host_tokens, adm.storage_tokens, adm.num_new) == (16, 0, 19)
    assert c.stats()["storage_read_bytes"] == 0
    c.close()


# ---- rates ------------------------------------------------------------------------------------
def test_rates_are_measured_online_and_the_next_request_follows_them(tmp_path) -> None:
    """Priors say storage is fast; the first fetch (8 pages at 25.6 kB/s: 80 ms) measures the
    backend, and the next request, with another prefix in storage, is recomputed."""
    other = list(range(300, 332))
    _seed(tmp_path)
    _seed(tmp_path, other)
    c = _cache(tmp_path, read_rate=PAGE * 1e6, backend_rate=PAGE * 100, restore_rate_weight=1.0)
    assert c.stats()["restore_storage_read_bytes_per_s"] == PAGE * 1e6  # the prior
    assert _serve(c, TOKENS + NEW).storage_tokens == 32
    c.poll()
    read = c.stats()["restore_storage_read_bytes_per_s"]
    assert PAGE * 50 < read <= PAGE * 100  # the backend's rate, less the I/O's own time
    c.record_prefill(1, 0.5)  # the first forward of its size: set-up, not timed
    c.record_prefill(1, 0.001)  # a token a millisecond: 4 ms a page to compute, 10 to fetch
    one = c.restore_cost.model.work_of(0, 1)  # a cold token's work: a little more than 1
    assert c.stats()["restore_prefill_tokens_per_s"] == pytest.approx(one / 0.001)
    m = c.match(other + NEW)
    assert m.storage_len == 0
    assert _serve(c, other + NEW).storage_tokens == 0
    c.close()


def test_the_engine_measures_its_prefill_and_its_loads() -> None:
    """``LLM`` reports each prefill forward (tokens and time; the first of a size is set-up,
    not a rate) and the cache times its host → device loads: both rates leave their priors
    (the stats and ``/metrics`` report them)."""
    parser = pytest.importorskip("prometheus_client.parser")
    from kvtier.server.prometheus import ServerMetrics

    prompt = list(range(1, 130))
    with make_llm("tiny", restore_prefill_rate=1.0, restore_load_rate=1.0) as llm:
        llm.generate([list(range(200, 240))], SamplingParams(max_tokens=1))
        st = llm.stats()
        assert st["restore_prefill_tokens_per_s"] == 1.0  # the first of its size: no measurement
        assert st["recomputed_tokens"] == 40  # yet counted
        llm.generate([list(range(300, 340))], SamplingParams(max_tokens=1))
        st = llm.stats()
        assert st["restore_prefill_tokens_per_s"] > 1.0  # 40 tokens in well under 40 s
        llm.generate([prompt], SamplingParams(max_tokens=2))
        assert st["restore_load_bytes_per_s"] == 1.0  # nothing loaded yet
        llm.cache.flush(host=False)
        llm.generate([prompt], SamplingParams(max_tokens=2))
        st = llm.stats()
        assert st["host_hit_tokens"] == 128
        assert st["restore_load_bytes_per_s"] > 1.0
        text = ServerMetrics().render(st, {}).decode()
    families = {m.name: m for m in parser.text_string_to_metric_families(text)}
    rates = {
        s.labels["direction"]: s.value
        for s in families["kvtier_transfer_rate_bytes_per_second"].samples
    }
    assert rates["host_to_device"] == st["restore_load_bytes_per_s"]
    assert rates["storage_read"] == st["restore_storage_read_bytes_per_s"]
    prefill = families["kvtier_prefill_rate_tokens_per_second"].samples[0].value
    assert prefill == st["restore_prefill_tokens_per_s"]


def test_a_rate_is_a_decayed_ratio_of_sums() -> None:
    r = Rate(prior=100.0, weight=0.5)
    assert r.value == 100.0
    r.observe(1000, 1.0)
    assert r.value == 1000.0  # the first measurement replaces the prior
    r.observe(0, 1.0)  # a second with nothing moved (a read that timed out)
    assert r.value == 500 / 1.5
    r.observe(10, 0.0)  # no time: dropped
    r.observe(math.nan, 1.0)
    assert (r.value, r.measurements) == (500 / 1.5, 2)
    fixed = Rate(prior=7.0, weight=0.0)
    fixed.observe(1000, 1.0)
    assert fixed.value == 7.0


def _prefix(device=0, usable=0, stored=32, pages=8, cuttable=True) -> Prefix:
    return Prefix(device, usable, stored, pages, PS, 100.0, 100.0, cuttable)


def test_the_plan_picks_the_cheapest_tier_boundary() -> None:
    # 100-byte pages of 4 tokens: 1 s a page to fetch at 100 B/s, loads all but free.
    m = CostModel(storage_read=100.0, load=1e12, prefill=1.0)
    assert m.plan(_prefix()) == 32  # 8 s to fetch against 32 s to compute
    m = CostModel(storage_read=100.0, load=1e12, prefill=3.9)
    assert m.plan(_prefix()) == 32  # 8 s against 8.2 s
    m = CostModel(storage_read=100.0, load=1e12, prefill=4.1)
    assert m.plan(_prefix()) == 0  # 8 s against 7.8 s
    # per tier: the host part [8, 16) loads, the storage rest [16, 48) is computed again
    assert m.plan(_prefix(device=8, usable=16)) == 16
    host = _prefix(device=8, usable=16, stored=0, pages=0)  # 2 host pages, 8 tokens
    assert CostModel(storage_read=100.0, load=50.0, prefill=1.0).plan(host) == 16  # 4 s < 8
    assert CostModel(storage_read=100.0, load=25.0, prefill=1.0).plan(host) == 16  # a tie
    assert CostModel(storage_read=100.0, load=20.0, prefill=1.0).plan(host) == 8  # 10 s > 8


def test_the_plan_counts_what_is_queued_ahead_and_the_deadline() -> None:
    m = CostModel(storage_read=100.0, load=1e12, prefill=1.0, storage_write=50.0)
    assert m.plan(_prefix(), Queued(read_bytes=2300)) == 32  # 23 + 8 s against 32
    assert m.plan(_prefix(), Queued(read_bytes=2500)) == 0  # 25 + 8
    assert m.plan(_prefix(), Queued(read_bytes=2200, write_bytes=50)) == 32  # 22 + 1 + 8
    assert m.plan(_prefix(), Queued(read_bytes=2200, write_bytes=150)) == 0  # 22 + 3 + 8
    m = CostModel(storage_read=100.0, load=100.0, prefill=1.0)  # 1 s a page to load too
    assert m.plan(_prefix(), Queued(load_bytes=1500)) == 32  # 15 + 8 + 8 against 32
    assert m.plan(_prefix(), Queued(load_bytes=1700)) == 0
    # 5.5 s until the deadline: the 5 pages that land by then, if fetching pays at all
    m = CostModel(storage_read=100.0, load=1e12, prefill=1.0)
    assert m.plan(_prefix(), deadline=5.5) == 20
    assert m.plan(_prefix(), Queued(read_bytes=200), deadline=5.5) == 12  # 3.5 s left
    assert m.plan(_prefix(), deadline=0.5) == 0
    assert m.plan(_prefix(), deadline=8.0) == 32
    assert m.plan(_prefix(cuttable=False), deadline=5.5) == 32  # checkpoints: all or nothing
    m = CostModel(storage_read=100.0, load=1e12, prefill=4.1)  # fetching does not pay
    assert m.plan(_prefix(), deadline=5.5) == 0


def test_record_prefill_measures_the_prefill_fit(cache) -> None:
    cache.record_prefill(10)  # no time: a count only
    assert cache.stats()["restore_prefill_tokens_per_s"] == cache.config.restore_prefill_rate
    model = cache.restore_cost.model
    # 30 tokens in the forward: 10 of a prompt after 20 cached, 20 decodes after 100 each
    chunks = [(20, 10)] + [(100, 1)] * 20
    cache.record_prefill(10, 0.5, forward_tokens=30, chunks=chunks)
    # the first forward of its size: set-up, counted without its time
    assert cache.stats()["restore_prefill_tokens_per_s"] == cache.config.restore_prefill_rate
    cache.record_prefill(10, 0.5, forward_tokens=30, chunks=chunks)
    work = model.work_of(20, 10) + 20 * model.work_of(100, 1)
    st = cache.stats()
    # one forward size class: a rate through the origin
    assert st["recomputed_tokens"] == 30
    assert st["restore_prefill_tokens_per_s"] == pytest.approx(work / 0.5)
    assert st["restore_prefill_seconds_per_forward"] == 0.0
    with pytest.raises(RequestError, match="forward_tokens=5 < recomputed_tokens=10"):
        cache.record_prefill(10, 0.5, forward_tokens=5)
    with pytest.raises(RequestError, match="forward_tokens or chunks without seconds"):
        cache.record_prefill(10, forward_tokens=10)
    with pytest.raises(RequestError, match="chunks compute 9 tokens, the forward 10"):
        cache.record_prefill(10, 0.5, chunks=[(0, 9)])
    with pytest.raises(RequestError, match="seconds must be a finite number"):
        cache.record_prefill(10, math.inf)


def test_the_prefill_fit_is_a_launch_floor_and_a_slope() -> None:
    """Short forwards after restores (16 tokens in 30 ms: the launch time) and cold prefills
    (4,096 tokens in 120 ms): a 1K-token forward is priced at the floor, a 32K one by the
    long forwards' seconds per unit, not the short forwards' tokens per second."""
    fit = PrefillFit(prior=1000.0, weight=0.5)
    assert fit.coefficients() == (0.0, 1e-3)  # the prior
    assert fit.seconds(100) == pytest.approx(0.1)
    fit.observe(16, 2.5)  # each size's first forward is set-up: not timed
    fit.observe(4096, 4.0)
    assert (fit.coefficients(), fit.measurements) == ((0.0, 1e-3), 0)
    for x, s in ((16, 0.030), (4096, 0.120), (16, 0.026)):
        fit.observe(x, s)
    # the 16-token class: (0.5 x 0.030 + 0.026) / 1.5 seconds; slope: the 4096 class's
    floor = (0.5 * 0.030 + 0.026) / 1.5
    assert fit.coefficients() == pytest.approx((floor, 0.120 / 4096))
    assert fit.seconds(512) == pytest.approx(floor)  # 27 ms > 512 x 29 us
    assert fit.seconds(1024) == pytest.approx(0.030)
    assert fit.seconds(32768) == pytest.approx(0.960)
    assert fit.value == pytest.approx(4096 / 0.120)
    # forwards of 16 and 31 units share a class; one class is a rate through the origin
    one = PrefillFit(prior=1000.0, weight=0.5)
    one.observe(20, 9.0)  # the class's first: not timed
    one.observe(16, 0.016)
    one.observe(31, 0.031 * 3)
    assert one.coefficients() == pytest.approx((0.0, (0.5 * 0.016 + 0.093) / (0.5 * 16 + 31)))
    # not a measurement: no time, no work, not finite
    for x, s in ((0, 1.0), (10, 0.0), (math.nan, 1.0), (10, math.inf)):
        one.observe(x, s)
    assert one.measurements == 2
    # weight 0: the prior stays, measurements or not
    fixed = PrefillFit(prior=50.0, weight=0.0)
    fixed.observe(10, 1.0)
    assert fixed.coefficients() == (0.0, 0.02) and fixed.known


def test_a_short_prefix_is_recomputed_where_the_forward_costs_its_launch_anyway() -> None:
    """H200 figures: 1K tokens recomputed in 31 ms, the forward after a restore as long (its
    launch); 132 MB to read at 10 GB/s and load at 40 GB/s: restoring costs 16 ms on top of
    the forward, and the recompute only 31 ms in all. At 4K the work (119 ms) outweighs the
    launch and the 4080 restored tokens' 66 ms of bytes."""
    page = 16 * 131072
    m = CostModel(storage_read=10e9, load=40e9, prefill=1000.0, weight=0.5)
    for x, s in ((16, 3.0), (4096, 5.0), (16, 0.030), (4096, 0.119), (16, 0.030)):
        m.observe("prefill", x, s)
    assert m.plan(Prefix(0, 0, 1008, 63, 16, page, page)) == 0
    assert m.plan(Prefix(0, 0, 4080, 255, 16, page, page)) == 4080


def test_a_long_recompute_is_priced_by_the_slope_of_the_forwards_measured() -> None:
    """32K tokens in storage at 10 GB/s (0.43 s, and 0.09 s to load at 50 GB/s) against 32K x
    28 us = 0.92 s to compute: the storage wins; at 2 GB/s (2.15 s) computing does. A rate
    from the short forwards (16 tokens in 15.4 ms: ~1,000 tokens/s) would have fetched at
    both."""
    page = 16 * 131072  # Llama-8B-sized: 128 KiB a token
    for gbps, want in ((10.0, 32768), (2.0, 0)):
        m = CostModel(storage_read=gbps * 1e9, load=5e10, prefill=1000.0, weight=0.1)
        for x in (16, 4096, 16, 4096):  # the first of each size is not timed
            m.observe("prefill", x, 0.015 + 28e-6 * x)
        p = Prefix(0, 0, 32768, 2048, 16, page, page)
        assert m.plan(p) == want, gbps


def test_recomputing_after_a_long_prefix_costs_more_per_token() -> None:
    """With ``RecomputeWork`` the tokens after the restored front are priced by the prefix
    they follow: a host front of 96 tokens makes recomputing the stored 32 dearer than 32
    cold tokens, enough to tip a near tie towards the fetch."""
    from kvtier.tree.recompute import RecomputeWork

    work = RecomputeWork(context=64.0)
    p = Prefix(0, 96, 32, 8, PS, 0.0, 100.0)  # host front free to load, 1 s a page to fetch
    flat = CostModel(storage_read=100.0, load=1e12, prefill=4.1)
    assert flat.plan(p) == 96  # 8 s to fetch against 32 / 4.1 = 7.8 s to compute
    deep = CostModel(storage_read=100.0, load=1e12, prefill=4.1, work=work)
    # 32 x (1 + (96 + 16) / 64) = 88 units = 21.5 s to compute
    assert deep.work_of(96, 32) == pytest.approx(88.0)
    assert deep.plan(p) == 128


def test_restore_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="restore_policy='fast' is not one of always, cost"):
        CacheConfig(restore_policy="fast")
    with pytest.raises(ConfigError, match=r"restore_rate_weight must be a number in \[0, 1\]"):
        CacheConfig(restore_rate_weight=1.5)
    with pytest.raises(ConfigError, match="restore_prefill_rate must be a positive finite"):
        CacheConfig(restore_prefill_rate=0)


def test_a_tier_declined_again_and_again_is_probed_with_one_page(tmp_path) -> None:
    _seed(tmp_path)
    c = _cache(tmp_path, read_rate=PAGE, restore_prefill_rate=1e6)
    for _ in range(PROBE_AFTER - 1):
        assert c.match(TOKENS + NEW).storage_len == 0
    m = c.match(TOKENS + NEW)
    assert (m.storage_len, len(m.handle.storage_keys)) == (PS, 1)  # the probe
    assert c.match(TOKENS + NEW).storage_len == 0  # counted from zero again
    c.close()
    c = make_cache(
        tmp_path / "host",
        device_pages=16,
        host_pages=32,
        restore_policy="cost",
        restore_rate_weight=0.0,
        restore_load_rate=1.0,
    )
    run_request(c, TOKENS)
    c.flush(host=False)
    for _ in range(PROBE_AFTER - 1):
        assert c.match(TOKENS + NEW).host_len == 0
    m = c.match(TOKENS + NEW)
    assert (m.device_len, m.host_len) == (0, PS)  # one page of the host part
    c.lock(m.handle)
    ld = c.load(m)
    assert (ld.locs.numel(), ld.host_tokens) == (PS, PS)
    c.unlock(m.handle)
    c.close()


def test_a_tier_never_measured_is_probed_at_its_first_decline(tmp_path) -> None:
    """A slow prior (one page a second) declines the fetch, but it is a guess: the first
    decline fetches one page, whose read measures the backend; declines after that wait for
    ``PROBE_AFTER`` again."""
    _seed(tmp_path)
    c = _cache(
        tmp_path,
        read_rate=PAGE,
        backend_rate=PAGE * 1e4,
        restore_prefill_rate=1e6,
        restore_rate_weight=0.5,
    )
    m = c.match(TOKENS + NEW)
    assert (m.storage_len, len(m.handle.storage_keys)) == (PS, 1)  # the probe
    assert _serve(c, TOKENS + NEW).storage_tokens == PS
    c.poll()
    assert c.stats()["restore_storage_read_bytes_per_s"] != PAGE  # measured
    c.flush()
    c.record_prefill(1, 0.5)  # a prefill a million times slower than the prior said...
    c.record_prefill(1, 1e-6)  # ...then faster: computing 7 pages beats any fetch
    for _ in range(PROBE_AFTER - 1):
        assert c.match(TOKENS + NEW).storage_len == 0
    c.close()


def test_a_probe_takes_the_front_that_moves_in_the_time_computing_it_takes(tmp_path) -> None:
    """Storage priced at 10 s a page and the prefill at one work unit a second: fetching the
    8 stored pages (80 s) loses to computing their 32 tokens (42.7 units, attention included:
    42.7 s), so the first decline probes, with the 4 pages that land in that time, not one."""
    _seed(tmp_path)
    c = _cache(tmp_path, read_rate=PAGE / 10, backend_rate=PAGE * 1e4, restore_rate_weight=0.5)
    work = c.restore_cost.model.work_of(0, 32)
    assert work == pytest.approx(128 / 3)
    m = c.match(TOKENS + NEW)
    assert (m.storage_len, len(m.handle.storage_keys)) == (4 * PS, 4)
    c.close()


# ---- context parallelism ----------------------------------------------------------------------
def test_a_cp_group_restores_the_least_any_rank_would(tmp_path) -> None:
    """Rank 0's rates say fetch, rank 1's say recompute: both recompute. Without the MIN the
    ranks would lock different prefixes and their trees diverge."""
    _seed(tmp_path)

    def serve(g):
        fast = g.rank == 0
        cfg = cache_config(
            tmp_path / "l3",
            device_pages=16,
            host_pages=32,
            cp_size=2,
            cp_rank=g.rank,
            restore_policy="cost",
            restore_rate_weight=0.0,
            restore_storage_rate=PAGE * 1e6 if fast else PAGE / 1e3,
            restore_prefill_rate=1.0 if fast else 1e6,
        )
        c = TieredCache(cfg, [SPEC], group=g)
        m = c.match(TOKENS + NEW)
        got = (m.cached_len, m.storage_len)
        c.close()
        return got

    assert LocalWorld(2, timeout=30).run(serve) == [(0, 0), (0, 0)]


def test_a_cp_group_refuses_ranks_of_different_restore_policies(tmp_path) -> None:
    def start(g):
        policy = "cost" if g.rank == 0 else "always"
        cfg = cache_config(tmp_path / "l3", cp_size=2, cp_rank=g.rank, restore_policy=policy)
        with pytest.raises(ConfigError, match="restore_policy differs across the ranks"):
            TieredCache(cfg, [SPEC], group=g)

    LocalWorld(2, timeout=30).run(start)


# ---- the engine -------------------------------------------------------------------------------
@pytest.mark.slow  # four tiny engines: 1-3 s
def test_engine_outputs_equal_a_cold_runs_whether_fetched_recomputed_or_split(tmp_path) -> None:
    """``LLM`` (tiny preset, 16-token pages): a prompt of 8 whole pages and one token more is
    computed cold and stored. Engines over the storage tier slowed to 5 ms a page, at fixed
    rates, fetch it all (fast storage, slow prefill), none of it (slow storage), or load the 4
    pages a shorter request left in the host tier and recompute the 4 storage alone holds; each
    generates the cold run's tokens."""
    prompt = list(range(1, 130))
    params = SamplingParams(max_tokens=6)
    with make_llm("tiny", tmp_path) as cold:
        want = cold.generate([prompt], params)[0].output_ids
        page = cold.cache.controller.io.pages.nbytes  # bytes of one stored page
    fast = dict(restore_storage_rate=page * 1e6, restore_prefill_rate=1.0)
    slow = dict(restore_storage_rate=page * 1.0, restore_prefill_rate=1e4)
    cases = {"fetched": (fast, 0, 128), "recomputed": (slow, 0, 0), "split": (slow, 64, 0)}
    for name, (rates, host, fetched) in cases.items():
        with make_llm(
            "tiny",
            tmp_path,
            restore_policy="cost",
            restore_rate_weight=0.0,
            restore_load_rate=float(1 << 30),
            **rates,
        ) as llm:
            backend = SlowFile(llm.cache.storage.root, llm.cache.namespace, 1 << 30)
            backend.rate = page / 0.005
            llm.cache.controller.io.backend = backend
            before = 0
            if host:  # the first 4 pages computed by a request of their own, left on host
                shorter = prompt[:host] + list(range(300, 340))
                llm.generate([shorter], params)
                llm.cache.flush(host=False)
                before = len(shorter)
            assert llm.generate([prompt], params)[0].output_ids == want, name
            st = llm.stats()
            hits = (st["host_hit_tokens"], st["storage_hit_tokens"], st["prefetched_pages"])
            assert hits == (host, fetched, fetched // 16), name
            assert st["recomputed_tokens"] - before == len(prompt) - host - fetched, name
