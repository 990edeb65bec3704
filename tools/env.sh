# Source this to find megatrain's dependencies: StarPU in $MEGATRAIN_DEPS (tools/setup.sh puts it
# there) and CUDA under /usr/local/cuda when present.  . tools/env.sh
MEGATRAIN_DEPS=${MEGATRAIN_DEPS:-/opt/megatrain-deps}
_mt_starpu=$MEGATRAIN_DEPS/starpu-1.4.10
export PKG_CONFIG_PATH="$_mt_starpu/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$_mt_starpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$_mt_starpu/bin:$PATH"
if [ -d /usr/local/cuda/bin ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"
    export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
fi
unset _mt_starpu
