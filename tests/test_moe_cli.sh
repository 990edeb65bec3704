#!/usr/bin/env bash
# A mixture-of-experts model fine-tuned end to end with the command line, on CPU workers only:
# a tiny random qwen3_moe HF directory written by `train --config --save-model`, an alpaca file
# prepared with the Qwen3 tokenizer, `train --model DIR --save-model OUT` (the loss falls; OUT
# keeps the config and names every expert and router as HF does), OUT loaded again, a run stopped
# with --stop-after and resumed bit for bit the uninterrupted one, eval and generate on OUT; the
# router's load-balancing loss (--router-aux-loss) and a model with a dense layer; the save and
# load round trip of a mixtral directory (its w1/w2/w3 names); a gpt_oss model trained, saved
# with its fused experts, resumed, evaluated and generating.
# Usage: test_moe_cli.sh PATH/TO/megatrain. Prints one line per check, then "N passed, M failed".
set -u

. "$(dirname "$0")/script_harness.sh" moe-cli "$@"

# mt CMD ARGS...: runs megatrain; stdout in out.txt, stderr in err.txt, status in $rc.
mt() {
    "$megatrain" "$@" >out.txt 2>err.txt
    rc=$?
}

tokenizer=$root/tests/fixtures/tokenizers/qwen3/tokenizer.json
fixtures=$root/tests/fixtures/moe
# The batch and the schedule of every training run here (CPU workers only).
run=(--data shards --micro-batch 2 --seq-len 32 --lr 0.01 --sample-bytes 0 --eval-every 0 --log-every 1
    --ncpu 2 --ncuda 0)

# check_dir NAME DIR FAMILY BASE: DIR's config.json is BASE's (every key of the fixture
# BASE kept, model_type FAMILY), and model.safetensors names the router and every expert's three
# matrices of every layer under the family's HF names, with the config's shapes.
check_dir() {
    local name=$1 dir=$2 family=$3 base=$4 msg
    if ! msg=$(python3 - "$dir" "$family" "$base" 2>&1 <<'PY'
import json, struct, sys
d, family, base = sys.argv[1:]
cfg = json.load(open(d + "/config.json"))
want = json.load(open(base))
for k, v in want.items():
    got = cfg.get(k)
    if isinstance(v, float) and isinstance(got, (int, float)):
        ok = abs(got - v) <= 1e-12 * max(1.0, abs(v))
    else:
        ok = got == v
    if not ok:
        sys.exit(f"config.json: {k} is {got!r}, the fixture has {v!r}")
with open(d + "/model.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
header.pop("__metadata__", None)
d_model = cfg["hidden_size"]
if family == "qwen3_moe":
    E, Ie, block = cfg["num_experts"], cfg["moe_intermediate_size"], "mlp"
    names = {"gate_proj": (Ie, d_model), "up_proj": (Ie, d_model), "down_proj": (d_model, Ie)}
else:
    E, Ie = cfg["num_local_experts"], cfg["intermediate_size"]
    block = "mlp" if family == "gpt_oss" else "block_sparse_moe"
    names = {"w1": (Ie, d_model), "w3": (Ie, d_model), "w2": (d_model, Ie)}
want_shapes = {}
for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}.{block}"
    if family == "gpt_oss":  # the router with its bias, the experts fused with theirs, and sinks
        want_shapes.update({f"{p}.router.weight": (E, d_model), f"{p}.router.bias": (E,),
                            f"{p}.experts.gate_up_proj": (E, d_model, 2 * Ie), f"{p}.experts.gate_up_proj_bias": (E, 2 * Ie),
                            f"{p}.experts.down_proj": (E, Ie, d_model), f"{p}.experts.down_proj_bias": (E, d_model),
                            f"model.layers.{i}.self_attn.sinks": (cfg["num_attention_heads"],),
                            f"model.layers.{i}.self_attn.o_proj.bias": (d_model,)})
        continue
    want_shapes[f"{p}.gate.weight"] = (E, d_model)
    for e in range(E):
        for m, shape in names.items():
            want_shapes[f"{p}.experts.{e}.{m}.weight"] = shape
for k, shape in want_shapes.items():
    if k not in header:
        sys.exit(f"model.safetensors has no {k}")
    if tuple(header[k]["shape"]) != shape:
        sys.exit(f"{k} has shape {header[k]['shape']}, want {list(shape)}")
dense = [k for k in header if ".mlp.gate_proj" in k or ".mlp.up_proj" in k or ".mlp.down_proj" in k]
if dense:
    sys.exit(f"model.safetensors has dense MLP tensors: {dense[:3]}")
PY
    ); then bad "$name" "$msg"
    else ok "$name"; fi
}

# losses FILE: the loss of every step of a metrics file, one a line.
losses() { python3 -c 'import json, sys; [print(json.loads(l)["loss"]) for l in open(sys.argv[1])]' "$1"; }

# --- the data and the starting model ---------------------------------------------------------
# An alpaca file of 120 distinct, repetitive answers: a tiny model learns it in a few steps.
for i in $(seq 1 120); do
    printf '{"instruction": "Add %d and %d.", "input": "", "output": "The sum of %d and %d is %d."}\n' \
        "$i" $((i * 7 % 23)) "$i" $((i * 7 % 23)) $((i + i * 7 % 23))
done >chat.jsonl
mt prepare --tokenizer "$tokenizer" --family qwen3 --format alpaca --input chat.jsonl --output shards --seq-len 32
if [ "$rc" -ne 0 ] || [ ! -f shards/meta.json ]; then bad "prepare an alpaca file" "no prepared directory"
else ok "prepare an alpaca file"; fi

# A random qwen3_moe directory: the fixture's config, one step, saved; the tokenizer beside it.
mt train --config "$fixtures/qwen3_moe.json" "${run[@]}" --steps 1 --save-model base
if [ "$rc" -ne 0 ] || [ ! -f base/model.safetensors ]; then bad "a random qwen3_moe directory" "not written"
else cp "$tokenizer" base/ && ok "a random qwen3_moe directory"; fi
check_dir "its config and expert names" base qwen3_moe "$fixtures/qwen3_moe.json"

# --- fine-tuning: train --model DIR --checkpoint --save-model --------------------------------
mt train --model base "${run[@]}" --steps 10 --metrics full.jsonl --checkpoint ck --save-model tuned
if [ "$rc" -ne 0 ]; then bad "train --model (qwen3_moe)" "failed"
elif [ ! -f ck ] || [ ! -f tuned/model.safetensors ] || [ ! -f tuned/tokenizer.json ]; then
    bad "train --model (qwen3_moe)" "no checkpoint, model or tokenizer.json written"
elif ! grep -q '(qwen3_moe, 2 layers' err.txt out.txt; then bad "train --model (qwen3_moe)" "not read as qwen3_moe"
else ok "train --model (qwen3_moe)"; fi
tuned_val=$(cat out.txt err.txt | sed -n 's/^done:.* | val \([0-9.]*\) nats\/token.*/\1/p')
# The loss falls: the mean of the last 4 steps at least 1 nat below the first step's (random
# initialisation starts near ln 151669 = 11.9; 10 steps at lr 0.01 reach about 8).
if ! python3 - full.jsonl <<'PY'
import json, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]
assert len(loss) == 10, f"{len(loss)} steps in the metrics"
last = sum(loss[-4:]) / 4
assert last < loss[0] - 1.0, f"loss {loss[0]:.4f} -> mean of the last 4 {last:.4f}"
PY
then bad "the loss falls" "see above"
else ok "the loss falls"; fi
check_dir "the saved config and expert names" tuned qwen3_moe "$fixtures/qwen3_moe.json"
if cmp -s base/model.safetensors tuned/model.safetensors; then bad "the experts trained" "tuned equals base"
else ok "the experts trained"; fi

# The saved directory loads: a step of lr 0 and no decay saves the same bytes again.
mt train --model tuned "${run[@]}" --steps 1 --lr 0 --weight-decay 0 --save-model again
if [ "$rc" -ne 0 ]; then bad "train --model OUT" "failed"
elif ! cmp -s tuned/model.safetensors again/model.safetensors; then
    bad "train --model OUT" "a step of lr 0 changed model.safetensors"
else ok "train --model OUT"; fi

# --- stop and resume: bit for bit the uninterrupted run -------------------------------------
mt train --model base "${run[@]}" --steps 10 --metrics part.jsonl --stop-after 5 --checkpoint ck2
if [ "$rc" -ne 0 ] || [ ! -f ck2 ]; then bad "--stop-after 5" "no checkpoint"
else ok "--stop-after 5"; fi
mt train --model base "${run[@]}" --steps 10 --metrics part.jsonl --resume ck2 --checkpoint ck2 --save-model resumed
if [ "$rc" -ne 0 ]; then bad "--resume" "failed"
elif ! grep -q 'resumed from ck2 at step 5' err.txt out.txt; then bad "--resume" "not resumed at step 5"
elif [ "$(losses full.jsonl)" != "$(losses part.jsonl)" ]; then bad "--resume" "the losses differ from the uninterrupted run"
elif ! cmp -s tuned/model.safetensors resumed/model.safetensors; then
    bad "--resume" "model.safetensors differs from the uninterrupted run's"
else ok "--resume"; fi

# --- eval and generate on the saved model ----------------------------------------------------
mt eval --model tuned --data shards --ncpu 2 --ncuda 0
eval_loss=$(sed -n 's/^loss \([0-9.]*\) nats\/token.*/\1/p' out.txt)
# eval runs train's validation path: the loss train printed at its end (4 decimals there).
if [ "$rc" -ne 0 ] || [ -z "$eval_loss" ]; then bad "eval --model OUT" "no loss line"
elif [ -z "$tuned_val" ] || ! awk -v a="$eval_loss" -v b="$tuned_val" 'BEGIN { d = a - b; exit !(d < 6e-5 && d > -6e-5) }'; then
    bad "eval --model OUT" "loss $eval_loss, train's validation loss ${tuned_val:-missing}"
else ok "eval --model OUT"; fi
mt generate --model tuned --prompt x --max-new-tokens 3
if [ "$rc" -ne 0 ] || ! grep -q '1 prompt tokens, 3 new' err.txt; then bad "generate --model OUT" "no 3 new tokens"
else ok "generate --model OUT"; fi

# --- the router's load-balancing loss: --router-aux-loss -------------------------------------
# The first step's loss with it on is the same run's without it plus coef x aux, aux near k = 2
# for a random router (at most E = 4); the option goes into the checkpoint's settings, so a
# resume with another value is refused naming it; a dense model has no router to balance.
mt train --model base "${run[@]}" --steps 2 --metrics aux0.jsonl --router-aux-loss 0
rc0=$rc
mt train --model base "${run[@]}" --steps 3 --stop-after 2 --metrics aux.jsonl --router-aux-loss 0.5 --checkpoint ck3
if [ "$rc0" -ne 0 ] || [ "$rc" -ne 0 ]; then bad "--router-aux-loss" "a run failed"
elif ! grep -q 'load-balancing loss is on (coefficient 0.5)' err.txt out.txt; then bad "--router-aux-loss" "not said on"
elif ! python3 - aux0.jsonl aux.jsonl <<'PY'
import json, sys
off, on = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:3])
d = on[0] - off[0]
assert 0.5 * 0.5 < d < 0.5 * 4, f"step 1: loss {on[0]:.6f} with the aux loss, {off[0]:.6f} without"
PY
then bad "--router-aux-loss" "see above"
else ok "--router-aux-loss"; fi
mt train --model base "${run[@]}" --steps 3 --resume ck3 --router-aux-loss 0.1
if [ "$rc" -eq 0 ] || ! grep -q 'router-aux-loss' err.txt; then bad "--resume checks --router-aux-loss" "not refused"
else ok "--resume checks --router-aux-loss"; fi
# a run's coefficient is not the model's: the saved config keeps the base's two keys
mt train --model base "${run[@]}" --steps 3 --resume ck3 --router-aux-loss 0.5 --save-model aux-saved
if [ "$rc" -ne 0 ]; then bad "--router-aux-loss --save-model" "the run failed"
elif ! python3 - base/config.json aux-saved/config.json <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
for k in ("router_aux_loss_coef", "output_router_logits"):
    assert a.get(k) == b.get(k), f"{k}: base {a.get(k)!r}, saved {b.get(k)!r}"
PY
then bad "--router-aux-loss --save-model" "see above"
else ok "--router-aux-loss --save-model keeps the model's keys"; fi
mt train --steps 1 --router-aux-loss 0.1 --ncpu 2 --ncuda 0
if [ "$rc" -eq 0 ] || ! grep -q 'no mixture-of-experts layer' err.txt; then
    bad "--router-aux-loss on a dense model" "not refused"
else ok "--router-aux-loss on a dense model"; fi

# --- dense and sparse layers in one model: mlp_only_layers -----------------------------------
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["mlp_only_layers"] = [0]; json.dump(c, open("mixed.json", "w"))' \
    "$fixtures/qwen3_moe.json"
mt train --config mixed.json "${run[@]}" --steps 2 --router-aux-loss 0.01 --save-model xbase
if [ "$rc" -ne 0 ] || ! python3 - xbase <<'PY'
import json, struct, sys
with open(sys.argv[1] + "/model.safetensors", "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
for k in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
    assert k in header, f"no {k}"
assert "model.layers.0.mlp.gate.weight" not in header and "model.layers.1.mlp.up_proj.weight" not in header
PY
then bad "a model with a dense layer 0" "failed, or the saved names are wrong"
else ok "a model with a dense layer 0"; fi

# --- mixtral: its names, saved and loaded ----------------------------------------------------
mt train --config "$fixtures/mixtral.json" "${run[@]}" --steps 1 --save-model mbase
if [ "$rc" -ne 0 ] || [ ! -f mbase/model.safetensors ]; then bad "a random mixtral directory" "not written"
else cp "$tokenizer" mbase/ && ok "a random mixtral directory"; fi
check_dir "mixtral's config and expert names" mbase mixtral "$fixtures/mixtral.json"
# Loaded and saved again by a step of lr 0 and no decay: the same bytes, under the same names.
mt train --model mbase "${run[@]}" --steps 1 --lr 0 --weight-decay 0 --save-model magain
if [ "$rc" -ne 0 ] || ! grep -q '(mixtral, 2 layers' err.txt out.txt; then bad "train --model (mixtral)" "failed"
elif ! cmp -s mbase/model.safetensors magain/model.safetensors; then
    bad "train --model (mixtral)" "loaded and saved again, model.safetensors differs"
else ok "train --model (mixtral)"; fi
check_dir "mixtral saved again" magain mixtral "$fixtures/mixtral.json"

# --- bench --config: an MoE's step timed from its config.json ------------------------------
mt bench --config "$fixtures/qwen3_moe.json" --micro-batch 2 --seq-len 32 --warmup 1 --steps 2 --clip 1 \
    --ncpu 2 --ncuda 0
if [ "$rc" -ne 0 ]; then bad "bench --config (qwen3_moe)" "failed: $(tail -1 err.txt)"
elif ! grep -qF "| $fixtures/qwen3_moe.json | 1 x 2 x 32 | 2 | 1 |" out.txt; then
    bad "bench --config (qwen3_moe)" "no table row naming the config"
elif ! grep -q "setting up the host state of $fixtures/qwen3_moe.json" err.txt; then
    bad "bench --config (qwen3_moe)" "the log does not name the config"
else ok "bench --config (qwen3_moe)"; fi
mt bench --config "$fixtures/qwen3_moe.json" --shape tiny
if [ "$rc" -ne 2 ] || ! grep -q 'give --config or --shape, not both' err.txt; then
    bad "bench --config with --shape" "not refused as a usage error"
else ok "bench --config with --shape"; fi

# The published configs shipped in models/configs count as their model cards say.
mt plan --config "$root/models/configs/qwen3-30b-a3b.json" --host-memory 2T --ncpu 2 --ncuda 0
if ! grep -qF '30.5B parameters in total, 3.35B active per token (3353032704)' out.txt; then
    bad "plan of models/configs/qwen3-30b-a3b.json" "$(grep 'mixture of experts' out.txt)"
else ok "plan of models/configs/qwen3-30b-a3b.json"; fi
mt plan --config "$root/models/configs/mixtral-8x7b.json" --host-memory 2T --ncpu 2 --ncuda 0
if ! grep -qF '46.7B parameters in total, 12.9B active per token (12879925248)' out.txt; then
    bad "plan of models/configs/mixtral-8x7b.json" "$(grep 'mixture of experts' out.txt)"
else ok "plan of models/configs/mixtral-8x7b.json"; fi

mt plan --config "$root/models/configs/gpt-oss-120b.json" --host-memory 4T --ncpu 2 --ncuda 0
if [ "$rc" -ne 0 ] || ! grep -qF '117B parameters in total, 5.71B active per token (5711982912)' out.txt; then
    bad "plan of models/configs/gpt-oss-120b.json" "$(grep 'mixture of experts' out.txt)"
else ok "plan of models/configs/gpt-oss-120b.json"; fi
# --layers keeps the first layers of layer_types' list, and refuses more than it names
mt plan --config "$root/models/configs/gpt-oss-20b.json" --layers 6 --host-memory 4T --ncpu 2 --ncuda 0
if [ "$rc" -ne 0 ] || ! grep -qF 'gpt-oss-20b.json, 6 layers' out.txt; then
    bad "plan of gpt-oss-20b with --layers 6" "rc $rc: $(tail -1 err.txt)"
else ok "plan of gpt-oss-20b with --layers 6"; fi
mt plan --config "$root/models/configs/gpt-oss-20b.json" --layers 30 --host-memory 4T --ncpu 2 --ncuda 0
if [ "$rc" -eq 0 ] || ! grep -qF -- "--layers 30: the config's layer_types names 24 layers" err.txt; then
    bad "plan of gpt-oss-20b with --layers 30" "not refused: rc $rc, $(tail -1 err.txt)"
else ok "plan of gpt-oss-20b with --layers 30"; fi
# A model that does not fit is refused with the layers that would; plan at that count fits.
mt plan --config "$root/models/configs/gpt-oss-20b.json" --host-memory 125G --dtype bf16 --ncpu 2 --ncuda 0
fit=$(sed -n 's/.*the first \([0-9]*\) of its 24 layers fit .*: --layers \([0-9]*\) plans them.*/\1 \2/p' err.txt)
if [ "$rc" -eq 0 ] || [ -z "$fit" ] || [ "${fit% *}" != "${fit#* }" ]; then
    bad "plan of gpt-oss-20b on 125G" "no --layers advice: rc $rc, $(tail -1 err.txt)"
else
    n=${fit% *}
    mt plan --config "$root/models/configs/gpt-oss-20b.json" --host-memory 125G --dtype bf16 --ncpu 2 --ncuda 0 --layers "$n"
    if [ "$rc" -ne 0 ]; then bad "plan of gpt-oss-20b on 125G" "--layers $n, as advised, does not fit: $(tail -1 err.txt)"
    else
        mt plan --config "$root/models/configs/gpt-oss-20b.json" --host-memory 125G --dtype bf16 --ncpu 2 --ncuda 0 \
            --layers $((n + 1))
        if [ "$rc" -eq 0 ]; then bad "plan of gpt-oss-20b on 125G" "--layers $((n + 1)) fits too: $n is not the most"
        else ok "plan of gpt-oss-20b on 125G advises --layers $n"; fi
    fi
fi
# --- gpt_oss: sinks, sliding and full layers, biased experts with the clamped SwiGLU -------
mt train --config "$fixtures/gpt_oss.json" "${run[@]}" --steps 1 --save-model gbase
if [ "$rc" -ne 0 ] || [ ! -f gbase/model.safetensors ]; then bad "a random gpt_oss directory" "not written: $(tail -1 err.txt)"
else cp "$tokenizer" gbase/ && ok "a random gpt_oss directory"; fi
check_dir "gpt_oss's config and fused expert tensors" gbase gpt_oss "$fixtures/gpt_oss.json"
mt train --model gbase "${run[@]}" --steps 8 --metrics gfull.jsonl --save-model gtuned
if [ "$rc" -ne 0 ] || ! grep -q '(gpt_oss, 2 layers' err.txt out.txt; then bad "train --model (gpt_oss)" "failed: $(tail -1 err.txt)"
elif ! python3 - gfull.jsonl <<'PY'
import json, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]
assert len(loss) == 8, f"{len(loss)} steps in the metrics"
last = sum(loss[-3:]) / 3
assert last < loss[0] - 1.0, f"loss {loss[0]:.4f} -> mean of the last 3 {last:.4f}"
PY
then bad "train --model (gpt_oss)" "the loss does not fall"
else ok "train --model (gpt_oss): the loss falls"; fi
check_dir "gpt_oss saved after training" gtuned gpt_oss "$fixtures/gpt_oss.json"
mt train --model gbase "${run[@]}" --steps 8 --metrics gpart.jsonl --stop-after 4 --checkpoint gck
rc1=$rc
mt train --model gbase "${run[@]}" --steps 8 --metrics gpart.jsonl --resume gck --checkpoint gck --save-model gresumed
if [ "$rc1" -ne 0 ] || [ "$rc" -ne 0 ]; then bad "--resume (gpt_oss)" "a run failed: $(tail -1 err.txt)"
elif [ "$(losses gfull.jsonl)" != "$(losses gpart.jsonl)" ]; then bad "--resume (gpt_oss)" "the losses differ"
elif ! cmp -s gtuned/model.safetensors gresumed/model.safetensors; then bad "--resume (gpt_oss)" "the saved model differs"
else ok "--resume (gpt_oss) bit for bit"; fi
mt eval --model gtuned --data shards --ncpu 2 --ncuda 0
if [ "$rc" -ne 0 ] || ! grep -q '^loss ' out.txt; then bad "eval --model (gpt_oss)" "no loss line"
else ok "eval --model (gpt_oss)"; fi
mt generate --model gtuned --prompt x --max-new-tokens 3 --ncuda 0 --ncpu 2
if [ "$rc" -ne 0 ] || ! grep -q '1 prompt tokens, 3 new' err.txt; then bad "generate --model (gpt_oss)" "no 3 new tokens"
else ok "generate --model (gpt_oss)"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
