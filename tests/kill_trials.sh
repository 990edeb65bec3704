#!/usr/bin/env bash
# Kill trials: a training run is killed (SIGKILL) at random moments, during its steps, while it
# writes a checkpoint and while it writes the model, and each time started again with --resume;
# at the end its checkpoint, its model and its metrics must be those of a run never killed, bit
# for bit, and no temporary file may be left.
#
# Usage: kill_trials.sh PATH/TO/megatrain [--kills N] [--seed S]
#   --kills N  how many kills (default 5, what CI runs; say 60 by hand)
#   --seed S   the kill moments' seed (default 1)
# Prints a line per attempt, then "N passed, M failed" over the final checks.
set -u

megatrain=$(realpath "${1:?usage: kill_trials.sh PATH/TO/megatrain [--kills N] [--seed S]}")
shift
kills=5
seed=1
while [ $# -gt 0 ]; do
    case $1 in
    --kills) kills=${2:?--kills N}; shift 2 ;;
    --seed) seed=${2:?--seed S}; shift 2 ;;
    --help) sed -n '2,10s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "kill_trials.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
done
case $kills in ''|*[!0-9]*) echo "kill_trials.sh: --kills: '$kills' is not a count" >&2; exit 2 ;; esac
RANDOM=$seed
work=$(mktemp -d /tmp/mt-kill.XXXXXX)  # kept when a check fails, for a look
export STARPU_SILENT=1
export STARPU_HOME=${STARPU_HOME:-$work/starpu-home}
mkdir -p "$STARPU_HOME"
cd "$work" || exit 2

for i in $(seq 1 3000); do
    echo "Line $i: a sentence for the kill trials, $((i * 7919 % 1000)) words of it."
    [ $((i % 5)) -eq 0 ] && echo
done >corpus.txt
steps=24
run=(train --data corpus.txt --steps "$steps" --micro-batch 2 --seq-len 32 --eval-every 10 --log-every 1
     --sample-bytes 0 --ncpu 2 --ncuda 0 --save-every 3 --keep-last 2)

start_ms=$(date +%s%3N)
if ! "$megatrain" "${run[@]}" --checkpoint ref.ckpt --save-model ref-model --metrics ref.jsonl >ref.log 2>&1; then
    echo "kill_trials.sh: the reference run failed ($work):" >&2
    tail -5 ref.log >&2
    exit 1
fi
run_ms=$(($(date +%s%3N) - start_ms))  # the kill moments spread over a run's length

# Waits (at most 60 s) until the background run $bg ends or `cond` (a shell test) holds; then
# kills it. Sets $outcome to "killed" or "exited N".
kill_when() {
    local cond=$1 n=0
    while kill -0 "$bg" 2>/dev/null; do
        if eval "$cond"; then
            kill -KILL "$bg" 2>/dev/null
            wait "$bg" 2>/dev/null
            outcome=killed
            return
        fi
        n=$((n + 1))
        [ $n -gt 600000 ] && break
    done
    wait "$bg"
    outcome="exited $?"
}

temporary() { compgen -G "$1" >/dev/null; }

passed=0
failed=0
check() {
    if eval "$2"; then passed=$((passed + 1)); echo "ok   $1"
    else failed=$((failed + 1)); echo "FAIL $1"; fi
}
# The files of a run that completed, against the uninterrupted run's.
check_run() {
    check "$1: the checkpoint is the uninterrupted run's" 'cmp -s "$(realpath ref.ckpt)" "$(realpath run.ckpt)"'
    check "$1: the checkpoint is at step $steps" '[ "$(readlink run.ckpt)" = "$final_name" ]'
    check "$1: the model is the uninterrupted run's" 'cmp -s ref-model/model.safetensors model/model.safetensors &&
        cmp -s ref-model/config.json model/config.json'
    check "$1: the metrics are the uninterrupted run's, each step once" 'python3 - ref.jsonl run.jsonl <<'"'"'PY'"'"'
import json, sys
def rows(path):
    return [json.loads(line) for line in open(path)]
keys = ("step", "loss", "grad_norm", "lr", "epoch", "val_loss")
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert [r["step"] for r in b] == list(range(1, len(a) + 1)), [r["step"] for r in b]
for x, y in zip(a, b):
    assert all(x.get(k) == y.get(k) for k in keys), (x, y)
PY'
    check "$1: no temporary file is left" '! compgen -G "*.tmp.*" >/dev/null && ! compgen -G "model/*.tmp.*" >/dev/null'
}

# Cycles of attempts, each killed (SIGKILL) and resumed, until a run completes: at a random
# moment or at the first checkpoint written after one, in turn, and once training is done, while
# the model is written (a resume at the last step writes it again). A completed run is checked,
# and the next cycle starts afresh, until the kills are done; the last cycle then completes.
final_name=run.ckpt.$(printf %06d $steps)
attempt=0
done_kills=0
cycle=1
model_killed=0  # in this cycle
model_kills=0   # in all
random_kind=1
while :; do
    at_end=0
    [ "$(readlink run.ckpt 2>/dev/null)" = "$final_name" ] && at_end=1
    if [ $at_end -eq 1 ] && [ $model_killed -eq 0 ] && [ $done_kills -lt "$kills" ]; then
        kind="model write"
    elif [ $at_end -eq 1 ] || [ $done_kills -ge "$kills" ]; then
        kind=none            # the cycle's last attempt: to the end
    elif [ $done_kills -eq $((kills - 1)) ] && [ $model_kills -eq 0 ]; then
        kind="none yet"      # the last kill is kept for the model's write: train to the end first
    else
        random_kind=$((1 - random_kind))
        [ $random_kind -eq 1 ] && kind="random moment" || kind="checkpoint write"
    fi
    attempt=$((attempt + 1))
    resume=()
    [ -e run.ckpt ] && resume=(--resume run.ckpt)
    "$megatrain" "${run[@]}" --checkpoint run.ckpt --save-model model --metrics run.jsonl "${resume[@]}" \
        >>run.log 2>&1 &
    bg=$!
    case $kind in
    none*) wait "$bg"; outcome="exited $?" ;;
    "model write") kill_when 'temporary "model/*.tmp.*"' ;;
    *)
        delay_ms=$((run_ms / 20 + (RANDOM * 32768 + RANDOM) % (run_ms * 3 / 4)))
        sleep "$((delay_ms / 1000)).$(printf '%03d' $((delay_ms % 1000)))"
        if [ "$kind" = "random moment" ]; then kill_when true
        else kill_when 'temporary "run.ckpt.*tmp.*"'; fi
        ;;
    esac
    at=$(grep -oE '^step +[0-9]+/' run.log | tail -1 | tr -dc 0-9)
    echo "cycle $cycle, attempt $attempt (${resume[*]:-fresh}), kill: $kind: $outcome (last step logged ${at:-none})"
    case $outcome in
    killed)
        done_kills=$((done_kills + 1))
        [ "$kind" = "model write" ] && model_killed=1 && model_kills=$((model_kills + 1))
        ;;
    "exited 0")
        # a run that trained to its end goes on to a kill in its model's write; one that wrote
        # the model at the end ends the cycle
        if [ "$kind" = none ]; then
            check_run "cycle $cycle"
            [ $done_kills -ge "$kills" ] && break
            rm -rf run.ckpt* run.jsonl run.log model
            cycle=$((cycle + 1))
            model_killed=0
        fi
        ;;
    *) failed=$((failed + 1)); echo "FAIL attempt $attempt: $(tail -3 run.log)"; break ;;
    esac
    if [ $attempt -gt $((kills * 4 + 10)) ]; then failed=$((failed + 1)); echo "FAIL too many attempts"; break; fi
done
echo "$done_kills kills in $cycle cycles, $attempt attempts"
echo "$passed passed, $failed failed"
if [ "$failed" -gt 0 ]; then
    echo "kill_trials.sh: the runs' files are in $work"
    exit 1
fi
rm -rf "$work"
