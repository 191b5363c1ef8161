#!/usr/bin/env bash
# What each front adds to the time to first token, on this machine: three stub instances
# (stub_instance.py: first chunk after 20 ms), then ttft_client.py (400 streaming completions,
# 4 at a time) straight to one stub, through compare.py's round-robin proxy and through
# `kvtier route` (least-loaded: the stubs publish no KV events), ROUNDS times interleaved.
# Run from the repository root with the project's packages importable:
#   bash results/route/overhead/fronts.sh
set -uo pipefail
H=results/route/overhead
ROUNDS=${ROUNDS:-2}
PY=${PYTHON:-python3}
port() { $PY -c 'from kvtier.parallel.ports import free_port; print(free_port())'; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
up() {  # wait until http://127.0.0.1:$1$2 answers
  for _ in $(seq 200); do
    $PY -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1$2', timeout=1)" \
      2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing answers on port $1" >&2; exit 1
}
S=(); for i in 0 1 2; do p=$(port); $PY $H/stub_instance.py "$p" >/dev/null 2>&1 & pids+=($!); S+=("$p"); done
for p in "${S[@]}"; do up "$p" /health; done
RR=$(port); $PY results/route/compare.py proxy --port "$RR" \
  $(for p in "${S[@]}"; do echo --upstream http://127.0.0.1:$p; done) >/dev/null 2>&1 & pids+=($!)
RT=$(port); $PY -m kvtier.cli route --port "$RT" --log-level warning \
  $(for p in "${S[@]}"; do echo --instance http://127.0.0.1:$p; done) >/dev/null 2>&1 & pids+=($!)
up "$RR" /health; up "$RT" /health
for r in $(seq "$ROUNDS"); do
  echo "round $r direct      $($PY $H/ttft_client.py "${S[0]}" 400)"
  echo "round $r round-robin $($PY $H/ttft_client.py "$RR" 400)"
  echo "round $r kvtier-route $($PY $H/ttft_client.py "$RT" 400)"
done
