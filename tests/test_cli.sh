#!/usr/bin/env bash
# The megatrain command line: help for every command, bad commands, flags and values named on
# stderr with a non-zero exit, the memory plan's verdict, and a short real training run.
# Usage: test_cli.sh PATH/TO/megatrain. Prints one line per check, then "N passed, M failed".
set -u

megatrain=${1:?usage: test_cli.sh PATH/TO/megatrain}
if [ ! -x "$megatrain" ]; then
    echo "test_cli.sh: $megatrain is not an executable" >&2
    exit 2
fi

root=$(cd "$(dirname "$0")/.." && pwd)  # the source tree (tools/norm_replay.py)
work=$(mktemp -d /tmp/mt-cli.XXXXXX)
trap 'rm -rf "$work"' EXIT
export STARPU_SILENT=1
export STARPU_HOME=${STARPU_HOME:-$work/starpu-home}
mkdir -p "$STARPU_HOME"

passed=0
failed=0
out=$work/stdout
err=$work/stderr
rc=0

# Runs megatrain with the given arguments; stdout, stderr and the exit status land in $out,
# $err and $rc.
run() {
    "$megatrain" "$@" >"$out" 2>"$err"
    rc=$?
}

pass() { passed=$((passed + 1)); echo "ok   $1"; }

fail() {
    failed=$((failed + 1))
    echo "FAIL $1: $2"
    echo "     exit status $rc; stdout:"; sed -n '1,15s/^/       /p' "$out"
    echo "     stderr:"; sed -n '1,15s/^/       /p' "$err"
}

# check_ok NAME PATTERN ARGS...: exits 0 and stdout matches PATTERN (a grep -E regex).
check_ok() {
    local name=$1 pattern=$2
    shift 2
    run "$@"
    if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
    elif ! grep -qE -- "$pattern" "$out"; then fail "$name" "stdout does not match '$pattern'"
    else pass "$name"; fi
}

# check_error NAME PATTERN ARGS...: exits non-zero (not by a signal) and stderr matches PATTERN.
check_error() {
    local name=$1 pattern=$2
    shift 2
    run "$@"
    if [ "$rc" -eq 0 ]; then fail "$name" "expected a non-zero exit status"
    elif [ "$rc" -ge 128 ]; then fail "$name" "killed by signal $((rc - 128))"
    elif ! grep -qE -- "$pattern" "$err"; then fail "$name" "stderr does not match '$pattern'"
    else pass "$name"; fi
}

# --- help ------------------------------------------------------------------------------------
check_ok "megatrain --help" '^usage: megatrain COMMAND' --help
check_ok "megatrain train --help" '^usage: megatrain train' train --help
check_ok "megatrain plan --help" '^usage: megatrain plan' plan --help
check_ok "megatrain info --help" '^usage: megatrain info' info --help
check_ok "train --help lists --steps" '--steps N' train --help
check_ok "megatrain bench --help" '^usage: megatrain bench' bench --help
check_ok "megatrain --version names the commit" '^megatrain [0-9.]+ \(commit ([0-9a-f]{7,}(-dirty)?|unknown)\)$' --version
check_ok "megatrain prepare --help" '^usage: megatrain prepare' prepare --help
check_ok "megatrain --help lists the commands" '^  info ' --help
check_ok "megatrain help plan" '^usage: megatrain plan' help plan

# Every command answers --help and --help-all; names an unknown option and exits non-zero; has
# no timing or measured figure in its help (a number followed by a unit of time or of rate).
timing='[0-9](\.[0-9]+)? ?(s|ms|us|ns|seconds?|TFLOP|GFLOP|GB/s|GiB/s|MB/s)([^A-Za-z]|$)'
for sub in train prepare plan bench grads info; do
    check_ok "$sub --help exits 0" "^usage: megatrain $sub" "$sub" --help
    check_ok "$sub --help-all exits 0" "^usage: megatrain $sub" "$sub" --help-all
    check_error "$sub --no-such-option" "unrecognized option '--no-such-option'" "$sub" --no-such-option
    name="$sub --help-all has no timing figure"
    run "$sub" --help-all
    if grep -qE -- "$timing" "$out"; then fail "$name" "$(grep -E -- "$timing" "$out" | head -1)"
    else pass "$name"; fi
done
for sub in eval generate; do
    check_ok "$sub --help exits 0" "^usage: megatrain $sub" "$sub" --help
    check_error "$sub --no-such-option" "unrecognized option '--no-such-option'" "$sub" --no-such-option
done
check_ok "megatrain --help lists generate" '^  generate ' --help
check_ok "generate --help says there is no KV cache" 'no KV cache' generate --help
check_ok "generate --help offers --ncuda" '^  --ncuda N' generate --help

# train --help is one screen: the speculation knobs but one are in --help-all.
name="train --help is at most 60 lines"
run train --help
if [ "$(wc -l <"$out")" -gt 60 ]; then fail "$name" "$(wc -l <"$out") lines"
elif grep -qE -- "$timing" "$out"; then fail "$name" "a timing figure: $(grep -E -- "$timing" "$out" | head -1)"
elif grep -qE -- '--(clip-range|adamw-defer)' "$out"; then fail "$name" "an advanced option listed without --help-all"
else pass "$name"; fi
name="train --help-all lists the advanced options"
run train --help-all
missing=""
for opt in clip-range clip-range-max clip-range-grow clip-range-memory clip-range-check adamw-defer; do
    grep -qE -- "^  --$opt " "$out" || missing="$missing --$opt"
done
if [ -n "$missing" ]; then fail "$name" "missing:$missing"
elif ! grep -q '^advanced' "$out"; then fail "$name" "no advanced section"
else pass "$name"; fi
name="bench --help-all lists the advanced options"
run bench --help-all
missing=""
for opt in layers clip-range clip-range-max clip-range-grow clip-range-memory clip-range-check adamw-defer \
           ranged-bounds norm-log task-log gpu-limit-margin prefetch no-prefetch; do
    grep -qE -- "^  --$opt " "$out" || missing="$missing --$opt"
done
if [ -n "$missing" ]; then fail "$name" "missing:$missing"
else pass "$name"; fi

# --- bad commands, flags and values ----------------------------------------------------------
check_error "unknown command" "unknown command 'frobnicate'" frobnicate
run
if [ "$rc" -eq 0 ]; then fail "no command" "expected a non-zero exit status"
elif ! cat "$out" "$err" | grep -q '^usage: megatrain'; then fail "no command" "no usage printed"
else pass "no command"; fi
check_error "train --bogus" "--bogus" train --bogus
check_error "plan --bogus" "--bogus" plan --bogus
check_error "train --steps abc" "--steps.*'abc'" train --steps abc
check_error "train --clip-speculate maybe" "--clip-speculate: 'maybe' is not auto, off, unit or ranged" train --clip-speculate maybe
check_error "bench --clip-speculate 1" "--clip-speculate: '1' is not auto, off, unit or ranged" bench --clip-speculate 1
check_error "train --clip-speculate on is no mode" "--clip-speculate: 'on' is not auto, off, unit or ranged" train --clip-speculate on
check_ok "train --help lists --clip-speculate" '--clip-speculate M +auto\|off\|unit\|ranged' train --help
check_error "train --clip-range 1" "--clip-range: '1' must be above 1" train --clip-range 1
check_error "bench --clip-range-max x" "--clip-range-max: 'x' is not a number" bench --clip-range-max x
check_ok "bench --help-all lists --clip-range-max" '--clip-range-max R' bench --help-all
check_error "bench --clip-range-grow 0.5" "--clip-range-grow" bench --clip-range-grow 0.5
check_ok "train --help-all lists --clip-range-grow" '--clip-range-grow G' train --help-all
check_error "bench --clip-range-memory 0" "--clip-range-memory" bench --clip-range-memory 0
check_error "train --clip-range-memory 17" "--clip-range-memory" train --clip-range-memory 17
check_ok "bench --help-all lists --clip-range-memory" '--clip-range-memory N' bench --help-all
check_error "train --adamw-spare is no option" "unrecognized option '--adamw-spare'" train --adamw-spare on
check_error "bench --adamw-spare is no option" "unrecognized option '--adamw-spare'" bench --adamw-spare off
check_error "bench --adamw-defer sometimes" "--adamw-defer: 'sometimes' is not auto, on or off" bench --adamw-defer sometimes
check_error "train --clip-range-check 1" "--clip-range-check: '1' is not on or off" train --clip-range-check 1
check_ok "bench --help-all lists --clip-range-check" '--clip-range-check M' bench --help-all
check_ok "bench --help-all lists --norm-log" '--norm-log FILE' bench --help-all
check_ok "train --help-all lists --adamw-defer" '--adamw-defer M' train --help-all
check_ok "train --help lists --offload-checkpoints" '--offload-checkpoints M +auto\|on\|off' train --help
check_ok "bench --help lists --offload-checkpoints" '--offload-checkpoints M +auto\|on\|off' bench --help
check_ok "plan --help lists --offload-checkpoints" '--offload-checkpoints M +auto\|on\|off' plan --help
check_error "train --offload-checkpoints yes" "--offload-checkpoints: 'yes' is not auto, on or off" \
    train --offload-checkpoints yes
check_error "train --steps 0" "--steps.*0" train --steps 0
check_error "train --lr -1" "--lr.*-1" train --lr -1
check_error "train --lr nan" "--lr.*nan" train --lr nan
check_error "train --dtype fp8" "--dtype.*'fp8'" train --dtype fp8
check_error "train --schedule linear" "--schedule.*'linear'" train --schedule linear
check_error "train unexpected argument" "unexpected argument 'extra'" train extra
check_error "plan --shape nope" "'nope'" plan --shape nope
check_ok "megatrain grads --help" '^usage: megatrain grads' grads --help
check_error "grads without arguments" "--model" grads
check_ok "grads --help lists --logits" '--logits' grads --help
check_ok "grads --help lists --dtype" '--dtype fp32|bf16' grads --help
check_error "grads --dtype fp8" "--dtype.*'fp8'" grads --dtype fp8
check_ok "bench --help lists --dtype" '--dtype bf16|fp32' bench --help
check_error "bench --dtype fp16" "--dtype.*'fp16'" bench --dtype fp16
check_error "bench --ranged-bounds slow" "--ranged-bounds: 'slow' is not avx2, avx512 or exact" bench --ranged-bounds slow
check_ok "bench --help-all lists --ranged-bounds" '--ranged-bounds B +avx512\|avx2 \(approximate\) or exact' bench --help-all
check_ok "grads --help lists --save-model" '--save-model DIR' grads --help
# The token file is checked against the config before any weight is read: a config is enough.
mkdir -p "$work/grads-model"
printf '%s' '{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
  "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 64}' \
    >"$work/grads-model/config.json"
head -c 100 /dev/zero >"$work/short.bin"
check_error "grads --tokens of the wrong size" "$work/short.bin: 100 bytes, expected 136" \
    grads --model "$work/grads-model" --tokens "$work/short.bin" --batch 2 --seq-len 16 --out "$work/g.safetensors" --ncuda 0
# A length past the model's positions is refused first, naming the limit and the scaling that lifts
# it; with that scaling the length passes (to the token file's check); bad scalings are usage errors.
check_error "grads --seq-len past max_position_embeddings" \
    "sequence length 128 exceeds the model's max_position_embeddings 64: --rope-scaling yarn:2" \
    grads --model "$work/grads-model" --tokens "$work/short.bin" --batch 2 --seq-len 128 --out "$work/g.safetensors" --ncuda 0
check_error "grads --rope-scaling yarn:2 takes 128 positions" "$work/short.bin: 100 bytes, expected 1032" \
    grads --model "$work/grads-model" --tokens "$work/short.bin" --batch 2 --seq-len 128 --out "$work/g.safetensors" \
    --ncuda 0 --rope-scaling yarn:2
check_error "grads --rope-scaling ntk:2" "type 'ntk' is not one of linear, dynamic, yarn" \
    grads --model "$work/grads-model" --rope-scaling ntk:2
check_error "grads --rope-scaling yarn:1" "factor 1 must be above 1" grads --model "$work/grads-model" --rope-scaling yarn:1
check_ok "grads --help lists --rope-scaling" '--rope-scaling TYPE:F' grads --help
check_error "prepare --format bogus" "--format.*'bogus'" prepare --format bogus
check_error "bench --shape nope" "'nope'" bench --shape nope
check_error "train --resume missing" "/nonexistent.ckpt" train --resume /nonexistent.ckpt --steps 2 --micro-batch 2 --seq-len 32
check_error "plan --shape with --config" "at most one" plan --shape tiny --config /nonexistent.json
check_error "plan --host-memory 12Q" "--host-memory.*'12Q'" plan --host-memory 12Q
check_error "plan --host-layout bogus" "--host-layout.*'bogus'" plan --host-layout bogus
check_error "plan compact with fp32 weights" "bf16" plan --shape tiny --dtype fp32 --host-layout compact --seq-len 128
check_error "info --ncpu x" "--ncpu.*'x'" info --ncpu x
check_error "info --sched bogus" "bogus" info --sched bogus --ncpu 1 --ncuda 0

# --- memory plan -----------------------------------------------------------------------------
# --ncuda 1: the GPU run's plan (bf16 weights, the compact layout possible) on any machine
check_error "plan 7B in 125 GiB, full layout" "needs [0-9]+ bytes" plan --shape qwen2.5-7b --host-memory 134217728000 \
    --host-layout full --ncuda 1
check_ok "plan 0.5B in 100 GB" '^fits:' plan --shape qwen2.5-0.5b --host-memory 100000000000 --ncuda 1
check_ok "plan 7B in 125 GiB: compact, 14.00 bytes per parameter" 'training state 14\.00 bytes per parameter' \
    plan --shape qwen2.5-7b --host-memory 125G --ncuda 1
check_ok "plan 7B in 125 GiB: the choice" '^host layout: compact \(--host-layout auto\)' plan --shape qwen2.5-7b --host-memory 125G \
    --ncuda 1
check_ok "plan without a model: what fits in 125 GiB" '^\| qwen2\.5-7b \| 7\.616B \| compact \|.* fits \|$' \
    plan --host-memory 125G --ncuda 1
check_ok "plan without a model: train's built-in model on the CPU" '^run: 2 CPU \+ 0 CUDA workers' plan --ncpu 2 --ncuda 0
check_ok "plan --cpu: fp32 weights, no GPU column" '^  kind +host bytes +host$' plan --cpu
check_error "plan --cpu --ncuda 1" "--cpu" plan --cpu --ncuda 1
check_error "plan --data missing" "/nonexistent" plan --data /nonexistent
printf '%s' '{"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}' >"$work/qwen2.5-72b.json"
check_ok "plan Qwen2.5-72B in 1.5 TB: compact" '^fits: .*\(compact host layout\)' \
    plan --config "$work/qwen2.5-72b.json" --host-memory 1.5TB --ncuda 1
mkdir -p "$work/hfdir" && cp "$work/qwen2.5-72b.json" "$work/hfdir/config.json"
check_ok "plan --model DIR reads DIR/config.json" '^model: .*hfdir, 80 layers, hidden 8192' \
    plan --model "$work/hfdir" --host-memory 1.5TB --ncuda 1

# --- the training job ------------------------------------------------------------------------
check_error "train --data /nonexistent" "/nonexistent" train --data /nonexistent --steps 1 --ncpu 1
check_error "train --config missing" "/nonexistent/config.json" train --config /nonexistent/config.json --steps 1
mkdir -p "$work/no-config"
check_error "train --config DIR without config.json" "$work/no-config: a directory without a config.json" \
    train --config "$work/no-config" --steps 1 --ncpu 1 --ncuda 0
check_error "plan --config DIR without config.json" "$work/no-config: a directory without a config.json" \
    plan --config "$work/no-config"
check_ok "plan --config DIR reads DIR/config.json" '^model: .*hfdir, 80 layers, hidden 8192' \
    plan --config "$work/hfdir" --host-memory 1.5TB --ncuda 1
check_ok "info" '^info: ok$' info --ncuda 0 --ncpu 1

name="train 3 steps"
run train --steps 3 --micro-batch 2 --seq-len 32 --sample-bytes 20 --eval-every 3 --ncpu 2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^done: 3 steps in .* train loss [0-9.]+ -> [0-9.]+ \| val [0-9.]+ -> [0-9.]+' "$out"; then
    fail "$name" "no 'done: 3 steps ... train loss A -> B | val C -> D' line"
elif ! grep -q -- '^--- sample' "$out" || ! grep -q -- '^--- end of sample ---$' "$out"; then
    fail "$name" "no sample block"
elif ! grep -qF 'A:' "$out"; then fail "$name" "the sample does not start with the prompt"
else pass "$name"; fi

# Past the built-in model's 256 positions: refused before any work, with the option that
# extends the rope; with it, training runs, here in the compact host layout.
check_error "train --seq-len 512 beyond the model's positions" "max_position_embeddings 256: --rope-scaling yarn:2" \
    train --steps 2 --micro-batch 2 --seq-len 512 --ncpu 2 --ncuda 0
check_ok "train --rope-scaling linear:2 --host-layout compact" '^done: 2 steps' \
    train --steps 2 --micro-batch 1 --seq-len 512 --rope-scaling linear:2 --host-layout compact --dtype bf16 \
    --eval-every 0 --sample-bytes 0 --ncpu 2 --ncuda 0
if [ "$rc" -eq 0 ] && ! grep -q '^megatrain: compact host layout (--host-layout compact)' "$out"; then
    fail "train --host-layout compact: the layout line" "no 'compact host layout' line"
fi
check_error "train --host-layout compact --dtype fp32" "compact host layout holds bf16" \
    train --steps 2 --micro-batch 2 --seq-len 32 --host-layout compact --dtype fp32 --ncpu 2 --ncuda 0

# Ranged clip speculation in training (bf16 weights on CPU workers, a bound below the norm):
# the summary says how much it checked and flagged.
name="train --dtype bf16 --clip-speculate ranged"
run train --steps 4 --micro-batch 2 --seq-len 32 --sample-bytes 0 --eval-every 0 --ncpu 2 --ncuda 0 --dtype bf16 \
    --clip 0.01 --clip-speculate ranged
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^clipping at 0.01: ranged speculation checked [1-9][0-9]* parameter updates, flagged [0-9.]+% of them' "$out"; then
    fail "$name" "no 'ranged speculation checked N' line"
else pass "$name"; fi

name="grads --logits --save-model"
run train --steps 1 --micro-batch 2 --seq-len 16 --sample-bytes 0 --eval-every 0 --ncpu 2 --save-model "$work/trained"
head -c 136 /dev/zero >"$work/tokens.bin"
[ "$rc" -eq 0 ] && run grads --model "$work/trained" --tokens "$work/tokens.bin" --batch 2 --seq-len 16 --logits \
    --out "$work/g.safetensors" --save-model "$work/resaved" --ncuda 0 --ncpu 2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q "logits and gradients written to $work/g.safetensors" "$out"; then fail "$name" "no 'logits and gradients written' line"
elif ! cmp -s "$work/trained/model.safetensors" "$work/resaved/model.safetensors"; then
    fail "$name" "the re-saved model.safetensors differs from the loaded one"
else pass "$name"; fi

# --rope-scaling changes the loss (random ids: identical ones would make attention position-blind)
# and travels in the saved config: the re-saved model alone gives the scaled run's loss.
name="grads --rope-scaling yarn:2 --save-model"
for i in $(seq 34); do printf "\\x$(printf %02x $((RANDOM % 256)))\\x00\\x00\\x00"; done >"$work/random.bin"
run grads --model "$work/trained" --tokens "$work/random.bin" --batch 2 --seq-len 16 --out "$work/g0.safetensors" \
    --ncuda 0 --ncpu 2
loss_plain=$(grep -o '^loss [0-9.]*' "$out")
run grads --model "$work/trained" --tokens "$work/random.bin" --batch 2 --seq-len 16 --out "$work/g1.safetensors" \
    --ncuda 0 --ncpu 2 --rope-scaling yarn:2 --save-model "$work/extended"
loss_scaled=$(grep -o '^loss [0-9.]*' "$out")
rc_scaled=$rc
run grads --model "$work/extended" --tokens "$work/random.bin" --batch 2 --seq-len 16 --out "$work/g2.safetensors" \
    --ncuda 0 --ncpu 2
loss_saved=$(grep -o '^loss [0-9.]*' "$out")
if [ "$rc" -ne 0 ] || [ "$rc_scaled" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q '"rope_type": "yarn"' "$work/extended/config.json"; then fail "$name" "no yarn rope_scaling in the saved config"
elif [ -z "$loss_scaled" ] || [ "$loss_scaled" != "$loss_saved" ]; then
    fail "$name" "the saved model's '$loss_saved' is not the scaled run's '$loss_scaled'"
elif [ "$loss_scaled" = "$loss_plain" ]; then fail "$name" "the scaling left the loss at '$loss_plain'"
else pass "$name"; fi

# --mlp-chunk: the dense MLP in chunks of 1, 5 (32 = 6 x 5 + 2) and 32 tokens gives the gradients
# of the whole, bit for bit; so does a training run, every step's loss and the saved model.
name="grads --mlp-chunk 1, 5, 32: the gradients of the whole"
same=yes
for c in 1 5 32; do
    run grads --model "$work/trained" --tokens "$work/random.bin" --batch 2 --seq-len 16 --out "$work/gc$c.safetensors" \
        --ncuda 0 --ncpu 2 --mlp-chunk "$c"
    if [ "$rc" -ne 0 ] || ! cmp -s "$work/g0.safetensors" "$work/gc$c.safetensors"; then same="no (chunk $c, status $rc)"; fi
done
if [ "$same" != yes ]; then fail "$name" "$same"; else pass "$name"; fi
name="train --mlp-chunk 7: the losses and model of the whole"
run train --model "$work/trained" --steps 3 --micro-batch 2 --seq-len 16 --accum 2 --sample-bytes 0 --eval-every 0 \
    --ncpu 2 --ncuda 0 --metrics "$work/m0.jsonl" --save-model "$work/mc0"
rc0=$rc
run train --model "$work/trained" --steps 3 --micro-batch 2 --seq-len 16 --accum 2 --sample-bytes 0 --eval-every 0 \
    --ncpu 2 --ncuda 0 --metrics "$work/m7.jsonl" --save-model "$work/mc7" --mlp-chunk 7
if [ "$rc" -ne 0 ] || [ "$rc0" -ne 0 ]; then fail "$name" "expected exit status 0"
elif [ "$(grep -o '"loss": [^,]*' "$work/m0.jsonl")" != "$(grep -o '"loss": [^,]*' "$work/m7.jsonl")" ]; then
    fail "$name" "the losses differ"
elif ! cmp -s "$work/mc0/model.safetensors" "$work/mc7/model.safetensors"; then fail "$name" "the saved models differ"
else pass "$name"; fi
check_error "grads --mlp-chunk -1" "--mlp-chunk" grads --model "$work/trained" --mlp-chunk -1

# eval and generate on the model trained above (byte-level, no tokenizer.json): the loss line, the
# same text for the same seed, an empty prompt and missing data refused with their names.
name="eval --model (byte-level) --data text"
run eval --model "$work/trained" --data /usr/share/games/fortunes --seq-len 16 --micro-batch 4 --max-sequences 8 \
    --ncuda 0 --ncpu 2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^loss [0-9]+\.[0-9]+ nats/token, perplexity [0-9]+\.[0-9]+, 128 tokens counted in 8 windows of 16 \(fp32\)$' "$out"; then
    fail "$name" "no 'loss L nats/token, perplexity P, 128 tokens counted in 8 windows of 16 (fp32)' line"
else pass "$name"; fi
check_error "eval without --data" "--model DIR and --data PATH are both needed" eval --model "$work/trained"
check_error "eval --data missing" "$work/no-such-data" eval --model "$work/trained" --data "$work/no-such-data"
check_error "eval --model missing" "$work/no-such-model/config.json" \
    eval --model "$work/no-such-model" --data /usr/share/games/fortunes

name="generate (byte-level) seeded twice"
run generate --model "$work/trained" --prompt "Q: What" --max-new-tokens 12 --temperature 0.9 --top-p 0.95 --seed 4
cp "$out" "$work/gen1"
rc1=$rc
run generate --model "$work/trained" --prompt "Q: What" --max-new-tokens 12 --temperature 0.9 --top-p 0.95 --seed 4
if [ "$rc" -ne 0 ] || [ "$rc1" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q '7 prompt tokens, 12 new' "$err"; then fail "$name" "no '7 prompt tokens, 12 new' line"
elif ! cmp -s "$out" "$work/gen1"; then fail "$name" "the same seed gave other text"
else pass "$name"; fi
name="generate --ncuda 0 says it ran on the CPU workers in fp32"
run generate --model "$work/trained" --prompt "Q: What" --max-new-tokens 3 --ncuda 0 --ncpu 2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q '3 new, .* (fp32 on the CPU workers)$' "$err"; then fail "$name" "no '(fp32 on the CPU workers)' line"
else pass "$name"; fi
check_error "generate --prompt ''" "the prompt is empty" generate --model "$work/trained" --prompt ""
check_error "generate --chat without a tokenizer" "no chat template applies" \
    generate --model "$work/trained" --prompt "hi" --chat
check_error "generate --tokenizer missing" "$work/no-such-tokenizer.json" \
    generate --model "$work/trained" --prompt "hi" --tokenizer "$work/no-such-tokenizer.json"

# --dtype is honoured: bf16 weights (rounded from the fp32 masters) give other gradients.
name="grads --dtype bf16 on CPU workers"
run grads --model "$work/trained" --tokens "$work/tokens.bin" --batch 2 --seq-len 16 --dtype fp32 \
    --out "$work/g32.safetensors" --ncuda 0 --ncpu 2
rc32=$rc
run grads --model "$work/trained" --tokens "$work/tokens.bin" --batch 2 --seq-len 16 --dtype bf16 \
    --out "$work/g16.safetensors" --ncuda 0 --ncpu 2
if [ "$rc" -ne 0 ] || [ "$rc32" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q "gradients written to $work/g16.safetensors" "$out"; then fail "$name" "no 'gradients written' line"
elif [ "$(stat -c %s "$work/g32.safetensors")" != "$(stat -c %s "$work/g16.safetensors")" ]; then
    fail "$name" "the fp32 and bf16 files differ in size"
elif cmp -s "$work/g32.safetensors" "$work/g16.safetensors"; then fail "$name" "same bytes as the fp32 gradients"
else pass "$name"; fi

# --- bench on CPU workers: the CPU table (no GPU columns), the log says why there is no breakdown ---
# The tiny shape's model GFLOP/s over its tokens/s is its FLOPs per token at T = 64:
# 6 N + 6 L d T = 6 x 2412864 + 6 x 6 x 192 x 64 = 14919552 (N: all parameters but the table).
name="bench tiny on CPU workers"
run bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 2 --ncpu 2 --ncuda 0
cpu_header='| shape | tokens/step | K | clip | policy | CPU workers | step s | tok/s | model GFLOP/s | AdamW alone s (s/1e9) | AdamW in step CPU s (s/1e9) | AdamW span s | AdamW tail s | boundary gap s | peak host GiB | clip speculation held |'
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qxF -- "$cpu_header" "$out"; then fail "$name" "not the CPU table's header"
elif grep -qE 'GPU|H2D|D2H|-100' "$out"; then fail "$name" "a GPU column or figure on CPU: $(grep -E 'GPU|H2D|D2H|-100' "$out" | head -1)"
elif ! grep -qE '^\| tiny \| 1 x 2 x 64 \| 4 \| 1 \| megatrain \| 2 \| [0-9.]+ \| [0-9]+ \| [0-9.]+ \| [0-9.]+ \([0-9.]+\) \| [0-9.]+ \((0\.0*[1-9][0-9]*|[1-9][0-9]*\.[0-9]+)\) \|' "$out"; then
    fail "$name" "no row with 2 CPU workers and a positive AdamW in step rate"
elif ! awk -F'|' '$2 ~ /tiny/ { r = $10 * 1e9 / $9; exit !(r > 14919552 * 0.99 && r < 14919552 * 1.01) }' "$out"; then
    fail "$name" "model GFLOP/s over tok/s is not 6 N + 6 L d T = 14919552 within 1%"
elif ! grep -q '; no CUDA worker: every task ran on the 2 CPU workers;' "$out"; then fail "$name" "no CPU note"
elif ! grep -q '^bench: GPU time, K=4 clip 1, 2 measured steps: no CUDA worker$' "$err"; then
    fail "$name" "no 'GPU time ... no CUDA worker' line"
else pass "$name"; fi

# bench --shape tiny with its defaults: the length is the model's 256, not 2048; each phase and
# step says so before it runs.
name="bench --shape tiny takes the model's length and says what it does"
run bench --shape tiny --micro-batch 1 --warmup 1 --steps 1 --ncpu 2 --ncuda 0
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^\| tiny \| 1 x 1 x 256 \|' "$out"; then fail "$name" "no row of 1 x 1 x 256 tokens"
elif [ "$(grep -E '^bench: (starting StarPU|setting up the host state of tiny|K=4 clip 1: (warm-up step 1/1|measured step 1/1|AdamW alone))' "$err" |
          sed -E 's/^bench: (K=4 clip 1: )?//; s/ (of|\().*//')" != "$(printf 'starting StarPU\nsetting up the host state\nwarm-up step 1/1\nmeasured step 1/1\nAdamW alone')" ]; then
    fail "$name" "not the progress lines, in order: $(grep -E '^bench: (starting|setting|K=4 clip 1: (warm|meas|AdamW alone))' "$err" | tr '\n' ';')"
else pass "$name"; fi
check_error "bench --shape tiny --seq-len 512: a length given is checked" \
    "sequence length 512 exceeds the model's max_position_embeddings 256" bench --shape tiny --seq-len 512
check_ok "bench --help says the default length" "2048 unless given, or the model's longest" bench --help

# StarPU's RAM node holds only what StarPU allocates itself (every activation has a host home):
# on CPU workers, each worker's scratch (19.19 MiB at 8 x 256 for the tiny shape). Under a limit
# below the two workers' 38.39 MiB the run is refused before any step, naming the node; just
# above it, it runs.
STARPU_LIMIT_CPU_MEM=16 check_error "a RAM node too small for the workers' scratch is refused" \
    "scratch buffers need 19.19 MiB on each of the 2 CPU workers \(38.39 MiB in all\) in StarPU's RAM node, which holds 16.00 MiB" \
    bench --shape tiny --micro-batch 8 --seq-len 256 --warmup 0 --steps 1 --ncpu 2 --ncuda 0
STARPU_LIMIT_CPU_MEM=40 check_ok "a RAM node just above the workers' scratch is enough" '^\| tiny \| 1 x 8 x 256 \|' \
    bench --shape tiny --micro-batch 8 --seq-len 256 --warmup 0 --steps 1 --ncpu 2 --ncuda 0

# --ncpu above the cores: a warning naming both numbers, not an error.
cores=$(nproc)
if [ "$cores" -lt 100 ]; then
    name="--ncpu above the cores warns"
    run info --ncpu $((cores + 1)) --ncuda 0
    if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
    elif ! grep -q "^megatrain: warning: --ncpu $((cores + 1)) asks for more CPU workers than the $cores cores" "$err"; then
        fail "$name" "no warning naming $((cores + 1)) and $cores"
    else pass "$name"; fi
    # train and bench start StarPU through the same call: the same warning, on stderr.
    for sub in train bench; do
        name="$sub --ncpu above the cores warns"
        if [ "$sub" = train ]; then
            run train --ncpu $((cores + 1)) --ncuda 0 --steps 1 --micro-batch 1 --seq-len 16 --sample-bytes 0 --eval-every 0
        else
            run bench --shape tiny --ncpu $((cores + 1)) --ncuda 0 --warmup 1 --steps 1 --micro-batch 1 --seq-len 16
        fi
        if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
        elif ! grep -q "^megatrain: warning: --ncpu $((cores + 1)) asks for more CPU workers than the $cores cores" "$err"; then
            fail "$name" "no warning naming $((cores + 1)) and $cores"
        else pass "$name"; fi
    done
fi
name="--ncpu within the cores: no warning"
run info --ncpu 1 --ncuda 0
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif grep -q "warning: --ncpu" "$err"; then fail "$name" "a warning"
else pass "$name"; fi

name="bench --sched eager: no GPU breakdown"
run bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 --sched eager
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q '^bench: GPU time, K=4 clip 1, 1 measured step: not available (policy eager)$' "$err"; then
    fail "$name" "no 'GPU time ... not available (policy eager)' line"
else pass "$name"; fi

name="bench --dtype fp32"
run bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 --dtype fp32
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^bench: tiny \([0-9]+ layers, fp32\)' "$err"; then fail "$name" "no 'bench: tiny (N layers, fp32)' line"
elif ! grep -qE '^bench: megatrain [0-9.]+, commit ' "$err"; then fail "$name" "no 'bench: megatrain V, commit C' line"
elif ! grep -qE '^\| tiny \| 1 x 2 x 64 \|' "$out"; then fail "$name" "no result row"
else pass "$name"; fi

# Ranged speculation on CPU workers (bf16 streamed weights, clip below the tiny model's norm): the
# log counts what it speculated, and the table's last column says how it fared.
name="bench --clip-speculate ranged"
run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 2 --ncpu 2 --ncuda 0 \
    --clip-speculate ranged --clip-range 1.2 --clip-range-max 2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^bench: K=4 clip 0.01: ranged speculation \((AVX-512 approximate-reciprocal|AVX2 approximate-reciprocal|exact) bounds\) checked [1-9][0-9]* parameter updates' "$err"; then
    fail "$name" "no 'ranged speculation checked N' line"
elif ! grep -qE '\| ranged [0-9]+%, in range [0-9]+%, [0-9.]+% flagged, (avx512|avx2|exact) bounds, deferred \|$' "$out"; then
    fail "$name" "no ranged column naming the bounds and the deferral"
elif ! grep -q '^bench: K=4 clip 0.01: AdamW moments halves deferred' "$err"; then
    fail "$name" "no 'deferred' line (--adamw-defer auto, the default, defers with ranged speculation when it fits)"
elif ! grep -qE '^bench: K=4 clip 0.01: AdamW tasks, CPU-s per measured step:.* ranged pass( with last moments)? [0-9.]+;.* ranged redo [0-9.]+;.* total [0-9.]+$' "$err"; then
    fail "$name" "no AdamW time by kind of task (ranged pass, ranged redo, total)"
elif ! grep -qE "^bench: K=4 clip 0.01: of those, the table's: [1-9][0-9]* checked on its early path, [0-9.]+% of them flagged; [1-9][0-9]* elements of the rows" "$err"; then
    fail "$name" "no line on the table's share"
else pass "$name"; fi

# The norm log: a header naming the tiles, then a row per norm of each clipped pair (none for
# clip 0), each row's norm the square root of its tiles' sums; a file that cannot be written
# is named before any work. (This run also takes --ranged-bounds exact, which the log names.)
name="bench --norm-log"
run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01,0 --warmup 1 --steps 2 --ncpu 2 --ncuda 0 \
    --clip-speculate ranged --norm-log "$work/norms.csv" --ranged-bounds exact
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qE '^bench: K=4 clip 0.01: ranged speculation \(exact bounds\) checked [1-9]' "$err"; then
    fail "$name" "--ranged-bounds exact not named in the log"
elif ! head -1 "$work/norms.csv" | grep -qE '^K,clip,norm,grad_norm,embedding,layer0,.*,table_head_part$'; then
    fail "$name" "no header naming the tiles"
elif [ "$(grep -c '^4,0.01,' "$work/norms.csv")" -ne 3 ] || grep -q '^4,0,' "$work/norms.csv"; then
    fail "$name" "expected 3 rows for clip 0.01 and none for clip 0"
elif ! awk -F, 'NR > 1 { s = 0; for (i = 5; i < NF; i++) s += $i; d = sqrt(s) - $4; if (d < 0) d = -d;
                         if ($3 != NR - 1 || d > 1e-6 * $4 || $4 <= 0) bad = 1 } END { exit bad }' "$work/norms.csv"; then
    fail "$name" "rows not numbered 1.. or their norm not the root of their sums"
elif [ "$(awk -F, '$1 == 4 && $2 == 0.01 && $3 <= 2 { printf "%.4g\n", $4 }' "$work/norms.csv")" != \
       "$(sed -n 's/^bench: K=4 clip 0.01 step [12] loss [0-9.]* grad norm \([0-9.e+-]*\)$/\1/p' "$err")" ]; then
    fail "$name" "the norms of rows 1 and 2 are not those of the log's steps 1 and 2"
elif ! python3 "$root/tools/norm_replay.py" --from 2 "$work/norms.csv" >"$work/replay.txt" 2>&1; then
    fail "$name" "tools/norm_replay.py failed on the log: $(head -c 300 "$work/replay.txt")"
elif ! grep -qE '^K=4 clip 0.01, 3 norms, spread 1.25 growing to 3 \(memory 4\); ranges held per norm: 2:[0-9]+/[0-9]+ 3:[0-9]+/[0-9]+$' "$work/replay.txt" ||
     ! grep -qE '^  spread per norm: 2:1.25 3:(1\.2[5-9][0-9]*|1\.[3-9][0-9]*|2(\.[0-9]+)?|3)$' "$work/replay.txt" ||
     ! grep -qE '^  rule last +held +[0-9]+  missed +[0-9]+  not speculated +[0-9]+  score [+-][0-9]+$' "$work/replay.txt"; then
    fail "$name" "tools/norm_replay.py: no per-norm line or no score of the rule 'last'"
else
    run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 \
        --norm-log "$work/no/such/dir/norms.csv"
    if [ "$rc" -eq 0 ]; then fail "$name" "expected failure for an unwritable file"
    elif ! grep -q "norm-log: cannot write '$work/no/such/dir/norms.csv'" "$err"; then fail "$name" "error does not name the file"
    else pass "$name"; fi
fi

# The task log: the measured steps' tasks of every worker, by start; each step's embedding
# forward in it at the time its header gives, every task ended after it started; an unwritable
# file is named before any work.
name="bench --task-log"
run bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 2 --ncpu 2 --ncuda 0 --task-log "$work/tasks.csv"
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qx 'worker,kind,name,tile,pop_ms,start_ms,end_ms' "$work/tasks.csv"; then fail "$name" "no CSV header"
elif [ "$(grep -c '^# step [23]: embedding forward ' "$work/tasks.csv")" -ne 2 ]; then
    fail "$name" "expected the two measured steps' embedding forward times"
elif ! awk -F, '/^# step/ { sub(/ ms.*/, "", $0); n = split($0, w, " "); want[w[n]] = 1; next }
                /^[0-9]/ { rows++; if ($2 != "cpu" || $7 < $6 || $6 < $5 || $6 < last) bad = 1; last = $6
                           if ($3 == "embedding_forward") for (t in want) if ($6 - t < 1 && t - $6 < 1) seen[t] = 1
                           if ($3 == "adamw_params") { adamw++; if ($4 < 0) untiled++ } }
                END { for (t in want) if (!(t in seen)) bad = 1; exit bad || rows < 20 || adamw == 0 || untiled > 0 }' "$work/tasks.csv"; then
    fail "$name" "rows not by start, not cpu, ended before started, no AdamW, AdamW without its tile, or no embedding forward at the steps' times"
else
    run bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 \
        --task-log "$work/no/such/dir/tasks.csv"
    if [ "$rc" -eq 0 ]; then fail "$name" "expected failure for an unwritable file"
    elif ! grep -q "task-log: cannot write '$work/no/such/dir/tasks.csv'" "$err"; then fail "$name" "error does not name the file"
    else pass "$name"; fi
fi

# --data: a text corpus read as bytes, a fresh batch each step. The log names the corpus and its
# training split (every 10th 4 KiB block held out: 9 of the 10 blocks here); two runs give the
# same losses, and those differ from the default run's (one batch of random tokens). Errors name
# the path, and a prepared directory the run cannot use says why, before any work.
for i in $(seq 1 2000); do
    echo "Line $i: a fortune for the bench, $((i * 7919 % 1000)) of them told."
    [ $((i % 5)) -eq 0 ] && echo
done | head -c 40960 >"$work/corpus.txt"
# train's corpus line on a small corpus: one file, its split in units that show it (9 of 10 blocks).
check_ok "train --data (one small file): the corpus line" \
    "^megatrain: corpus $work/corpus.txt: 1 file, 36.00 KiB train, 4.00 KiB validation$" \
    train --data "$work/corpus.txt" --steps 1 --micro-batch 1 --seq-len 16 --sample-bytes 0 --eval-every 0 --ncpu 2 --ncuda 0
bench_data=(bench --shape tiny --micro-batch 2 --seq-len 64 --warmup 1 --steps 2 --ncpu 2 --ncuda 0)
run "${bench_data[@]}"
grep '^bench: K=4 clip 1 step' "$err" >"$work/random_losses.txt"

# check_bench_data NAME DATA LINE: bench on DATA exits 0, its log has LINE and 2 loss lines, a
# second run has the same losses, and they are not those of the random batch.
check_bench_data() {
    local name=$1 data=$2 line=$3
    run "${bench_data[@]}" --data "$data"
    grep '^bench: K=4 clip 1 step' "$err" >"$work/data_losses_1.txt"
    if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
    elif ! grep -qF "$line" "$err"; then fail "$name" "no '$line' line"
    elif [ "$(wc -l <"$work/data_losses_1.txt")" -ne 2 ]; then fail "$name" "expected 2 loss lines"
    else
        run "${bench_data[@]}" --data "$data"
        grep '^bench: K=4 clip 1 step' "$err" >"$work/data_losses_2.txt"
        if ! cmp -s "$work/data_losses_1.txt" "$work/data_losses_2.txt"; then fail "$name" "two runs on the data differ"
        elif cmp -s "$work/data_losses_1.txt" "$work/random_losses.txt" || [ ! -s "$work/random_losses.txt" ]; then
            fail "$name" "the data run's losses are those of the random batch"
        else pass "$name"; fi
    fi
}
check_bench_data "bench --data (text)" "$work/corpus.txt" \
    "bench: data $work/corpus.txt: 36864 bytes (the byte-level trainer's training split) as tokens"
check_error "bench --data missing" "$work/no-such-corpus: No such file or directory" \
    bench --shape tiny --ncpu 2 --ncuda 0 --seq-len 64 --data "$work/no-such-corpus"
name="bench --data (prepared, not for this run)"
run prepare --tokenizer "$root/tests/fixtures/tokenizers/qwen3/tokenizer.json" --format text --family qwen3 \
    --input "$work/corpus.txt" --output "$work/prepared" --seq-len 32
if [ "$rc" -ne 0 ]; then fail "$name" "prepare failed"
else
    run bench --shape tiny --micro-batch 2 --seq-len 32 --ncpu 2 --ncuda 0 --data "$work/prepared"
    if [ "$rc" -eq 0 ] || ! grep -qF "shape tiny: vocab_size 256 does not cover the tokenizer of $work/prepared" "$err"; then
        fail "$name" "no error naming the shape's vocabulary and the directory"
    else
        run bench --shape qwen2.5-0.5b --micro-batch 2 --seq-len 64 --ncpu 2 --ncuda 0 --data "$work/prepared"
        if [ "$rc" -eq 0 ] || ! grep -qF "$work/prepared was prepared with seq_len 32, the run has --seq-len 64" "$err"; then
            fail "$name" "no error naming the two sequence lengths"
        else pass "$name"; fi
    fi
fi
# prepare on a one-line input: each count in the number it has ("1 document, 1 token"); a UTF-8
# byte order mark before a JSONL file's first record is skipped, not reported.
name="prepare a one-line file: singular counts"
printf 'hello\n' >"$work/one-line.txt"
run prepare --tokenizer "$root/tests/fixtures/tokenizers/qwen3/tokenizer.json" --format text --family qwen3 \
    --input "$work/one-line.txt" --output "$work/one-line" --seq-len 4 --val-fraction 0
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -qx "prepare: $work/one-line.txt: 1 line (6 bytes), 1 document, 1 token" "$err"; then
    fail "$name" "no 'one-line.txt: 1 line (6 bytes), 1 document, 1 token' line"
elif ! grep -qx "prepared $work/one-line: train 1 document, 1 window, 1 trained target; validation 0 documents, 0 windows, 0 trained targets" "$out"; then
    fail "$name" "no 'train 1 document, 1 window, 1 trained target; validation 0 documents, ...' line"
else pass "$name"; fi
name="prepare --format alpaca: a byte order mark before the first record"
printf '\xEF\xBB\xBF{"instruction": "say hi", "input": "", "output": "hi"}\n{"instruction": "say yo", "input": "", "output": "yo"}\n' \
    >"$work/bom.jsonl"
run prepare --tokenizer "$root/tests/fixtures/tokenizers/qwen3/tokenizer.json" --format alpaca --family qwen3 \
    --input "$work/bom.jsonl" --output "$work/bom-prepared" --seq-len 16 --val-fraction 0
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q "^prepared $work/bom-prepared: train 2 documents" "$out"; then fail "$name" "not 2 documents trained"
else pass "$name"; fi
# A prepared directory of byte tokens (vocabulary 256, written here in the shard format of
# docs/data.md): bench reads its training windows in order, a fresh batch each step.
python3 - "$work/corpus.txt" "$work/bytes-prepared" <<'PY'
import json, os, struct, sys
text, out = open(sys.argv[1], "rb").read(), sys.argv[2]
T, N = 64, 8
os.makedirs(out)
tokens = [b for w in range(N) for b in text[w * 97: w * 97 + T + 1]]
mask = [0 if i % (T + 1) == 0 else 1 for i in range(len(tokens))]
payload = struct.pack(f"<{len(tokens)}i", *tokens) + bytes(mask)
h = 0xcbf29ce484222325
for byte in payload:
    h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
header = b"MTSHARDS" + struct.pack("<IIQQIIQ", 1, 64, T, N, 1, 2, h) + bytes(16)
open(os.path.join(out, "train-00000.bin"), "wb").write(header + payload)
json.dump({"format": "megatrain-token-shards", "version": 1, "seq_len": T, "family": "qwen2",
           "tokenizer": {"path": "bytes", "vocab_size": 256, "fnv1a64": "0"},
           "train": {"shards": ["train-00000.bin"]}, "val": {"shards": []}},
          open(os.path.join(out, "meta.json"), "w"))
PY
check_bench_data "bench --data (prepared)" "$work/bytes-prepared" \
    "bench: data $work/bytes-prepared: 8 training windows of 64 tokens, a fresh batch each step"
check_ok "bench --help lists --data" '--data PATH' bench --help

name="bench --clip-speculate ranged --adamw-defer on/off"
run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 2 --ncpu 2 --ncuda 0 \
    --clip-speculate ranged --adamw-defer on
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q '^bench: K=4 clip 0.01: AdamW moments halves deferred' "$err"; then fail "$name" "no 'deferred' line with on"
elif ! grep -qE '\| ranged [0-9]+%, in range [0-9]+%, [0-9.]+% flagged, (avx512|avx2|exact) bounds, deferred \|$' "$out"; then
    fail "$name" "no ranged column"
else
    run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 2 --ncpu 2 --ncuda 0 \
        --clip-speculate ranged --adamw-defer off
    if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0 with off"
    elif grep -q 'deferred' "$err"; then fail "$name" "'deferred' with off"
    elif ! grep -qE '\| ranged [0-9]+%, in range [0-9]+%, [0-9.]+% flagged, (avx512|avx2|exact) bounds \|$' "$out"; then
        fail "$name" "no ranged column with off (bounds named, no 'deferred')"
    else pass "$name"; fi
fi

# Lists of --adamw-defer and --ranged-bounds: each combination measured on one host state, in
# order (defer outer, bounds inner), each row naming what ran.
name="bench --adamw-defer on,off --ranged-bounds exact,avx2"
run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 \
    --clip-speculate ranged --adamw-defer on,off --ranged-bounds exact,avx2
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
else
    got=$(grep -oE 'flagged, [a-z0-9]+ bounds(, deferred)? \|$' "$out" | sed 's/^flagged, //; s/ bounds//; s/ |$//' | tr '\n' ';')
    # avx2 falls back to exact on CPUs without AVX2 and FMA
    if [ "$got" != "exact, deferred;avx2, deferred;exact;avx2;" ] && [ "$got" != "exact, deferred;exact, deferred;exact;exact;" ]; then
        fail "$name" "rows '$got', not deferred exact, deferred avx2, exact, avx2"
    else pass "$name"; fi
fi
check_error "bench --ranged-bounds avx2,slow" "--ranged-bounds: 'slow' is not avx2, avx512 or exact" bench --ranged-bounds avx2,slow

# --adamw-defer on where it cannot apply (fp32 weights on CPU workers): bench says so.
name="bench --adamw-defer on without ranged speculation"
run bench --shape tiny --micro-batch 2 --seq-len 64 --clip 0.01 --warmup 1 --steps 1 --ncpu 2 --ncuda 0 --adamw-defer on
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q -- '--adamw-defer on has no effect here' "$err"; then fail "$name" "no 'has no effect' line"
else pass "$name"; fi

# tools/adamw_bw, the AdamW traffic diagnostic next to megatrain: --help, a bad count, a tiny run.
adamw_bw="$(dirname "$megatrain")/adamw_bw"
name="adamw_bw --help, bad count, tiny run"
if ! "$adamw_bw" --help >"$out" 2>"$err" || ! grep -q '^usage: adamw_bw' "$out"; then rc=$?; fail "$name" "no usage from --help"
elif "$adamw_bw" --threads 0 >"$out" 2>"$err" || ! grep -q "threads: '0' is not a count in range" "$err"; then
    rc=$?; fail "$name" "--threads 0 not refused"
elif ! "$adamw_bw" --params 100000 --threads 2 >"$out" 2>"$err" || [ "$(grep -c 'GB/s at' "$out")" -ne 9 ]; then
    rc=$?; fail "$name" "not nine result rows"
elif ! grep -q '^| ranged pass (weights half + flags) | [0-9.]* s per 1e9 parameters' "$out"; then
    rc=1; fail "$name" "no ranged pass row"
elif ! grep -qE '^adamw_bw: the ranged pass \((AVX-512 approximate-reciprocal|AVX2 approximate-reciprocal|exact) bounds on this CPU\) flagged [0-9.]+% of the parameters' "$out"; then
    rc=1; fail "$name" "no flagged share"
else pass "$name"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
