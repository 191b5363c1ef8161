#!/usr/bin/env bash
# On the H200 machine (device tool, carry [".whl", ".base"]): this tree against another
# tree's kvtier/, unpacked at .base/ beside this tree's results/route/ (and listed in
# .git/info/exclude), e.g.
#   mkdir .base && git archive COMMIT kvtier | tar x -C .base
#   git archive HEAD results/route | tar x -C .base
# on the same machine in one call:
# 1. what each front adds on a stub fleet (overhead/fronts.sh), this tree then .base's;
# 2. REPEAT times (default 3), interleaved: compare.py of this tree with fronts FRONTS
#    (default prefix,round_robin,sglang) and of .base with BASE_FRONTS (default prefix),
#    with compare.py flags ARGS (default --pin: every instance on CPUs of its own), writing
#    $OUT/{head,base}_<i>.json and .log; their log dirs (/tmp/route-compare-<tree>-<i>)
#    go to $OUT/logs.tgz. Then, here:
#      tar xzf logs.tgz -C /tmp/X
#      python results/route/pooled.py pack OUT.json $(for t in head base; do
#        for d in /tmp/X/route-compare-$t-*; do echo "$d:$t"; done; done)
#      python results/route/pooled.py OUT.json
#      python results/route/verdict.py head_*.json    # run by run: ahead of both on both?
# NO_SITE=1: use the python3 on PATH with its own packages (a dry run off the device).
set -uo pipefail
T=/tmp/site
mkdir -p $T
if [ -z "${NO_SITE:-}" ]; then
  tar xJf .whl/site312.tar.xz -C $T || exit 1
  for f in $T/_syslibs/*; do
    b=$(basename "$f"); ldconfig -p | grep -qE "^\s+$b \(" && rm "$f"
  done
fi
export LD_LIBRARY_PATH=$T/_syslibs PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
nproc; python3 --version; python3 -c 'import uvloop' 2>&1 | tail -1; uptime
if [ -z "${NO_STUBS:-}" ]; then
  for tree in . .base; do
    echo "== stub fleet, tree $tree"
    (cd $tree && PYTHONPATH=$T:$PWD ROUNDS=2 bash "$OLDPWD/results/route/overhead/fronts.sh")
  done
fi
for i in $(seq "${REPEAT:-3}"); do
  for tree in . .base; do
    name=$([ $tree = . ] && echo head || echo base)
    fronts=$([ $tree = . ] && echo "${FRONTS:-prefix,round_robin,sglang}" \
      || echo "${BASE_FRONTS:-prefix}")
    PYTHONPATH=$T:$PWD/$tree python3 $tree/results/route/compare.py --sglang-python python3 \
      --json "$OUT/${name}_$i.json" --logdir "/tmp/route-compare-$name-$i" --fronts "$fronts" \
      ${ARGS---pin} 2>&1 | tee "$OUT/${name}_$i.log" | grep -E 'ok, |FAILED' | cut -c1-400
  done
done
(cd /tmp && tar czf "$OUT/logs.tgz" route-compare-head-* route-compare-base-* 2>/dev/null)
