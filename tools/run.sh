#!/usr/bin/env bash
# The main job from a fresh Debian 12 machine: installs what is missing, builds, and trains the
# built-in byte-level model on the fortunes corpus (CPU workers when there is no GPU).
# Extra arguments go to `megatrain train` (see `build/tools/megatrain train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
. tools/env.sh
export STARPU_SILENT=1
exec build/tools/megatrain train "$@"
