"""The demo's summary: per-phase rows, tier totals and the oracle's verdict, as JSON and as a
text table."""

from __future__ import annotations


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize_phases(config: dict, phases: list) -> dict:
    """The JSON summary of ``phases`` (``PhaseReport``s) under the demo's ``config``."""
    rows = []
    for p in phases:
        rows.append(
            {
                "phase": p.name,
                "requests": p.requests,
                "prompt_tokens": p.prompt_tokens,
                "output_tokens": p.output_tokens,
                "device_hit_tokens": p.device_hit_tokens,
                "host_hit_tokens": p.host_hit_tokens,
                "storage_hit_tokens": p.storage_hit_tokens,
                "recomputed_tokens": p.recomputed_tokens,
                "ttft_p50_ms": 1e3 * _pct(p.ttft_s, 0.5),
                "ttft_p90_ms": 1e3 * _pct(p.ttft_s, 0.9),
                "throughput_tok_s": (p.prompt_tokens + p.output_tokens) / p.wall_s
                if p.wall_s
                else 0.0,
                "oracle_checked": p.checked,
                "oracle_mismatches": p.mismatches,
                "oracle_token_mismatches": p.token_mismatches,
                "oracle_logit_mismatches": p.logit_mismatches,
                "logit_tolerance": p.logit_tolerance,
                "max_logit_diff": p.max_logit_diff,
                "cache": p.cache,
            }
        )

    def total(key: str) -> int:
        return sum(r[key] for r in rows)

    return {
        "config": config,
        "phases": rows,
        "tiers": {
            k: total(k)
            for k in (
                "device_hit_tokens",
                "host_hit_tokens",
                "storage_hit_tokens",
                "recomputed_tokens",
            )
        },
        "oracle": {
            "checked": total("oracle_checked"),
            "mismatches": total("oracle_mismatches"),
            "token_mismatches": total("oracle_token_mismatches"),
            "logit_mismatches": total("oracle_logit_mismatches"),
            "logit_tolerance": max(r["logit_tolerance"] for r in rows),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows),
        },
    }


def format_table(summary: dict) -> str:
    cols = [
        ("phase", "phase", "{}"),
        ("requests", "requests", "{}"),
        ("tokens", None, "{}"),
        ("device hit", "device_hit_tokens", "{}"),
        ("host hit", "host_hit_tokens", "{}"),
        ("storage hit", "storage_hit_tokens", "{}"),
        ("recomputed", "recomputed_tokens", "{}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
        ("TTFT p90 ms", "ttft_p90_ms", "{:.1f}"),
        ("tok/s", "throughput_tok_s", "{:.0f}"),
        ("max dlogit", "max_logit_diff", "{:.1e}"),
        ("oracle", None, "{}"),
    ]
    lines = []
    for r in summary["phases"]:
        cells = []
        for _, key, fmt in cols:
            if key is not None:
                cells.append(fmt.format(r[key]))
            elif _ == "tokens":
                cells.append(str(r["prompt_tokens"] + r["output_tokens"]))
            else:
                ok = r["oracle_mismatches"] == 0
                cells.append(
                    f"{'ok' if ok else 'MISMATCH'} {r['oracle_checked'] - r['oracle_mismatches']}/{r['oracle_checked']}"
                )
        lines.append(cells)
    head = [c[0] for c in cols]
    widths = [max(len(head[i]), *(len(line[i]) for line in lines)) for i in range(len(cols))]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    o = summary["oracle"]
    verdict = "PASS" if o["mismatches"] == 0 else "FAIL"
    out.append(
        f"oracle: {verdict} ({o['checked']} requests compared with cold runs: "
        f"{o['token_mismatches']} with other tokens, {o['logit_mismatches']} with a logit "
        f"more than {o['logit_tolerance']:.1e} off; max difference {o['max_logit_diff']:.1e})"
    )
    return "\n".join(out)
