#!/usr/bin/env bash
# On the H200 machine (device tool, carry [".whl"]): unpacks .whl/site312.tar.xz (built by
# build_site.sh), then runs results/route/compare.py once per argument list given in RUNS
# (';'-separated; each a tag, then compare.py's flags), writing $OUT/<tag>.json and the
# instances' logs to $OUT/logs.tgz. The instances run on the CPU, OMP_NUM_THREADS=4 each.
set -uo pipefail
T=/tmp/site
mkdir -p $T && tar xJf .whl/site312.tar.xz -C $T || exit 1
# Keep the machine's own copy of a library where it has one.
for f in $T/_syslibs/*; do
  b=$(basename "$f"); ldconfig -p | grep -qE "^\s+$b \(" && rm "$f"
done
export LD_LIBRARY_PATH=$T/_syslibs PYTHONPATH=$T:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
IFS=';' read -ra runs <<<"${RUNS:-c1}"
for r in "${runs[@]}"; do
  read -ra a <<<"$r"
  tag=${a[0]}
  python3 results/route/compare.py --sglang-python python3 --json "$OUT/$tag.json" "${a[@]:1}" \
    2>&1 | tee "$OUT/$tag.log" | grep -v '^\[compare' | tail -30
done
(cd /tmp && tar czf "$OUT/logs.tgz" route-compare-* 2>/dev/null)
