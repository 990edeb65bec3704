#!/usr/bin/env bash
# `megatrain train` as a user meets it when something is wrong: data of the wrong kind, a resume
# with other settings, a tokenizer that is not the data's, outputs that cannot be written or must
# not be replaced, signals, a kill. Each check names the case; every refusal must come before any
# step and name the file or option. Usage: test_trust_cli.sh PATH/TO/megatrain. Prints one line
# per check, then "N passed, M failed".
set -u

. "$(dirname "$0")/script_harness.sh" trust "$@"

# train ARGS...: runs megatrain train; stdout in out.txt, stderr in err.txt, status in $rc.
train() {
    "$megatrain" train "$@" >out.txt 2>err.txt
    rc=$?
}

# refused NAME PATTERN ARGS...: exits 1, stderr matches PATTERN (grep -E), and no step ran.
refused() {
    local name=$1 pattern=$2
    shift 2
    train "$@"
    if [ "$rc" -ne 1 ]; then bad "$name" "expected exit status 1"
    elif ! grep -qE -- "$pattern" err.txt; then bad "$name" "stderr does not match '$pattern'"
    elif grep -qE '^step ' out.txt; then bad "$name" "refused only after training"
    else ok "$name"; fi
}

# A dead process's pid: a temporary named after it is stale.
dead_pid() {
    sh -c 'echo $$' >pid.txt
    cat pid.txt
}

small=(--steps 4 --micro-batch 2 --seq-len 32 --sample-bytes 0 --eval-every 0 --log-every 1 --ncpu 2 --ncuda 0)

# Text, a chat file, a model of 300 ids (not byte-level), prepared data of the Qwen3 tokenizer.
for i in $(seq 1 1500); do
    echo "Line $i: the quick brown fox number $((i * 7919 % 1000)) jumps."
    [ $((i % 5)) -eq 0 ] && echo
done >corpus.txt
for i in $(seq 1 1500); do echo "Another corpus, line $i, of other words: $((i * 31 % 97))."; done >other.txt
printf '{"instruction": "Say hi.", "input": "", "output": "Hi."}\n%.0s' $(seq 1 50) >chat.jsonl
sed 's/"vocab_size": 256/"vocab_size": 300/; s/"tie_word_embeddings": true/"tie_word_embeddings": false/' \
    "$root/models/configs/tiny-byte.json" >cfg300.json
"$megatrain" train --config cfg300.json --data corpus.txt "${small[@]}" --steps 1 --save-model m300 >/dev/null 2>&1 ||
    echo "setup: the 300-id model was not written"
tokenizer=$root/tests/fixtures/tokenizers/qwen3/tokenizer.json
"$megatrain" prepare --tokenizer "$tokenizer" --family qwen3 --format text --input corpus.txt --output prepared \
    --seq-len 32 >/dev/null 2>&1 || echo "setup: prepare failed"
"$megatrain" prepare --tokenizer "$tokenizer" --family qwen3 --format text --input corpus.txt --output noval \
    --seq-len 32 --val-fraction 0 >/dev/null 2>&1 || echo "setup: prepare --val-fraction 0 failed"
# A model of the tokenizer's vocabulary, small otherwise.
sed 's/"vocab_size": 256/"vocab_size": 151669/; s/"hidden_size": 192/"hidden_size": 32/; s/"intermediate_size": 512/"intermediate_size": 64/; s/"num_hidden_layers": 6/"num_hidden_layers": 2/; s/"num_attention_heads": 6/"num_attention_heads": 2/; s/"num_key_value_heads": 2/"num_key_value_heads": 1/; s/"head_dim": 32/"head_dim": 16/' \
    "$root/models/configs/tiny-byte.json" >cfgq.json

# --- 1: data of a kind the model does not read ------------------------------------------------
refused "a JSONL file as --data" "chat.jsonl is JSONL.*megatrain prepare --tokenizer m300/tokenizer.json --format alpaca" \
    --model m300 --data chat.jsonl "${small[@]}"
refused "one shard as --data" "one shard of a prepared directory.*--data prepared\)" \
    --config cfgq.json --data prepared/train-00000.bin "${small[@]}"
refused "text for a model that is not byte-level" "not a byte-level model \(vocab_size 300\).*megatrain prepare --tokenizer m300/tokenizer.json --format text --input corpus.txt" \
    --model m300 --data corpus.txt "${small[@]}"
mkdir shards-only && cp prepared/train-00000.bin shards-only/
refused "a directory of shards without meta.json" "holds the token shard .*train-00000.bin but no meta.json" \
    --config cfgq.json --data shards-only "${small[@]}"

# --- 2: a resume with other settings -----------------------------------------------------------
train --data corpus.txt "${small[@]}" --stop-after 2 --checkpoint run.ckpt --lr 0.002 --seed 5
[ "$rc" -eq 0 ] || bad "a checkpoint to resume" "the run failed"
refused "resume with another --lr" "run.ckpt: .*--lr 0.001 \(the checkpoint's run: 0.002\).*--allow-changed lr" \
    --data corpus.txt "${small[@]}" --checkpoint run.ckpt --resume run.ckpt --lr 0.001 --seed 5
refused "resume with another --micro-batch and --steps" "--micro-batch 4 \(the checkpoint's run: 2\), --steps 8 \(the checkpoint's run: 4\)" \
    --data corpus.txt "${small[@]}" --checkpoint run.ckpt --resume run.ckpt --lr 0.002 --seed 5 --micro-batch 4 --steps 8
refused "resume with another --seed" "--seed 6 \(the checkpoint's run: 5\)" \
    --data corpus.txt "${small[@]}" --checkpoint run.ckpt --resume run.ckpt --lr 0.002 --seed 6
refused "resume with another --data" "--data .*other.txt: text, .* \(the checkpoint's run: .*corpus.txt: text" \
    --data other.txt "${small[@]}" --checkpoint run.ckpt --resume run.ckpt --lr 0.002 --seed 5
cp run.ckpt keep.ckpt
name="--allow-changed lr accepts the change, says so"
train --data corpus.txt "${small[@]}" --checkpoint run.ckpt --resume run.ckpt --lr 0.001 --seed 5 --allow-changed lr
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif ! grep -q "changed settings (--allow-changed): --lr 0.001 (the checkpoint's run: 0.002)" out.txt; then
    bad "$name" "no note of the accepted change"
else ok "$name"; fi
refused "--allow-changed names settings" "--allow-changed: 'learning-rate' is not a setting" \
    --data corpus.txt "${small[@]}" --resume keep.ckpt --allow-changed learning-rate
refused "a fresh run does not replace a checkpoint" "--checkpoint run.ckpt exists and this run does not resume it" \
    --data corpus.txt "${small[@]}" --checkpoint run.ckpt

# --- 3: a model and data of other tokenizers ---------------------------------------------------
"$megatrain" train --config cfgq.json --data prepared "${small[@]}" --steps 1 --save-model mq >/dev/null 2>&1 ||
    echo "setup: the Qwen3-vocabulary model was not written"
cp "$tokenizer" mq/tokenizer.json && echo >>mq/tokenizer.json  # other bytes: another tokenizer to the check
refused "a model's tokenizer.json that is not the data's" "--data prepared was prepared with the tokenizer .*qwen3/tokenizer.json \(fnv1a64 [0-9a-f]+\), but mq/tokenizer.json is another \(fnv1a64 [0-9a-f]+\)" \
    --model mq --data prepared "${small[@]}"
name="--allow-other-tokenizer trains"
train --model mq --data prepared "${small[@]}" --allow-other-tokenizer
if [ "$rc" -ne 0 ] || ! grep -q '^done: 4 steps' out.txt; then bad "$name" "expected 4 steps"
else ok "$name"; fi
cp "$tokenizer" mq/tokenizer.json
name="the same tokenizer trains"
train --model mq --data prepared "${small[@]}"
if [ "$rc" -ne 0 ] || ! grep -q '^done: 4 steps' out.txt; then bad "$name" "expected 4 steps"
else ok "$name"; fi

# --- 4: options that contradict each other -----------------------------------------------------
refused "--warmup 50 --steps 20" "--warmup 50 is not below --steps 20" --data corpus.txt "${small[@]}" --warmup 50 --steps 20
refused "--save-every without --checkpoint" "--save-every 1 without --checkpoint FILE" --data corpus.txt "${small[@]}" --save-every 1
name="--eval-every 0: no validation before training"
train --data corpus.txt "${small[@]}" --eval-every 0
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif grep -qE '^step +0 \| val' out.txt; then bad "$name" "a step-0 validation"
elif ! grep -qE '^done: 4 steps .* \| val [0-9.]+ nats/byte$' out.txt; then bad "$name" "no final validation on the done line"
else ok "$name"; fi
name="--val-fraction 0 data: no 'val nan'"
train --config cfgq.json --data noval "${small[@]}" --eval-every 2
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif grep -qi 'val nan' out.txt; then bad "$name" "'val nan' printed"
elif [ "$(grep -c 'no validation data' out.txt)" -ne 1 ]; then bad "$name" "'no validation data' not said once"
else ok "$name"; fi

# --- 5: outputs that cannot be written, named before any work ----------------------------------
touch a-file
mkdir a-dir
refused "--save-model /proc/x" "--save-model /proc/x: cannot be created" --data corpus.txt "${small[@]}" --save-model /proc/x
refused "--save-model naming a file" "--save-model a-file: an existing file, not a directory" --data corpus.txt "${small[@]}" --save-model a-file
refused "--checkpoint in a missing directory" "--checkpoint nodir/x.ckpt: cannot be written: nodir: no such directory" \
    --data corpus.txt "${small[@]}" --checkpoint nodir/x.ckpt
refused "--checkpoint naming a directory" "--checkpoint a-dir: is a directory" --data corpus.txt "${small[@]}" --checkpoint a-dir
refused "--metrics naming a directory" "--metrics a-dir: is a directory" --data corpus.txt "${small[@]}" --metrics a-dir
refused "--metrics in a missing directory" "--metrics nodir/m.jsonl: cannot be written" --data corpus.txt "${small[@]}" --metrics nodir/m.jsonl
name="an early error comes first, before any banner"
"$megatrain" train --data corpus.txt "${small[@]}" --save-model /proc/x >both.txt 2>&1
if ! head -1 both.txt | grep -q '^megatrain train: --save-model /proc/x'; then
    rc=1; cp both.txt out.txt; : >err.txt; bad "$name" "the first line is not the error"
else ok "$name"; fi

# --- 6: what --save-model replaces and writes --------------------------------------------------
refused "--save-model equal to --model" "--save-model mq is the --model directory.*--save-over-model" \
    --model mq --data prepared "${small[@]}" --save-model mq
mkdir mixed && echo notes >mixed/README.md
refused "--save-model into a directory of other files" "--save-model mixed: holds files megatrain does not write \(README.md\)" \
    --data corpus.txt "${small[@]}" --save-model mixed
name="the saved model is a complete HF directory"
train --model mq --data prepared "${small[@]}" --save-model mq-sft
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif ! cmp -s mq/tokenizer.json mq-sft/tokenizer.json; then bad "$name" "no tokenizer.json copied"
else
    train --model mq --data prepared "${small[@]}" --save-model mq-sft  # a previous output is replaced
    if [ "$rc" -ne 0 ]; then bad "$name" "a second save into the previous output failed"
    else ok "$name"; fi
fi
# The dtype of safetensors file $1's first tensor.
st_dtype() {
    python3 -c 'import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]
h = json.loads(f.read(n)); print(next(v["dtype"] for k, v in h.items() if k != "__metadata__"))' "$1"
}
name="bf16 weights stay bf16, --save-dtype chooses"
train --data corpus.txt "${small[@]}" --steps 1 --save-model m-bf16 --save-dtype bf16
train --model m-bf16 --data corpus.txt "${small[@]}" --save-model m-bf16-sft
dtype=$(st_dtype m-bf16-sft/model.safetensors 2>/dev/null)
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif [ "$dtype" != BF16 ]; then bad "$name" "saved as '$dtype'"
elif ! grep -q '"torch_dtype": "bfloat16"' m-bf16-sft/config.json; then bad "$name" "config.json does not say bfloat16"
else
    train --model m-bf16 --data corpus.txt "${small[@]}" --save-model m-fp32 --save-dtype fp32
    if [ "$(st_dtype m-fp32/model.safetensors 2>/dev/null)" != F32 ]; then bad "$name" "--save-dtype fp32 not honoured"
    else ok "$name"; fi
fi

# --- 7: a final save cut short is redone; stale temporaries go --------------------------------
name="resume at the last step writes the model"
train --data corpus.txt "${small[@]}" --checkpoint end.ckpt
train --data corpus.txt "${small[@]}" --checkpoint end.ckpt --resume end.ckpt --save-model end-model
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif [ ! -s end-model/model.safetensors ]; then bad "$name" "no model written"
else ok "$name"; fi
name="stale temporaries of dead processes are removed, a live one's kept"
pid=$(dead_pid)
touch "end-model/model.safetensors.tmp.$pid" "end.ckpt.tmp.$pid" "end-model/config.json.tmp.$$"
train --data corpus.txt "${small[@]}" --checkpoint end.ckpt --resume end.ckpt --save-model end-model
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif [ -e "end-model/model.safetensors.tmp.$pid" ] || [ -e "end.ckpt.tmp.$pid" ]; then bad "$name" "a stale temporary is left"
elif [ ! -e "end-model/config.json.tmp.$$" ]; then bad "$name" "the live process's temporary was removed"
else ok "$name"; fi
rm -f "end-model/config.json.tmp.$$"

# --- 8: signals, flushing, resume counts -------------------------------------------------------
long=(--data corpus.txt --steps 400 --micro-batch 2 --seq-len 32 --sample-bytes 0 --eval-every 0 --log-every 1 --ncpu 2 --ncuda 0)
# start_long ARGS...: megatrain train in the background, stdout in bg.txt, stderr in bgerr.txt, pid in $bg.
# The last run's logs go first: the background redirection truncates them only once the child
# runs, and wait_for must not find the last run's lines and signal a process still starting.
start_long() {
    rm -f bg.txt bgerr.txt
    "$megatrain" train "$@" >bg.txt 2>bgerr.txt &
    bg=$!
}
# finish: waits for the background run (at most 60 s, then SIGKILL: a run that ignores the
# signal fails the check instead of hanging the suite); its status in $rc, logs in out.txt, err.txt.
finish() {
    for _ in $(seq 1 600); do
        kill -0 "$bg" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$bg" 2>/dev/null
    wait "$bg"
    rc=$?
    cp bg.txt out.txt; cp bgerr.txt err.txt
}
# wait_for PATTERN: until bg.txt matches (at most 60 s).
wait_for() {
    for _ in $(seq 1 600); do
        grep -qE -- "$1" bg.txt 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
for sig in INT TERM; do
    name="SIG$sig: the step ends, the checkpoint is saved, exit $([ $sig = INT ] && echo 130 || echo 143)"
    rm -f sig.ckpt*
    start_long "${long[@]}" --checkpoint sig.ckpt
    wait_for '^step +3/'
    kill -"$sig" "$bg"
    finish
    want=$([ $sig = INT ] && echo 130 || echo 143)
    step=$(sed -n 's/^megatrain: SIG'"$sig"': stopped after step \([0-9]*\) of 400.*/\1/p' bg.txt)
    if [ "$rc" -ne "$want" ]; then bad "$name" "expected exit status $want"
    elif [ -z "$step" ]; then bad "$name" "no 'SIG$sig: stopped after step N' line"
    elif ! grep -q "^megatrain: checkpoint of step $step saved to sig.ckpt" bg.txt; then bad "$name" "no checkpoint of step $step"
    elif ls sig.ckpt.tmp.* >/dev/null 2>&1; then bad "$name" "a temporary file is left"
    else ok "$name"; fi
done
# Steps of seconds, so that the second signal comes while the first waits for the step to end
# (two signals sent together would arrive as one).
name="a second SIGINT exits at once"
start_long "${long[@]}" --micro-batch 16 --seq-len 128
wait_for '^step +1/'
kill -INT "$bg"
for _ in $(seq 1 100); do grep -q 'stopping after the step in flight' bgerr.txt && break; sleep 0.01; done
kill -INT "$bg"
finish
if [ "$rc" -ne 130 ]; then bad "$name" "expected exit status 130"
elif grep -q 'stopped after step' bg.txt; then bad "$name" "it finished the step first"
else ok "$name"; fi

# The log goes to a file (block-buffered unless the program flushes): once the checkpoint of
# step 2 is on disk and a few more steps have run, a SIGKILL must find its line in the log.
name="after a kill the log has said what is on disk"
rm -f kill.ckpt*
start_long "${long[@]}" --checkpoint kill.ckpt --save-every 2
for _ in $(seq 1 600); do [ -e kill.ckpt ] && break; sleep 0.05; done
sleep 0.5
kill -KILL "$bg"
finish
if [ ! -e kill.ckpt ]; then bad "$name" "no checkpoint written"
elif ! grep -q "^megatrain: checkpoint of step 2 saved to kill.ckpt" bg.txt; then bad "$name" "the log lacks the checkpoint of step 2"
elif ! grep -q "^megatrain: .*parameters" bg.txt; then bad "$name" "the log lacks the header"
else ok "$name"; fi

name="a stopped run resumes bit for bit; done counts this run's steps"
train --data corpus.txt "${small[@]}" --steps 6 --save-model straight
rm -f stop.ckpt
train --data corpus.txt "${small[@]}" --steps 6 --stop-after 3 --checkpoint stop.ckpt --metrics stop.jsonl
train --data corpus.txt "${small[@]}" --steps 6 --checkpoint stop.ckpt --resume stop.ckpt --save-model resumed --metrics stop.jsonl
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif ! grep -qE '^done: 3 steps \(4-6 of 6\) in ' out.txt; then bad "$name" "no 'done: 3 steps (4-6 of 6)' line"
elif ! cmp -s straight/model.safetensors resumed/model.safetensors; then bad "$name" "the resumed model differs"
elif [ "$(python3 -c 'import json, sys; print(",".join(str(json.loads(l)["step"]) for l in open(sys.argv[1])))' stop.jsonl)" != 1,2,3,4,5,6 ]; then
    bad "$name" "the metrics do not hold steps 1-6 once each"
else ok "$name"; fi

name="--metrics: one JSON line a step; the progress line shows elapsed time and epoch"
train --data corpus.txt "${small[@]}" --eval-every 2 --metrics m.jsonl
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif ! python3 - m.jsonl <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
for r in rows:
    for k in ("loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s", "epoch"):
        assert isinstance(r[k], (int, float)) and r[k] >= 0, (k, r)
assert "val_loss" in rows[1] and "val_loss" not in rows[0], rows
PY
then bad "$name" "the metrics lines are not as documented"
elif ! grep -qE '^step +2/4 \| loss .* \| epoch [0-9.e+-]+ \| [0-9]+s, ETA ' out.txt; then bad "$name" "no epoch or elapsed time on the progress line"
else ok "$name"; fi

name="--keep-last 2: numbered checkpoints, the link at the newest"
rm -rf kept && mkdir kept
train --data corpus.txt "${small[@]}" --checkpoint kept/run.ckpt --save-every 1 --keep-last 2
if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
elif [ "$(cd kept && echo *)" != "run.ckpt run.ckpt.000003 run.ckpt.000004" ]; then bad "$name" "files: $(cd kept && echo *)"
elif [ "$(readlink kept/run.ckpt)" != run.ckpt.000004 ]; then bad "$name" "run.ckpt -> $(readlink kept/run.ckpt)"
else ok "$name"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
