#!/bin/sh
# Copies, unchanged, the modules of an installed SGLang that its HiCacheFile needs into DIR
# (default .peer-file), for a host that cannot install the peer venv (no network, another
# Python): `kvtier bench storage --peer-python DIR/python` then runs SGLang's own HiCacheFile
# under that host's torch (DIR/python runs $PEER_BASE_PYTHON, default python3, with DIR on its
# path). SGLang's top-level __init__.py, which imports its serving
# stack, is left out, as is that of its storage package: they load as namespace packages. Its dist-info comes along, so
# the peer still reports SGLang's version.
#
#   sh scripts/peer_file_only.sh [DIR] [PEER_PYTHON]   (default PEER_PYTHON: .peer-venv/bin/python;
#   CHECK_PYTHON: an interpreter with torch and without SGLang, default .venv/bin/python)
set -eu
DIR=${1:-.peer-file}
PY=${2:-.peer-venv/bin/python}
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$DIR"
for f in sglang/srt/environ.py sglang/srt/mem_cache/hicache_storage.py \
         sglang/srt/mem_cache/storage/file/__init__.py \
         sglang/srt/mem_cache/storage/file/lru_file_evictor.py; do
    if [ -f "$SITE/$f" ]; then
        mkdir -p "$DIR/$(dirname "$f")"
        cp "$SITE/$f" "$DIR/$f"
    fi
done
cp -r "$SITE"/sglang-*.dist-info "$DIR/"
# The evictor imports one size parser from sglang.srt.utils.common, whose real file pulls in the
# serving stack; a stand-in that refuses to run takes its place (the peer never calls it).
mkdir -p "$DIR/sglang/srt/utils"
cp "$(dirname "$0")/peer_venv/utils_common_stub.py" "$DIR/sglang/srt/utils/common.py"
cat > "$DIR/python" <<'WRAP'
#!/bin/sh
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHONPATH="$HERE" exec "${PEER_BASE_PYTHON:-python3}" "$@"
WRAP
chmod +x "$DIR/python"
# Checked under an interpreter without SGLang installed (the copy must stand alone).
CHECK=${CHECK_PYTHON:-.venv/bin/python}
test -x "$CHECK" || CHECK=python3
PEER_BASE_PYTHON="$CHECK" "$DIR/python" -c 'from importlib.metadata import version
import sys
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
print("sglang", version("sglang"), "HiCacheFile from", sys.modules[HiCacheFile.__module__].__file__)'
