#!/usr/bin/env bash
# Packs what the GPU machine lacks into .deps/gpu-runtime (an ignored folder the device tool can
# carry): StarPU's stripped libraries and the Debian libraries they need that the GPU machine's
# image does not have (hwloc, udev, FxT).   tools/gpu_pack.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env.sh
src=$MEGATRAIN_DEPS/starpu-1.4.10
[ -d "$src/lib" ] || { echo "gpu_pack: no StarPU in $src: run tools/setup.sh first" >&2; exit 1; }
dst=.deps/gpu-runtime
rm -rf "$dst" && mkdir -p "$dst/lib" "$dst/bin"
cp -a "$src"/lib/libstarpu-1.4.so* "$src"/lib/libstarpumpi-1.4.so* "$dst/lib/"
for l in libhwloc.so.15 libudev.so.1 libfxt.so.2 libcheck.so.0 libsubunit.so.0 libutf8proc.so.2; do
    p=$(ldconfig -p | awk -v l="$l" '$1 == l && /x86-64/ {print $NF; exit}')
    if [ -n "$p" ]; then cp -L "$p" "$dst/lib/"; fi
done
cp "$src/bin/starpu_machine_display" "$dst/bin/" 2>/dev/null || true
strip --strip-unneeded "$dst"/lib/*.so* "$dst"/bin/* 2>/dev/null || true
du -sh "$dst"
