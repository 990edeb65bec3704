#!/usr/bin/env bash
# Configures (once) and builds megatrain into build/, with the CUDA backend whenever nvcc is
# there. Used by tools/run.sh and tools/test.sh; run tools/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env.sh
cuda=disabled
command -v nvcc >/dev/null 2>&1 && cuda=enabled
# Meson before 1.4 gives nvcc no dependency-file flags: CUDA objects then compile through
# tools/nvcc-depfile, named in a native file that lives in the build folder.
native=()
old_meson=false
[ "$(printf '%s\n' "$(meson --version)" 1.4 | sort -V | head -1)" != 1.4 ] && old_meson=true
# configured without it (by hand): set up afresh
if [ "$cuda" = enabled ] && $old_meson && [ -f build/build.ninja ] && ! grep -q nvcc-depfile build/build.ninja; then
    echo "build: build/ was configured without tools/nvcc-depfile: setting it up again" >&2
    rm -rf build
fi
if [ "$cuda" = enabled ] && $old_meson; then
    mkdir -p build
    printf "[binaries]\ncuda = '%s'\n" "$PWD/tools/nvcc-depfile" >build/nvcc-depfile.ini
    native=(--native-file build/nvcc-depfile.ini)
fi
if [ ! -f build/build.ninja ]; then
    meson setup build -Dcuda="$cuda" -Dtests=enabled "${native[@]}" >build-setup.log 2>&1 \
        || { cat build-setup.log >&2; echo "build: meson setup failed" >&2; exit 1; }
    rm -f build-setup.log
else
    meson configure build -Dcuda="$cuda" >/dev/null
fi
ninja -C build >build.log 2>&1 || { grep -E -m30 "error|FAILED" build.log >&2 || tail -30 build.log >&2; echo "build: compilation failed (full log: build.log)" >&2; exit 1; }
rm -f build.log
echo "build: ok (cuda: $cuda)" >&2
