#!/usr/bin/env bash
# Configures (once) and builds megatrain into build/, with the CUDA backend whenever nvcc is
# there. Used by tools/run.sh and tools/test.sh; run tools/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env.sh
cuda=disabled
command -v nvcc >/dev/null 2>&1 && cuda=enabled
if [ ! -f build/build.ninja ]; then
    meson setup build -Dcuda="$cuda" -Dtests=enabled >build-setup.log 2>&1 \
        || { cat build-setup.log >&2; echo "build: meson setup failed" >&2; exit 1; }
    rm -f build-setup.log
else
    meson configure build -Dcuda="$cuda" >/dev/null
fi
ninja -C build >build.log 2>&1 || { grep -E -m30 "error|FAILED" build.log >&2 || tail -30 build.log >&2; echo "build: compilation failed (full log: build.log)" >&2; exit 1; }
rm -f build.log
echo "build: ok (cuda: $cuda)" >&2
