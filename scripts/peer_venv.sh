#!/bin/sh
# Builds the interpreter the SGLang peers of `kvtier bench tree` and `kvtier bench storage` run
# under (`--peer-python DIR/bin/python`): a venv of its own (default .peer-venv) with the CPU
# torch, sglang 0.5.23 without its serving dependencies, and only the packages that importing
# RadixCache and HiCacheFile needs (scripts/peer_venv/requirements.txt, all --no-deps).
# Nothing of SGLang is installed into the project's own venv.
#
#   sh scripts/peer_venv.sh [DIR]        PYTHON=python3.11 TORCH=torch==2.13.0 to override
set -eu
DIR=${1:-.peer-venv}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
HERE=$(cd "$(dirname "$0")" && pwd)
PY="$DIR/bin/python"

test -x "$PY" || "$PYTHON" -m venv "$DIR"
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "$TORCH"
"$PY" -m pip install -q --no-deps sglang==0.5.23 -r "$HERE/peer_venv/requirements.txt"
# sglang's config package imports torchvision's transforms at import time; the index has no
# CPU torchvision for torch 2.13, so a stand-in that refuses every call takes its place.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$PY" -m pip show -q torchvision >/dev/null 2>&1; then
    mkdir -p "$SITE/torchvision"
    cp "$HERE/peer_venv/torchvision_stub.py" "$SITE/torchvision/__init__.py"
fi
"$PY" -W ignore -c '
import sglang
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
print("sglang", sglang.__version__, "imports: RadixCache, HiCacheFile")
'
echo "peer interpreter: $PY (kvtier bench tree|storage --peer-python $PY)"
