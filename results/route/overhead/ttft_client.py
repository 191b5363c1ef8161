"""Time to the first token chunk of N streaming completions, 4 at a time, through the front at
127.0.0.1:PORT: ``python ttft_client.py PORT N`` prints p50 and p90 in ms."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

CONCURRENCY = 4


def main(port: int, n: int) -> None:
    ttfts: list[float] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for i in range(n // CONCURRENCY):
            body = {"model": "tiny", "prompt": "x" * 300 + f"{k}-{i}", "max_tokens": 8}
            body |= {"stream": True, "add_special_tokens": False}
            t0 = time.perf_counter()
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp, first = conn.getresponse(), None
            while line := resp.readline():
                if first is None and line.startswith(b"data: ") and b"token_ids" in line:
                    first = time.perf_counter() - t0
                if line.strip() == b"data: [DONE]":
                    resp.read()
                    break
            with lock:
                ttfts.append(first if first is not None else float("inf"))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(CONCURRENCY)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttfts.sort()
    p50, p90 = ttfts[len(ttfts) // 2], ttfts[int(len(ttfts) * 0.9)]
    wall = time.perf_counter() - t0
    print(f"n={len(ttfts)} p50={p50 * 1e3:.1f} p90={p90 * 1e3:.1f} wall={wall:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
