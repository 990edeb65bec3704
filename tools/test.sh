#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine: installs what is missing, builds (with
# the CUDA backend whenever nvcc exists, so CUDA code always compiles), runs every suite, then
# the CPU suites again built with AddressSanitizer and UBSan (any memory error or undefined
# behaviour fails them), then each fuzz harness for FUZZ_SECONDS (default 20 s: the eight of
# them in about 3 minutes; a crash fails the run, naming the harness and the input), and ends
# with one line: "N passed, N failed" (Check's individual checks, summed over the suites of
# both runs).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh
. tools/env.sh
status=0
meson test -C build --print-errorlogs --num-processes 1 || status=$?
logs=(build/meson-logs/testlog.json)

# The sanitizer run: CPU only (CUDA code is not instrumented), leaks not counted (StarPU keeps
# some of its allocations to the end), the C suites and the CLI test (the 'workflows' scripts,
# whole commands run many times over, stay in the plain run: instrumented, they would double
# CI's time, and plan_rss measures an uninstrumented process's memory). A machine where an instrumented program cannot start
# at all (some containers forbid the address-space layout ASan needs) skips it, and says so.
probe=$(mktemp -d)
printf 'int main(void) { return 0; }\n' >"$probe/p.c"
if cc -fsanitize=address,undefined "$probe/p.c" -o "$probe/p" 2>/dev/null && "$probe/p"; then
    if [ ! -f build-asan/build.ninja ]; then
        meson setup build-asan -Dcuda=disabled -Dtests=enabled -Dbuildtype=debugoptimized \
            -Db_sanitize=address,undefined >build-asan-setup.log 2>&1 \
            || { cat build-asan-setup.log >&2; echo "test: meson setup of build-asan failed" >&2; exit 1; }
        rm -f build-asan-setup.log
    fi
    ninja -C build-asan >build-asan.log 2>&1 \
        || { grep -E -m30 "error|FAILED" build-asan.log >&2 || tail -30 build-asan.log >&2; echo "test: the sanitizer build failed (build-asan.log)" >&2; exit 1; }
    rm -f build-asan.log
    ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        meson test -C build-asan --print-errorlogs --num-processes 1 --no-suite workflows || status=$?
    logs+=(build-asan/meson-logs/testlog.json)
    # The fuzz harnesses (tests/fuzz/, docs/fuzzing.md), each on its committed seeds and what
    # earlier runs here found (build-fuzz/corpus/).
    tools/fuzz.sh --seconds "${FUZZ_SECONDS:-20}" || status=$?
else
    echo "test: programs built with -fsanitize=address cannot run here: the sanitizer and fuzz runs are skipped" >&2
fi
rm -rf "$probe"
python3 tools/test_totals.py "${logs[@]}" || status=1
exit $status
