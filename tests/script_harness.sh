# Sourced by the workflow scripts (tests/test_trust_cli.sh, tests/test_moe_cli.sh) after their
# set -u: `. "$(dirname "$0")/script_harness.sh" NAME "$@"`. Sets $megatrain (the binary given as
# the first argument), $root (the checkout), a scratch $work (removed at exit, the current
# directory) with StarPU's home in it, the counters and ok NAME / bad NAME WHY, which print one
# line a check (bad also the exit status $rc and the start of out.txt and err.txt).
megatrain=$(realpath "${2:?usage: $1 PATH/TO/megatrain}")
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d "/tmp/mt-$1.XXXXXX")
trap 'rm -rf "$work"' EXIT
export STARPU_SILENT=1
export STARPU_HOME=${STARPU_HOME:-$work/starpu-home}
mkdir -p "$STARPU_HOME"
cd "$work" || exit 2

passed=0
failed=0
rc=0

ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() {
    failed=$((failed + 1))
    echo "FAIL $1: $2"
    echo "     exit status $rc; stdout, stderr:"
    sed -n '1,12s/^/       /p' out.txt err.txt 2>/dev/null
}
