#!/usr/bin/env bash
# Smoke test on the GPU machine: the carried binaries and libraries load, StarPU reports a CUDA
# worker, a CUDA codelet runs, and a host state tile is pinned. Run from the repository root
# with build-gpu/ and .deps/gpu-runtime/ carried (tools/gpu_pack.sh makes the latter).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="$PWD/.deps/gpu-runtime/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STARPU_SILENT=1 STARPU_HOME="${TMPDIR:-/tmp}/megatrain-starpu-home"
echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== starpu_machine_display"; .deps/gpu-runtime/bin/starpu_machine_display 2>&1 | grep -E "CUDA|CPU|bandwidth|GB/s|workers" | head -20
echo "== megatrain info"; build-gpu/tools/megatrain info
