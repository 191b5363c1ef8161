#!/usr/bin/env bash
# On the H200 machine (device tool, carry [".whl", ".base"]): this tree against another one
# unpacked at .base/ (its kvtier/ and results/route/), on the same machine in one call.
# 1. what each front adds on a stub fleet (overhead/fronts.sh), this tree then .base's;
# 2. REPEAT times, interleaved: compare.py of this tree (fronts FRONTS) and of .base (fronts
#    BASE_FRONTS), each writing $OUT/<tree>_<i>.json and its log; the log dirs go to
#    $OUT/logs.tgz (pooled.py pack reads them).
set -uo pipefail
T=/tmp/site
mkdir -p $T && tar xJf .whl/site312.tar.xz -C $T || exit 1
for f in $T/_syslibs/*; do
  b=$(basename "$f"); ldconfig -p | grep -qE "^\s+$b \(" && rm "$f"
done
export LD_LIBRARY_PATH=$T/_syslibs PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nproc; python3 --version; python3 -c 'import uvloop' 2>&1 | tail -1; uptime
for tree in . .base; do
  echo "== stub fleet, tree $tree"
  (cd $tree && PYTHONPATH=$T:$PWD ROUNDS=2 bash "$OLDPWD/results/route/overhead/fronts.sh")
done
for i in $(seq "${REPEAT:-2}"); do
  for tree in . .base; do
    name=$([ $tree = . ] && echo head || echo base)
    fronts=$([ $tree = . ] && echo "${FRONTS:-prefix,round_robin}" || echo "${BASE_FRONTS:-prefix}")
    PYTHONPATH=$T:$PWD/$tree python3 $tree/results/route/compare.py --sglang-python python3 \
      --json "$OUT/${name}_$i.json" --fronts "$fronts" ${ARGS:-} 2>&1 \
      | tee "$OUT/${name}_$i.log" | grep -v '^\[compare' | tail -12
  done
done
(cd /tmp && tar czf "$OUT/logs.tgz" route-compare-* 2>/dev/null)
