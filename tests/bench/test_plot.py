"""``kvtier plot`` of tree, storage and compute results: bars, values and target marks."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvtier.bench.plot import kind_of, plot
from kvtier.cli import main

NS = "{http://www.w3.org/2000/svg}"


def _write(tmp_path: Path, name: str, obj: object) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return p


def _draw(tmp_path: Path, *srcs: Path) -> ET.Element:
    out = tmp_path / "out.svg"
    text = plot(out, srcs)
    assert out.read_text(encoding="utf-8") == text
    return ET.fromstring(text)  # well-formed, or this raises


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{NS}text")]


def _bars(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{NS}rect") if r.get("height") != "10"]  # not legend swatches


def _target_ticks(root: ET.Element) -> list[float]:
    return [float(ln.get("x1")) for ln in root.iter(f"{NS}line") if ln.get("stroke") == "#c00"]


def _bar_end(root: ET.Element, value_text: str) -> float:
    """Right end of the bar whose value label reads ``value_text``."""
    texts = list(root.iter(f"{NS}text"))
    (t,) = [t for t in texts if t.text == value_text]
    return float(t.get("x")) - 3


SIDES = {
    "rounds": 3,
    "scale": 1,
    "timer": "time.process_time_ns, gc on",
    "kvtier": {"long_insert_32k": 10.0, "chat_match_768": 4.0},
    "sglang": {"long_insert_32k": 60.0, "chat_match_768": 7.0},
    "speedup": {"long_insert_32k": 6.0, "chat_match_768": 1.75},
}


def test_tree_sides_alone_draws_us_and_speedup_with_per_prefix_targets(tmp_path) -> None:
    src = _write(tmp_path, "tree.json", SIDES)
    assert kind_of(SIDES) == "tree"
    root = _draw(tmp_path, src)
    texts = _texts(root)
    assert {"long_insert_32k", "chat_match_768", "kvtier", "SGLang RadixCache"} <= set(texts)
    # 2 ops x 2 sides of µs, then 2 speedup bars
    assert len(_bars(root)) == 6
    assert {"10", "60", "4", "7", "6", "1.75"} <= set(texts)
    assert texts.count("5x") == 1 and texts.count("2x") == 1
    # the ticks sit where bars of 2 (chat_) and 5 (long_) would end, in the speedup's scale
    zero = float(_bars(root)[-1].get("x"))
    x6, x175 = _bar_end(root, "6"), _bar_end(root, "1.75")
    ticks = sorted(_target_ticks(root))
    per_unit = (x6 - zero) / 6
    assert ticks == pytest.approx([zero + 2 * per_unit, zero + 5 * per_unit], abs=0.2)
    assert x175 - zero == pytest.approx(1.75 * per_unit, abs=0.2)


def test_tree_command_json_without_peer_has_no_speedup_and_draws_the_flat_table(tmp_path) -> None:
    flat = {
        "bench": "tree",
        "num_pages": 2000,
        "ops": {"match_hit": {"mean_us": 3.0}, "lock_unlock": {"mean_us": 1.0}},
        "flat_table": {"match_hit": {"mean_us": 1730.4}},
        "ratio": {"match_hit": 3.0 / 1730.4},
    }
    sides = {k: v for k, v in SIDES.items() if k not in ("sglang", "speedup")}
    cmd = {"bench": "tree", "scenarios": sides, "flat_table": flat}
    root = _draw(tmp_path, _write(tmp_path, "t.json", cmd))
    texts = _texts(root)
    assert "SGLang RadixCache" not in texts and "5x" not in texts and not _target_ticks(root)
    assert any("no SGLang peer" in t for t in texts)
    assert {"match_hit", "tree", "flat table", "3", "1730"} <= set(texts)  # no exponent
    assert any("median of 3 rounds" in t for t in texts)
    assert len(_bars(root)) == 2 + 2  # kvtier µs of 2 ops; tree and flat of match_hit
    alone = _draw(tmp_path, _write(tmp_path, "flat.json", flat))
    assert len(_bars(alone)) == 2 and "2000 pages" in " ".join(_texts(alone))


def _run(pb: int, n: int, peer: dict | None) -> dict:
    run = {
        "page_bytes": pb,
        "num_pages": n,
        "file_backend": {"write_gbps": 2.0, "read_gbps": 3.0},
        "plain_io": {"write_gbps": 4.0, "read_gbps": 5.0},
    }
    if peer is not None:
        run["sglang_hicache_file"] = peer
    return run


def test_storage_draws_sides_and_ticks_nine_tenths_of_plain(tmp_path) -> None:
    peer = {"version": "0.5.23", "write_gbps": 1.25, "read_gbps": 6.5}
    r = {"bench": "storage", "backend": "file", "runs": [_run(1 << 20, 64, peer)]}
    root = _draw(tmp_path, _write(tmp_path, "s.json", r))
    texts = _texts(root)
    assert {"64 x 1 MiB set", "64 x 1 MiB get", "SGLang HiCacheFile", "plain I/O"} <= set(texts)
    assert {"2", "3", "4", "5", "1.25", "6.5"} <= set(texts)
    assert len(_bars(root)) == 6
    assert texts.count("0.9 plain I/O") == 2
    zero = float(_bars(root)[0].get("x"))
    per_unit = (_bar_end(root, "4") - zero) / 4
    assert sorted(_target_ticks(root)) == pytest.approx(
        [zero + 0.9 * 4 * per_unit, zero + 0.9 * 5 * per_unit], abs=0.2
    )


def test_storage_without_peer_or_with_a_failed_one_and_mooncake(tmp_path) -> None:
    none = {"bench": "storage", "backend": "file", "runs": [_run(64 << 10, 1024, None)]}
    failed = {"bench": "storage", "runs": [_run(2 << 20, 256, {"error": "no sglang"})]}
    root = _draw(tmp_path, _write(tmp_path, "a.json", none), _write(tmp_path, "b.json", failed))
    texts = _texts(root)
    assert "SGLang HiCacheFile" not in texts and len(_bars(root)) == 8
    assert {"a: 1024 x 64 KiB set", "b: 256 x 2 MiB get"} <= set(texts)
    assert "no SGLang peer" in texts[0] and "SGLang peer did not run" in texts[0]
    mooncake = {
        "bench": "storage",
        "backend": "mooncake",
        "page_bytes": 2 << 20,
        "num_pages": 256,
        "mooncake_backend": {"write_gbps": 9.0, "read_gbps": 8.0},
        "raw_client": {"write_gbps": 10.0, "read_gbps": 10.0},
    }
    root = _draw(tmp_path, _write(tmp_path, "m.json", mooncake))
    assert {"raw client", "9", "8", "10"} <= set(_texts(root))
    assert _texts(root).count("0.9 raw client") == 2


def test_storage_draws_parallel_plain_when_the_run_has_it(tmp_path) -> None:
    run = _run(1 << 20, 64, None)
    run["io_threads"] = 2
    run["parallel_plain_io"] = {"write_gbps": 7.5, "read_gbps": 11.5}
    r = {"bench": "storage", "backend": "file", "runs": [run]}
    root = _draw(tmp_path, _write(tmp_path, "p.json", r))
    texts = _texts(root)
    assert {"plain I/O on 2 threads", "7.5", "11.5"} <= set(texts)
    assert len(_bars(root)) == 6
    assert texts.count("0.9 plain I/O") == 2


COMPUTE = {
    "bench": "compute",
    "device": "cuda",
    "matmul_tflops": 800.0,
    "prefill": {"prompt_tokens": 32768, "ratio_to_matmul": 0.6},
    "decode": {"batch": 32, "mean_context": 2055.5, "step_s": 0.025, "bound_s": 0.005},
}


def test_compute_draws_prefill_share_and_decode_against_its_bound(tmp_path) -> None:
    root = _draw(tmp_path, _write(tmp_path, "c.json", COMPUTE))
    texts = _texts(root)
    assert {"32768 tokens", "32 x ~2056 tokens", "0.6", "25", "5"} <= set(texts)
    assert {"target 0.40", "2x bound"} <= set(texts)
    assert len(_bars(root)) == 3
    # the dashed 0.40 line of the prefill panel, in that panel's scale
    (dashed,) = [ln for ln in root.iter(f"{NS}line") if ln.get("stroke-dasharray")]
    zero = float(_bars(root)[0].get("x"))
    per_unit = (_bar_end(root, "0.6") - zero) / 0.6
    assert float(dashed.get("x1")) - zero == pytest.approx(0.40 * per_unit, abs=0.2)
    # the 2x-bound tick of the decode panel: 10 ms, between the 5 ms bound and the 25 ms step
    (tick,) = _target_ticks(root)
    ms = (_bar_end(root, "25") - zero) / 25
    assert tick - zero == pytest.approx(10 * ms, abs=0.2)


def test_unknown_json_names_the_file(tmp_path, capsys) -> None:
    other = _write(tmp_path, "window.json", {"bench": "window_memory", "x": 1})
    with pytest.raises(ValueError, match=r"window\.json: not a result plot draws"):
        plot(tmp_path / "o.svg", [other])
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json: not JSON"):
        plot(tmp_path / "o.svg", [bad])
    with pytest.raises(ValueError, match="at least one"):
        plot(tmp_path / "o.svg", [])
    c = _write(tmp_path, "c.json", COMPUTE)
    t = _write(tmp_path, "t.json", SIDES)
    with pytest.raises(ValueError, match=r"one kind at a time.*c\.json \(compute\)"):
        plot(tmp_path / "o.svg", [c, t])
    with pytest.raises(ValueError, match="one tree result"):
        plot(tmp_path / "o.svg", [t, t])
    assert main(["plot", str(tmp_path / "o.svg"), str(other)]) == 2
    assert "window.json" in capsys.readouterr().err
    assert not (tmp_path / "o.svg").exists()
