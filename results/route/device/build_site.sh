#!/usr/bin/env bash
# Packs what `run.sh` needs on the H200 machine and that its image lacks (no registry reaches
# it) into .whl/ at the repository root: site312.tar.xz (the packages, unpacked, with the
# Debian libraries Mooncake's binaries link to under _syslibs/).
# The versions are the ones this repository's venv runs. Run from anywhere on this host.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PIP="${PIP:-$ROOT/.venv/bin/pip}"
W=$(mktemp -d); S=$(mktemp -d)
trap 'rm -rf "$W" "$S"' EXIT
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_26 manylinux_2_27 manylinux_2_28; do
  PLAT+=(--platform "${p}_x86_64")
done
"$PIP" download -q "${PLAT[@]}" -d "$W" \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  uvicorn==0.55.0 pyzmq==27.3.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  anyio==4.16.0 idna==3.20 mooncake-transfer-engine-non-cuda==0.3.13.post1 \
  sglang-router==0.3.2 setproctitle orjson opentelemetry-api
for w in "$W"/*.whl; do python3 -m zipfile -e "$w" "$S"; done
# zipfile drops the mode bits; the store's programs are started as processes.
chmod +x "$S"/mooncake/mooncake_master "$S"/mooncake/mooncake_client
# The store's benchmark binary is 42 MB and unused.
rm -f "$S/mooncake/transfer_engine_bench"
mkdir -p "$S/_syslibs"
for so in "$S"/mooncake/*.so "$S"/mooncake/mooncake_master; do ldd "$so"; done \
  | awk '$3 ~ /^\/lib\/x86_64-linux-gnu\// {print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libdl|libpthread|libresolv|librt|libgcc_s|libstdc\+\+)\.so' \
  | while read -r lib; do cp -L "$lib" "$S/_syslibs/"; done
mkdir -p "$ROOT/.whl"
tar cJf "$ROOT/.whl/site312.tar.xz" -C "$S" .
grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo /.whl/ >>"$ROOT/.git/info/exclude"
du -sh "$ROOT/.whl"
