#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz/ with clang (AddressSanitizer and UBSan) into
# build-fuzz/ and runs each for a while on its committed seeds plus what earlier runs found.
#
#   tools/fuzz.sh [--seconds N | --cpu-seconds N] [--make-seeds] [HARNESS...] [-- LIBFUZZER_FLAGS...]
#
#   --seconds N      wall time per harness (default 60)
#   --cpu-seconds N  instead, run each harness until it has had N seconds of CPU (on a shared
#                    machine a harness gets less CPU than wall time; this is the budget that counts)
#   --make-seeds   write the seeds of tests/fuzz/corpus/ again (tests/fuzz/make_seeds.py and the
#                  harnesses' own writers) instead of fuzzing
#   HARNESS        some of: safetensors config tokenizer tokenizer_text chat shard checkpoint
#                  index (default: all, in that order)
#
# The corpus a run grows goes to build-fuzz/corpus/HARNESS (the committed seeds are only read),
# the log to build-fuzz/logs/HARNESS.log, a crashing input to build-fuzz/crashes/HARNESS/. Each
# harness ends with one line: its executions, the CPU time it had, libFuzzer's coverage (cov:
# edges, ft: features) and corpus size, or the crash and the input that causes it. Exits 1 when
# any harness crashed.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL=(safetensors config tokenizer tokenizer_text chat shard checkpoint index)
seconds=60
cpu_seconds=0
make_seeds=no
harnesses=()
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) [ $# -ge 2 ] || { echo "fuzz: --seconds needs a number" >&2; exit 2; }
                   seconds=$2; shift 2 ;;
        --seconds=*) seconds=${1#--seconds=}; shift ;;
        --cpu-seconds) [ $# -ge 2 ] || { echo "fuzz: --cpu-seconds needs a number" >&2; exit 2; }
                       cpu_seconds=$2; shift 2 ;;
        --cpu-seconds=*) cpu_seconds=${1#--cpu-seconds=}; shift ;;
        --make-seeds) make_seeds=yes; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        -*) echo "fuzz: unknown option '$1' (try --help)" >&2; exit 2 ;;
        *) [[ " ${ALL[*]} " == *" $1 "* ]] || { echo "fuzz: no harness '$1' (${ALL[*]})" >&2; exit 2; }
           harnesses+=("$1"); shift ;;
    esac
done
[[ "$seconds" =~ ^[0-9]+$ ]] && [ "$seconds" -ge 1 ] || { echo "fuzz: --seconds '$seconds' is not a positive integer" >&2; exit 2; }
[[ "$cpu_seconds" =~ ^[0-9]+$ ]] || { echo "fuzz: --cpu-seconds '$cpu_seconds' is not a positive integer" >&2; exit 2; }
# With a CPU budget the wall limit only guards against a harness that gets no CPU at all.
[ "$cpu_seconds" -eq 0 ] || seconds=$((cpu_seconds * 20))
[ ${#harnesses[@]} -gt 0 ] || harnesses=("${ALL[@]}")

command -v clang >/dev/null || { echo "fuzz: no clang (tools/setup.sh installs clang and libclang-rt-14-dev)" >&2; exit 1; }
. tools/env.sh
if [ ! -f build-fuzz/build.ninja ]; then
    CC=clang meson setup build-fuzz tests/fuzz >build-fuzz-setup.log 2>&1 \
        || { tail -20 build-fuzz-setup.log >&2; echo "fuzz: meson setup of build-fuzz failed (build-fuzz-setup.log)" >&2; exit 1; }
    rm -f build-fuzz-setup.log
fi
ninja -C build-fuzz >build-fuzz.log 2>&1 \
    || { grep -E -m30 "error|FAILED" build-fuzz.log >&2 || tail -30 build-fuzz.log >&2; echo "fuzz: the build failed (build-fuzz.log)" >&2; exit 1; }
rm -f build-fuzz.log

if [ "$make_seeds" = yes ]; then
    python3 tests/fuzz/make_seeds.py
    for h in safetensors shard checkpoint index; do
        rm -rf "tests/fuzz/corpus/$h" && mkdir -p "tests/fuzz/corpus/$h"
        FUZZ_MAKE_SEEDS="$PWD/tests/fuzz/corpus/$h" "build-fuzz/fuzz_$h"
    done
    echo "fuzz: seeds written to tests/fuzz/corpus/ ($(du -sh tests/fuzz/corpus | cut -f1))"
    exit 0
fi

# The longest input each harness tries: past a kilobyte where a text is fuzzed (a Split regex's
# JIT stack is exhausted only by long matches), a checkpoint of the tiny model where one is read.
max_len() {
    case "$1" in
        tokenizer|tokenizer_text) echo 20000 ;;
        chat) echo 8192 ;;
        checkpoint) echo 40000 ;;
        *) echo 4096 ;;
    esac
}

# Sets the variable named $1 to the user + system seconds of this shell's finished children:
# the CPU a harness had, which on a shared machine is less than its wall time. bash's times must
# run in this shell (in a command substitution it would see no children).
times_file=$(mktemp)
trap 'rm -f "$times_file"' EXIT
children_cpu() {
    times >"$times_file"
    printf -v "$1" '%s' "$(awk 'END { n = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); n += p[1] * 60 + p[2] }
                                      print n }' "$times_file")"
}

# Sends SIGINT to process $1 once its user + system time reaches $2 seconds (libFuzzer then prints
# its final stats and exits); returns when the process is gone.
watch_cpu() {
    local tck; tck=$(getconf CLK_TCK)
    while [ -r "/proc/$1/stat" ]; do
        local t; t=$(awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null) || break
        [ -n "$t" ] && [ "$t" -ge $(( $2 * tck )) ] && { kill -INT "$1" 2>/dev/null; break; }
        sleep 5
    done
}

mkdir -p build-fuzz/logs
crashed=0
for h in "${harnesses[@]}"; do
    work=build-fuzz/corpus/$h crashes=build-fuzz/crashes/$h log=build-fuzz/logs/$h.log
    mkdir -p "$work" "$crashes"
    dict=()
    [ -f "tests/fuzz/$h.dict" ] && dict=(-dict="tests/fuzz/$h.dict")
    rc=0
    children_cpu cpu_before
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1} \
    UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
        "build-fuzz/fuzz_$h" -max_total_time="$seconds" -max_len="$(max_len "$h")" -timeout=25 \
        -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix="$crashes/" "${dict[@]}" "${extra[@]}" \
        "$work" "tests/fuzz/corpus/$h" >"$log" 2>&1 &
    pid=$!
    [ "$cpu_seconds" -eq 0 ] || watch_cpu "$pid" "$cpu_seconds" &
    wait "$pid" || rc=$?
    # libFuzzer stopped by the CPU watcher (SIGINT) ends with status 72 after its final stats.
    [ "$cpu_seconds" -eq 0 ] || { [ "$rc" -ne 72 ] && [ "$rc" -ne 130 ] || ! grep -q '^stat::number_of_executed_units' "$log" || rc=0; }
    children_cpu cpu_after
    cpu=$(awk -v a="$cpu_before" -v b="$cpu_after" 'BEGIN { printf "%.0f", b - a }')
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
    if [ "$rc" -ne 0 ]; then
        crashed=$((crashed + 1))
        input=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
        why=$(grep -m1 -E 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|invariant broken' "$log" || true)
        echo "fuzz: $h: CRASH after ${runs:-?} runs (${cpu} s of CPU): ${why:-exit status $rc}"
        echo "fuzz: $h: input ${input:-(none written)}, log $log"
    else
        echo "fuzz: $h: ${runs:-?} runs (${cpu} s of CPU), cov ${cov:-?} ft ${ft:-?}, corpus ${corp:-?}, no crash"
    fi
done
[ "$crashed" -eq 0 ] || { echo "fuzz: $crashed of ${#harnesses[@]} harnesses crashed" >&2; exit 1; }
