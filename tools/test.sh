#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine: installs what is missing, builds (with
# the CUDA backend whenever nvcc exists, so CUDA code always compiles), runs every suite, and
# ends with one line: "N passed, N failed" (Check's individual checks, summed over suites).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
. tools/env.sh
status=0
meson test -C build --print-errorlogs --num-processes 1 || status=$?
python3 tools/test_totals.py build/meson-logs/testlog.json || status=1
exit $status
