#!/usr/bin/env bash
# Training over several processes (runtime/dist.h), launched by mpirun on this machine, one CPU
# worker a rank: 2 and 4 ranks give the losses of 1 rank at the same global batch (within 1e-6
# relative), every rank's peak memory within 10% of its plan (a sharded state); rank 0 alone logs; a
# run stopped and resumed over 2 ranks saves the model of the uninterrupted one byte for byte;
# the checkpoint is a file per rank, resumed on the same ranks only; ranks started with different options, and the compact
# layout, are refused; a killed rank ends the job with its rank named, and the last checkpoint
# resumes; Ctrl-C on one rank stops all after the same step with a checkpoint; a model saved over 3
# ranks a tile at a time is the one saved from gathered masters; a rank plans within its share of
# the node's memory; plan --ranks and --ranks-per-node. Skips (77) without mpirun (after the plan
# checks).
# Usage: test_dist.sh PATH/TO/megatrain. Prints one line per check, then "N passed, M failed".
set -u

. "$(dirname "$0")/script_harness.sh" dist "$@"
# meson test sets MALLOC_PERTURB_, with which glibc writes every block it hands out or takes back:
# pages a run never touches become resident, past the plan. A user's run has it unset.
unset MALLOC_PERTURB_

# plan --ranks N: one rank's plan: every tile's weights and gradient, the master and moments of the
# largest rank's own tiles (tile t: rank t mod N), the largest master of another rank's tile (rank
# 0 reads them one at a time to save the model), and the pools it receives the other ranks'
# gradient chunks into, which grow with the other ranks and not with the layers; compact refused.
plan=(plan --shape qwen2.5-0.5b --micro-batch 2 --seq-len 64 --cpu --host-memory 1T)
"$megatrain" "${plan[@]}" >one.txt 2>&1
"$megatrain" "${plan[@]}" --ranks 2 >two.txt 2>&1
"$megatrain" "${plan[@]}" --ranks 3 >three.txt 2>&1
"$megatrain" "${plan[@]}" --ranks 3 --layers 4 >three4.txt 2>&1
rc=$?
# the total without the program's own resident set, which each plan measures anew, and the
# runtime's (which adds MPI's over ranks)
total() { awk 'function num() { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+$/) return $i }
               /^  total / { t = num() } /^  program and libraries / { p = num() } /^  runtime \(/ { r = num() }
               END { printf "%.0f\n", t - p - r }' "$1"; }
recv() { sed -n "s/^  other ranks' gradient chunks (fp32)  *\([0-9]*\) .*/\1/p" "$1"; }
row() { sed -n "s/^  $2  *\([0-9]*\) .*/\1/p" "$1"; }
r2=$(recv two.txt) r3=$(recv three.txt) r34=$(recv three4.txt)
m1=$(row one.txt 'master weights (fp32)') m2=$(row two.txt 'master weights (fp32)') m3=$(row three.txt 'master weights (fp32)')
v1=$(row one.txt 'Adam v (fp32)') v3=$(row three.txt 'Adam v (fp32)')
g1=$(row one.txt 'gradients (fp32)') g3=$(row three.txt 'gradients (fp32)')
x3=$(row three.txt "a remote tile's master (rank 0)")
x34=$(row three4.txt "a remote tile's master (rank 0)")
if [ "$rc" -ne 0 ] || [ -z "$r2" ] || [ -z "$r3" ] || [ -z "$m1" ] || [ -z "$m3" ]; then
    bad "plan --ranks" "no line of the other ranks' gradient chunks, or of the master"
elif ! grep -q "^  over 3 ranks: each holds every tile's streamed weights and gradient and the master and moments of the tiles it owns" three.txt; then
    bad "plan --ranks" "the ranks are not said"
elif [ "$g3" != "$g1" ] || [ "$v3" != "$m3" ] || [ "$m2" -ge "$m1" ] || [ "$m3" -ge "$m2" ] || [ $((2 * m2)) -lt "$m1" ]; then
    bad "plan --ranks" "master $m1 $m2 $m3 (1, 2, 3 ranks), v $v3, gradients $g1 $g3: not a shard of the largest rank's tiles"
elif [ -z "$x3" ] || [ "$x3" -le 0 ] || [ "$x3" -ge "$m3" ] || [ "$x34" != "$x3" ] || grep -q "remote tile" one.txt; then
    bad "plan --ranks" "a remote tile's master '$x3' (24 layers) and '$x34' (4) over 3 ranks: not one layer's, below a rank's $m3"
elif [ $(( $(total three.txt) - $(total one.txt) )) -ne $(( r3 + x3 - 3 * (m1 - m3) )) ]; then
    bad "plan --ranks" "the totals differ by $(( $(total three.txt) - $(total one.txt) )), not by the $r3 received and $x3 gathered less 3 x $((m1 - m3)) of state"
elif [ "$r3" -ne $((2 * r2)) ] || [ "$r34" != "$r3" ]; then
    bad "plan --ranks" "receive pools $r2 (2 ranks), $r3 (3), $r34 (3, 4 layers): not linear in the other ranks, or grow with layers"
elif [ "$r2" -gt $((4 * 4 * 64 * 1048576)) ]; then bad "plan --ranks" "$r2 bytes of pools for one other rank"
else ok "plan --ranks"; fi
# Each rank of a machine plans within its share of the machine's memory, as train does:
# --ranks-per-node (default: every rank on this machine).
"$megatrain" plan --shape qwen2.5-7b --cpu --ranks 4 --micro-batch 1 --seq-len 2048 --host-memory 300G >out.txt 2>err.txt
a=$?
"$megatrain" plan --shape qwen2.5-7b --cpu --ranks 4 --ranks-per-node 1 --micro-batch 1 --seq-len 2048 --host-memory 300G >out1.txt 2>err1.txt
b=$?
"$megatrain" plan --shape qwen2.5-7b --cpu --ranks 4 --ranks-per-node 2 --micro-batch 1 --seq-len 2048 --host-memory 300G >out2.txt 2>err2.txt
c=$?
if [ "$a" -eq 0 ] || ! grep -q "(75.00 GiB) are available .*(this rank's share: 4 ranks on the machine, --ranks-per-node)$" err.txt; then
    bad "plan --ranks-per-node" "4 ranks in 300G: expected the refusal naming a rank's 75 GiB share (exit status $a)"
elif [ "$b" -ne 0 ] || ! grep -q "^fits: host plan within 90% of 300.00 GiB available (full" out1.txt; then
    bad "plan --ranks-per-node" "one rank a machine: expected it to fit in 300G (exit status $b)"
elif [ "$c" -ne 0 ] || ! grep -q "^fits: host plan within 90% of 150.00 GiB available (this rank's share: 2 ranks" out2.txt; then
    bad "plan --ranks-per-node" "two ranks a machine: expected it to fit in 150G (exit status $c)"
else ok "plan --ranks-per-node"; fi
"$megatrain" plan --shape qwen2.5-0.5b --ranks 2 --host-layout compact >out.txt 2>err.txt
rc=$?
if [ "$rc" -eq 0 ] || ! grep -q "a run over 2 ranks sums the gradients in fp32" err.txt out.txt; then
    bad "plan --ranks compact" "expected the refusal"
else ok "plan --ranks compact"; fi

if ! command -v mpirun >/dev/null 2>&1; then
    echo "test_dist.sh: no mpirun (Debian's openmpi-bin): skipped"
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ] || exit 1
    exit 77
fi
# Root in containers; more ranks than cores; shared memory without cross-process copies (which
# containers often forbid).
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch=(mpirun --oversubscribe --bind-to none)
# A machine where mpirun cannot start two processes at all (some containers lack what Open MPI
# needs) skips the rest, and says why; what megatrain does is not tried there.
if ! probe=$(timeout 60 "${launch[@]}" -np 2 true 2>&1); then
    echo "test_dist.sh: mpirun cannot start 2 processes here: skipped ($(head -c 300 <<<"$probe"))"
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ] || exit 1
    exit 77
fi

# mt NP ARGS...: megatrain on NP ranks (NP 0: one plain process); stdout in out.txt, stderr in
# err.txt, status in $rc.
mt() {
    local np=$1; shift
    if [ "$np" -eq 0 ]; then timeout 300 "$megatrain" "$@" >out.txt 2>err.txt
    else timeout 300 "${launch[@]}" -np "$np" "$megatrain" "$@" >out.txt 2>err.txt; fi
    rc=$?
}
run=(train --steps 6 --micro-batch 2 --seq-len 64 --lr 0.002 --warmup 2 --eval-every 0 --log-every 1 --sample-bytes 0
     --ncpu 1 --ncuda 0)

# losses FILE: the metrics file's losses, one a line
losses() { python3 -c 'import json,sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$1"; }

# The same global batch of 8 sequences: 1 rank accumulating 4 micro-batches, 2 ranks of 2, 4 of 1.
mt 0 "${run[@]}" --accum 4 --metrics one.jsonl
if [ "$rc" -ne 0 ]; then bad "1 process" "exit status $rc"; else ok "1 process"; fi
for np in 2 4; do
    mt "$np" "${run[@]}" --accum $((4 / np)) --metrics r$np.jsonl
    if [ "$rc" -ne 0 ]; then bad "$np ranks run" "exit status $rc"; continue; fi
    if [ "$(grep -c '^done: ' err.txt out.txt | awk -F: '{ n += $2 } END { print n }')" -ne 1 ] ||
       ! grep -q "^megatrain: $np ranks (StarPU-MPI), each training $((4 / np)) x 2 sequences of the global batch's 8" err.txt out.txt; then
        bad "$np ranks log" "expected one rank's log, naming the $np ranks and the slices"
    else ok "$np ranks log"; fi
    # rank 0's peak resident set within 10% of its plan (which counts the other ranks' gradients)
    if ! msg=$(sed -n 's/^megatrain: peak host memory \(.*\) (plan \(.*\))$/\1 \2/p' err.txt out.txt | awk '
            function bytes(v, u) { return v * (u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "KiB" ? 2^10 : 1) }
            { n++; peak = bytes($1, $2); plan = bytes($3, $4); if (peak > 1.10 * plan) { print $0; bad = 1 } }
            END { if (n != 1) { print n " lines"; bad = 1 }; exit bad }'); then
        bad "$np ranks memory" "peak host memory beyond the plan + 10%: $msg"
    elif [ "$(grep -c "^megatrain: rank [1-9][0-9]* of $np: peak host memory .* (the largest rank's plan .*)$" err.txt)" -ne $((np - 1)) ]; then
        bad "$np ranks memory" "not a line of peak host memory from each of ranks 1..$((np - 1))"
    elif ! msg=$(sed -n "s/^megatrain: rank [0-9]* of $np: peak host memory \(.*\) (the largest rank's plan \(.*\))$/\1 \2/p" err.txt | awk '
            function bytes(v, u) { return v * (u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "KiB" ? 2^10 : 1) }
            { if (bytes($1, $2) > 1.10 * bytes($3, $4)) { print $0; bad = 1 } } END { exit bad }'); then
        bad "$np ranks memory" "a rank's peak host memory beyond the largest rank's plan + 10%: $msg"
    else ok "$np ranks memory"; fi
    if ! msg=$(paste <(losses one.jsonl) <(losses r$np.jsonl) | awk '
            { n++; d = $1 - $2; if (d < 0) d = -d; if ($2 == "" || d > 1e-6 * $1) { print "step " n ": " $1 " vs " $2; bad = 1 } }
            END { if (n != 6) { print n " steps"; bad = 1 }; exit bad }'); then
        bad "$np ranks losses" "not those of 1 process: $msg"
    else ok "$np ranks losses"; fi
done

# Stopped after 3 steps and resumed over 2 ranks: the model of the uninterrupted run, bytes.
mt 2 "${run[@]}" --checkpoint whole.ckpt --save-model whole
a=$rc
mt 2 "${run[@]}" --checkpoint part.ckpt --stop-after 3
b=$rc
mt 2 "${run[@]}" --resume part.ckpt --checkpoint part.ckpt --save-model resumed
if [ "$a" -ne 0 ] || [ "$b" -ne 0 ] || [ "$rc" -ne 0 ]; then bad "resume over 2 ranks" "exit statuses $a $b $rc"
elif ! cmp -s whole/model.safetensors resumed/model.safetensors; then bad "resume over 2 ranks" "the saved models differ"
elif ls ./*.tmp.* whole/*.tmp.* resumed/*.tmp.* >/dev/null 2>&1; then bad "resume over 2 ranks" "temporaries left"
else ok "resume over 2 ranks"; fi
# The model's save over 3 ranks reads rank 0's missing masters one tile at a time, each sent by its
# owner (rank 0 holds one at a time, within its plan); the end's sample gathers them all first: the
# same file either way. Untied, so the head tile (rank 1's) has the final norm and the LM head.
sed 's/"tie_word_embeddings": true/"tie_word_embeddings": false/' "$root/models/configs/tiny-byte.json" >untied.json
mt 3 "${run[@]}" --config untied.json --save-model tiles
a=$rc
peak=$(sed -n 's/^megatrain: peak host memory \(.*\) (plan \(.*\))$/\1 \2/p' err.txt out.txt)
mt 3 "${run[@]}" --config untied.json --save-model gathered --sample-bytes 16
if [ "$a" -ne 0 ] || [ "$rc" -ne 0 ]; then bad "save over 3 ranks" "exit statuses $a $rc"
elif ! grep -q '"lm_head.weight"' tiles/model.safetensors; then bad "save over 3 ranks" "no LM head saved (untied)"
elif ! cmp -s tiles/model.safetensors gathered/model.safetensors; then
    bad "save over 3 ranks" "a tile at a time and gathered give different files"
elif ! echo "$peak" | awk 'function bytes(v, u) { return v * (u == "GiB" ? 2^30 : u == "MiB" ? 2^20 : u == "KiB" ? 2^10 : 1) }
        { n++; if (bytes($1, $2) > 1.10 * bytes($3, $4)) bad = 1 } END { exit bad || n != 1 }'; then
    bad "save over 3 ranks" "rank 0's peak host memory beyond its plan + 10%: $peak"
else ok "save over 3 ranks"; fi
# The checkpoint is one file per rank, each with the master and moments of its own tiles: rank 1's
# shard beside rank 0's file, only the last step's kept; together about the one process's size.
mt 0 "${run[@]}" --accum 4 --checkpoint single.ckpt
size() { stat -c %s "$1" 2>/dev/null || echo 0; }
s0=$(size part.ckpt) s1=$(size part.ckpt.shard1of2.000006) s=$(size single.ckpt)
if [ "$rc" -ne 0 ] || [ "$s0" -eq 0 ] || [ "$s1" -eq 0 ]; then bad "sharded checkpoint" "no part.ckpt and part.ckpt.shard1of2.000006"
elif [ -e part.ckpt.shard1of2.000003 ]; then bad "sharded checkpoint" "step 3's shard was not removed after step 6's"
elif [ "$s0" -ge "$s" ] || [ "$s1" -ge "$s" ] || [ $((s0 + s1 - s)) -gt 1048576 ] || [ $((s - s0 - s1)) -gt 1048576 ]; then
    bad "sharded checkpoint" "shards of $s0 and $s1 bytes against one process's $s"
else ok "sharded checkpoint"; fi
# A sharded checkpoint resumes on the ranks that wrote it only, refused before any work; a missing
# shard is named.
mt 2 "${run[@]}" --checkpoint three.ckpt --stop-after 3
mt 4 "${run[@]}" --resume three.ckpt
a=$rc
grep -q "three.ckpt: a checkpoint written by 2 ranks (a shard per rank); this run has 4: resume with mpirun -np 2" err.txt out.txt
am=$?
mt 0 "${run[@]}" --resume three.ckpt
b=$rc
grep -q "this run has 1: resume with mpirun -np 2" err.txt out.txt; bm=$?
mv three.ckpt.shard1of2.000003 aside
mt 2 "${run[@]}" --resume three.ckpt
c=$rc
grep -q "three.ckpt.shard1of2.000003: cannot open" err.txt out.txt && grep -q "rank 1 could not read its shard of three.ckpt" err.txt out.txt
cm=$?
mv aside three.ckpt.shard1of2.000003
mt 2 "${run[@]}" --resume three.ckpt
d=$rc
if [ "$a" -eq 0 ] || [ "$am" -ne 0 ] || [ "$b" -eq 0 ] || [ "$bm" -ne 0 ]; then
    bad "sharded resume elsewhere" "4 ranks or 1 process resumed 2 ranks' checkpoint (exit statuses $a $b), or the message lacks the rank count"
elif [ "$c" -eq 0 ] || [ "$cm" -ne 0 ]; then bad "sharded resume elsewhere" "a missing shard was not named (exit status $c)"
elif [ "$d" -ne 0 ]; then bad "sharded resume elsewhere" "with the shard back it did not resume (exit status $d)"
else ok "sharded resume elsewhere"; fi

# Every rank must run the same command: a rank with another --lr is named, before any step.
timeout 120 "${launch[@]}" -np 1 "$megatrain" "${run[@]}" : -np 1 "$megatrain" "${run[@]}" --lr 0.003 >out.txt 2>err.txt
rc=$?
if [ "$rc" -eq 0 ]; then bad "ranks with other options" "expected failure"
elif ! grep -q "rank 1 of 2 was started with other options or data than rank 0" err.txt out.txt; then
    bad "ranks with other options" "the rank is not named"
elif grep -q '^step ' err.txt out.txt; then bad "ranks with other options" "a step ran"
else ok "ranks with other options"; fi
mt 2 "${run[@]}" --host-layout compact
if [ "$rc" -eq 0 ] || ! grep -q -- "--host-layout compact: a run over 2 ranks sums the gradients in fp32" err.txt out.txt; then
    bad "compact over ranks" "expected the refusal"
else ok "compact over ranks"; fi

# The ranks of one node plan within their share of its available memory (each sees all of it
# free when they start): a model too large for half is refused with the share named.
sed 's/"hidden_size": 192/"hidden_size": 8192/; s/"intermediate_size": 512/"intermediate_size": 28672/;
     s/"num_hidden_layers": 6/"num_hidden_layers": 80/; s/"num_attention_heads": 6/"num_attention_heads": 64/;
     s/"num_key_value_heads": 2/"num_key_value_heads": 8/; s/"head_dim": 32/"head_dim": 128/' \
    "$root/models/configs/tiny-byte.json" >big.json
mt 2 "${run[@]}" --config big.json
avail=$(awk '/^MemAvailable:/ { printf "%.0f\n", $2 * 1024 }' /proc/meminfo)
shown=$(sed -n "s/.* but \([0-9]*\) bytes (.*) are available .*(this rank's share of the node's available memory: 2 ranks run on this node)$/\1/p" err.txt | head -1)
if [ "$rc" -eq 0 ] || [ -z "$shown" ]; then bad "a node's share" "expected the refusal naming the node's 2 ranks (exit status $rc)"
elif [ "$shown" -gt $((avail * 3 / 4)) ] || [ "$shown" -lt $((avail / 4)) ]; then
    bad "a node's share" "$shown bytes said available to a rank, against $avail available on the node: not about half"
elif grep -q '^step ' err.txt out.txt; then bad "a node's share" "a step ran"
else ok "a node's share"; fi

# A rank killed mid-run: the job ends within a minute, naming the rank; the checkpoint of the
# last step saved before resumes.
long=(train --steps 400 --micro-batch 2 --seq-len 64 --eval-every 0 --log-every 1 --sample-bytes 0 --ncpu 1 --ncuda 0
      --checkpoint kill.ckpt --save-every 1)
rm -f kill.ckpt
"${launch[@]}" -np 2 "$megatrain" "${long[@]}" >out.txt 2>err.txt &
job=$!
for _ in $(seq 1 600); do [ -e kill.ckpt ] && break; sleep 0.1; done
victim=""
for p in $(pgrep -f -- "--checkpoint kill.ckpt" || true); do
    [ "$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')" = 1 ] && victim=$p
done
t0=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
ended=no
for _ in $(seq 1 600); do kill -0 "$job" 2>/dev/null || { ended=yes; break; }; sleep 0.1; done
wait "$job"
rc=$?
if [ -z "$victim" ]; then bad "killed rank" "no rank 1 process found (or no checkpoint was written)"
elif [ "$ended" != yes ]; then bad "killed rank" "the job still ran $(( $(date +%s) - t0 )) s after the kill"; kill -9 "$job"
elif [ "$rc" -eq 0 ]; then bad "killed rank" "the job exited 0"
elif ! grep -qiE "rank 1|process rank 1" err.txt out.txt; then bad "killed rank" "rank 1 is not named"
else
    saved=$(sed -n 's/.*checkpoint of step \([0-9]*\) saved.*/\1/p' err.txt out.txt | tail -1)
    # saved every step: rank 1's shards of the steps before the last one committed are gone (the
    # one it was writing when killed may stay beside it)
    shards=$(ls kill.ckpt.shard1of2.* 2>/dev/null | wc -l)
    mt 2 "${long[@]}" --resume kill.ckpt --stop-after $(( ${saved:-0} + 2 ))
    if [ "$rc" -ne 0 ] || ! grep -q "resumed from kill.ckpt" err.txt out.txt; then bad "killed rank" "the checkpoint did not resume"
    elif [ "$shards" -lt 1 ] || [ "$shards" -gt 2 ]; then bad "killed rank" "$shards shards of rank 1 after saving every step"
    else ok "killed rank"; fi
fi

# Ctrl-C reaching one rank only: every rank stops after the same step, rank 0 writes the
# checkpoint and says so, and it resumes. (The last logs go first: the wait below must not find
# their lines while the job is still starting.)
rm -f out.txt err.txt
"${launch[@]}" -np 2 "$megatrain" train --steps 400 --micro-batch 2 --seq-len 64 --eval-every 0 --log-every 1 \
    --sample-bytes 0 --ncpu 1 --ncuda 0 --checkpoint sig.ckpt --save-every 50 >out.txt 2>err.txt &
job=$!
for _ in $(seq 1 600); do grep -q '^step     3/' err.txt out.txt 2>/dev/null && break; sleep 0.1; done
target=""
for p in $(pgrep -f -- "--checkpoint sig.ckpt" || true); do
    [ "$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')" = 1 ] && target=$p
done
[ -n "$target" ] && kill -INT "$target"
ended=no
for _ in $(seq 1 600); do kill -0 "$job" 2>/dev/null || { ended=yes; break; }; sleep 0.1; done
wait "$job"
rc=$?
stopped=$(sed -n 's/^megatrain: SIGINT: stopped after step \([0-9]*\) of 400.*/\1/p' err.txt out.txt | head -1)
if [ -z "$target" ]; then bad "Ctrl-C on one rank" "no rank 1 process found"
elif [ "$ended" != yes ]; then bad "Ctrl-C on one rank" "the job still runs a minute after the signal"; kill -9 "$job"
elif [ -z "$stopped" ]; then bad "Ctrl-C on one rank" "rank 0 does not say where it stopped"
else
    mt 2 train --steps 400 --micro-batch 2 --seq-len 64 --eval-every 0 --log-every 1 --sample-bytes 0 --ncpu 1 --ncuda 0 \
        --resume sig.ckpt --stop-after $((stopped + 1))
    if [ "$rc" -ne 0 ] || ! grep -q "resumed from sig.ckpt at step $stopped" err.txt out.txt; then
        bad "Ctrl-C on one rank" "the checkpoint of step $stopped did not resume (exit status $rc)"
    else ok "Ctrl-C on one rank"; fi
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
