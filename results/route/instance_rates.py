"""The rates one ``kvtier serve tiny`` instance of ``compare.py``'s fleet reports in
``/health`` after a multi-turn run (a local Mooncake store, the same pools): what ``kvtier
route`` prices its tiers with. ``python results/route/instance_rates.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvtier.parallel.ports import free_port
from kvtier.storage.mooncake_local import LocalMooncake


def main() -> None:
    store = LocalMooncake(256 << 20, log_dir=tempfile.mkdtemp(prefix="rates-mooncake-"))
    store.start()
    proc = None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "kvtier.cli", "serve", "tiny", "--port", str(port)]
        cmd += ["--device", "cpu", "--page-size", "16", "--device-pages", "64"]
        cmd += ["--host-pages", "384", "--storage", "mooncake", "--storage-url", store.url()]
        cmd += ["--tenant-salt", "fleet", "--log-level", "warning"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        bench = [sys.executable, "-m", "kvtier.cli", "bench", "multiturn", "--url", url]
        bench += ["--clients", "24", "--rounds", "3", "--system-tokens", "256"]
        bench += ["--new-tokens", "64", "--output-tokens", "8", "--concurrency", "4"]
        subprocess.run(bench, check=True, capture_output=True)
        health = json.loads(urllib.request.urlopen(f"{url}/health").read())
        print(json.dumps(health.get("rates"), indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        store.stop()


if __name__ == "__main__":
    main()
