#!/usr/bin/env bash
# `megatrain plan`'s GPU side and its K: a GPU plan refused with its need by kind against a small
# --gpu-memory and fitting a large one; --checkpoint-every auto's K fits and K+1 does not (unless
# K is every layer), for plan and train alike; bench refusing before StarPU starts;
# --offload-checkpoints' figures, auto's choice and its refusals; plan without --data on a machine
# without train's default corpus (hidden in a mount namespace).
# Usage: test_plan_gpu.sh PATH/TO/megatrain
set -u
. "$(dirname "$0")/script_harness.sh" plan-gpu "$@"

# expect_ok NAME PATTERN ARGS...: exit 0, stdout matching PATTERN (grep -E)
expect_ok() {
    local name=$1 pattern=$2
    shift 2
    "$megatrain" "$@" >out.txt 2>err.txt
    rc=$?
    if [ "$rc" -ne 0 ]; then bad "$name" "expected exit status 0"
    elif ! grep -qE -- "$pattern" out.txt; then bad "$name" "stdout does not match '$pattern'"
    else ok "$name"; fi
}

# expect_error NAME PATTERN ARGS...: exit 1 or 2 (not a signal), stderr matching PATTERN
expect_error() {
    local name=$1 pattern=$2
    shift 2
    "$megatrain" "$@" >out.txt 2>err.txt
    rc=$?
    if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ]; then bad "$name" "expected a refusal (exit 1 or 2)"
    elif ! grep -qE -- "$pattern" err.txt; then bad "$name" "stderr does not match '$pattern'"
    else ok "$name"; fi
}

# A 7B GPU run of 32 x 2048 tokens, the host side ample so that the GPU side decides.
seven=(plan --shape qwen2.5-7b --micro-batch 32 --seq-len 2048 --ncuda 1 --host-memory 2T)

# --- the GPU side decides ---------------------------------------------------------------------
expect_error "7B, 32 x 2048 in 24 GiB: refused with the need by kind" \
    'not enough GPU memory: the plan needs [0-9]+ bytes .*the GPU has 25769803776 bytes.*weights and gradients in flight .*checkpoints .*block activations .*workspaces and inputs .*CUDA context' \
    "${seven[@]}" --gpu-memory 24G
expect_ok "7B, 32 x 2048 in 1 TiB: fits, the GPU's line" '^GPU: needs [0-9]+ bytes .* within the 1\.00 TiB of the GPU \(--gpu-memory\)$' \
    "${seven[@]}" --gpu-memory 1T
grep -qE '^fits: .*; GPU plan .* within 1\.00 TiB$' out.txt && ok "the fits line names the GPU" ||
    bad "the fits line names the GPU" "no '; GPU plan X within 1.00 TiB' on the fits line"
expect_error "--gpu-memory takes --host-memory's sizes" "--gpu-memory.*'12Q'" "${seven[@]}" --gpu-memory 12Q
# without --gpu-memory: the device's size, or without one the need shown and not checked
expect_ok "without --gpu-memory: the device's, or not checked" \
    '^GPU: needs .*(not checked: no CUDA device here|of the GPU \(device 0\))' "${seven[@]}"
expect_ok "a CPU plan has no GPU side" '^fits: host plan within 90% of [0-9.]+ TiB available \([a-z]+ host layout\)$' \
    plan --shape qwen2.5-0.5b --micro-batch 2 --seq-len 512 --ncuda 0 --host-memory 2T --gpu-memory 1K

# --- --checkpoint-every auto ----------------------------------------------------------------
# plan_fits ARGS...: 0 when plan with ARGS fits, 1 when it is refused for memory
plan_fits() {
    "$megatrain" "$@" >fit.txt 2>fit.err && return 0
    grep -qE 'not enough (GPU|host) memory' fit.err && return 1
    echo "unexpected failure: $(cat fit.err)" >&2
    return 2
}

# check_auto NAME ARGS...: auto's K printed, the same plan with that K fits, with K+1 it does not
# (unless K is every layer); the layers read from the model line.
check_auto() {
    local name=$1
    shift
    expect_ok "$name: auto chooses" '^checkpoint interval: K=[0-9]+ \(--checkpoint-every auto\)' "$@" --checkpoint-every auto
    [ "$rc" -eq 0 ] || return
    local K L
    K=$(sed -nE 's/^checkpoint interval: K=([0-9]+) .*/\1/p' out.txt)
    L=$(sed -nE 's/^model: .*, ([0-9]+) layers, .*/\1/p' out.txt)
    plan_fits "$@" --checkpoint-every "$K"
    [ $? -eq 0 ] && ok "$name: K=$K fits" || bad "$name: K=$K fits" "plan --checkpoint-every $K was refused"
    if [ "$K" -lt "$L" ]; then
        plan_fits "$@" --checkpoint-every $((K + 1))
        [ $? -eq 1 ] && ok "$name: K=$((K + 1)) does not" || bad "$name: K=$((K + 1)) does not" "it was not refused for memory"
    else
        ok "$name: K=$K is every layer ($L)"
    fi
}

# (the MLP unchunked: chunks would let a larger K fit)
check_auto "7B, 32 x 2048 on 141 GB" "${seven[@]}" --gpu-memory 141GB --mlp-chunk 0
check_auto "0.5B, 16 x 4096 on 30 GiB" plan --shape qwen2.5-0.5b --micro-batch 16 --seq-len 4096 --ncuda 1 --host-memory 2T \
    --gpu-memory 30G --mlp-chunk 0
check_auto "0.5B, 2 x 512 on 80 GiB: every layer" plan --shape qwen2.5-0.5b --micro-batch 2 --seq-len 512 --ncuda 1 \
    --host-memory 2T --gpu-memory 80G --mlp-chunk 0
expect_ok "an explicit K is kept" '^  B=32 x T=2048 x accumulation 1 = 65536 tokens/step, K=3 ' "${seven[@]}" --gpu-memory 141GB \
    --checkpoint-every 3
expect_error "auto where no K fits: refused, saying so" 'no K from 1 to 28 fits.*not enough GPU memory' "${seven[@]}" \
    --gpu-memory 16G --checkpoint-every auto
expect_error "--checkpoint-every takes a number or auto" 'number of layers or auto' "${seven[@]}" --checkpoint-every most

# train and bench: the same option, the same refusal before any long work
expect_error "bench refuses a GPU plan over --gpu-memory before StarPU starts" 'not enough GPU memory' \
    bench --shape qwen2.5-0.5b --micro-batch 4 --seq-len 1024 --gpu-memory 1G --steps 1 --warmup 0
expect_error "bench --checkpoint-every auto stands alone" 'auto stands alone' bench --shape tiny --checkpoint-every 2,auto
expect_ok "train --checkpoint-every auto on the CPU: the choice in the log" \
    '^megatrain: checkpoint interval K=[0-9]+ \(--checkpoint-every auto\)' \
    train --steps 1 --sample-bytes 0 --eval-every 0 --ncpu 2 --ncuda 0 --micro-batch 2 --seq-len 64 --checkpoint-every auto
grep -qE '^megatrain: 1 step of 1 x 2 x 64 tokens, K=6,' out.txt && ok "train ran at auto's K (the built-in model's 6 layers)" ||
    bad "train ran at auto's K (the built-in model's 6 layers)" "no 'K=6' on the run line"

# --- --offload-checkpoints ---------------------------------------------------------------------
# 3B at one 131072-token sequence, K=2: 18 GiB of checkpoints on the GPU, or 3 GiB in flight
# with the other 17 GiB in pinned host memory; 48 GiB holds only the second.
long=(plan --shape qwen2.5-3b --micro-batch 1 --seq-len 131072 --rope-scaling yarn:4 --ncuda 1 --host-memory 2T
      --checkpoint-every 2 --mlp-chunk 0)
expect_error "offload off, 3B at 131072 tokens in 48 GiB: refused, offering the offload" \
    'checkpoints 18\.00 GiB \(18 per micro-batch at K=2, 1 micro-batch, all on the GPU\).*--offload-checkpoints on' \
    "${long[@]}" --gpu-memory 48G --offload-checkpoints off
expect_ok "offload on: fits, the plan names it" \
    '^  checkpoints offloaded: 17 in pinned host memory, 3 on the GPU at once' "${long[@]}" --gpu-memory 48G \
    --offload-checkpoints on
grep -qE '^  checkpoints +18253611008 +17\.00 GiB yes +3221225472 +3\.00 GiB$' out.txt && ok "offload on: 17 GiB pinned, 3 GiB on the GPU" ||
    bad "offload on: 17 GiB pinned, 3 GiB on the GPU" "no such checkpoints row"
expect_ok "offload auto in 48 GiB: on, saying why" \
    '^checkpoints: offloaded to pinned host memory \(--offload-checkpoints auto: the plan with every checkpoint on the GPU does not fit, with them offloaded it does\)' \
    "${long[@]}" --gpu-memory 48G
expect_ok "offload auto in 141 GB: off" '^checkpoints: kept where they are written \(--offload-checkpoints auto: the plan with every checkpoint on the GPU fits\)$' \
    "${long[@]}" --gpu-memory 141GB
expect_ok "offload auto with auto's K in 48 GiB: a K" '^checkpoint interval: K=[0-9]+ \(--checkpoint-every auto\)' \
    "${long[@]}" --gpu-memory 48G --checkpoint-every auto
grep -q '^checkpoints: offloaded' out.txt && ok "auto's K with the offload" || bad "auto's K with the offload" "no 'checkpoints: offloaded' line"
expect_error "--offload-checkpoints takes auto, on or off" "--offload-checkpoints: 'sometimes' is not auto, on or off" \
    "${long[@]}" --offload-checkpoints sometimes
expect_error "bench --offload-checkpoints 1" "--offload-checkpoints: '1' is not auto, on or off" \
    bench --shape tiny --offload-checkpoints 1
expect_ok "train --offload-checkpoints on on the CPU" '^done: 2 steps' \
    train --steps 2 --sample-bytes 0 --eval-every 0 --ncpu 2 --ncuda 0 --micro-batch 2 --seq-len 64 --checkpoint-every 2 \
    --offload-checkpoints on

# --- --mlp-chunk -------------------------------------------------------------------------------
# 3B at one 524288-token sequence on an H200's 140 GiB and 125 GiB of host memory, train's
# defaults: K=2 does not fit the host (its offloaded checkpoints), so the default gives way to the
# next K that fits; with the offload and the MLP chunks auto the plan fits, the GPU at most 120
# GiB; unchunked it does not, and K=2 asked for is refused.
huge=(plan --shape qwen2.5-3b --micro-batch 1 --seq-len 524288 --rope-scaling yarn:16 --ncuda 1 --gpu-memory 140G
      --host-memory 125G)
expect_ok "3B at 524288 tokens: the default plan chunks the MLP" \
    '^MLP: the dense MLP [0-9]+ tokens at a time \(--mlp-chunk auto: the largest chunk whose plan fits; unchunked it does not\)$' \
    "${huge[@]}"
if grep -qE '^checkpoint interval: K=[3-9][0-9]*, the smallest K above the default whose plan fits the host and the GPU \(the default K=2 does not fit the host\)$' out.txt
then ok "3B at 524288 tokens: the default K gives way"
else bad "3B at 524288 tokens: the default K gives way" "$(grep '^checkpoint interval' out.txt || echo 'no checkpoint interval line')"; fi
gib=$(sed -nE 's/^GPU: needs [0-9]+ bytes \(([0-9.]+) GiB.*within the 140.00 GiB.*/\1/p' out.txt)
if [ -n "$gib" ] && awk -v g="$gib" 'BEGIN { exit !(g <= 120) }'; then ok "3B at 524288 tokens: the GPU needs $gib GiB (<= 120)"
else bad "3B at 524288 tokens: the GPU at most 120 GiB" "needs '${gib:-?}' GiB"; fi
expect_error "3B at 524288 tokens, --checkpoint-every 2 asked: refused" 'not enough host memory' "${huge[@]}" \
    --checkpoint-every 2
expect_error "3B at 524288 tokens, --mlp-chunk 0: refused" 'not enough (GPU|host) memory' "${huge[@]}" --mlp-chunk 0
expect_ok "plan --mlp-chunk 4096: said" '^MLP: the dense MLP 4096 tokens at a time \(--mlp-chunk\)$' "${huge[@]}" \
    --mlp-chunk 4096
expect_error "--mlp-chunk takes a number or auto" 'number of tokens \(0: all at once\) or auto' "${huge[@]}" --mlp-chunk most

# --- plan without --data ----------------------------------------------------------------------
default=/usr/share/games/fortunes
shape=(plan --shape qwen2.5-7b --micro-batch 32 --seq-len 2048 --host-memory 2T)
expect_ok "no --data: no data counted" '^run: .*, no data counted \(no --data\)$' "${shape[@]}"
# the default corpus hidden: an empty tmpfs over its directory, in a user and mount namespace
if unshare -rm sh -c "mount -t tmpfs none ${default%/*}" 2>/dev/null; then
    unshare -rm sh -c "mount -t tmpfs none ${default%/*} && exec \"\$0\" \"\$@\"" "$megatrain" "${shape[@]}" >out.txt 2>err.txt
    rc=$?
    if [ "$rc" -eq 0 ] && grep -q '^fits: ' out.txt; then ok "no --data, and no $default: plans"
    else bad "no --data, and no $default: plans" "expected exit status 0 and a fits line"; fi
    unshare -rm sh -c "mount -t tmpfs none ${default%/*} && exec \"\$0\" \"\$@\"" "$megatrain" "${shape[@]}" --data "$default" \
        >out.txt 2>err.txt
    rc=$?
    if [ "$rc" -eq 1 ] && grep -q "$default: No such file or directory" err.txt; then ok "an explicit --data missing: named"
    else bad "an explicit --data missing: named" "expected exit status 1 naming $default"; fi
else
    echo "skip the hidden default corpus: no user and mount namespace here (unshare -rm)"
fi
expect_error "an explicit --data that does not exist" "$work/none: No such file or directory" "${shape[@]}" --data "$work/none"

# Several GPUs in one process: each past the first writes its own copy of the gradients, with no
# host home, summed on the GPUs into device 0's; a summing GPU has room for two copies on their
# way in (two gradients' worth, as the double-buffered gradients); the compact layout too; no clip
# speculation's flags.
two=(plan --shape qwen2.5-0.5b --micro-batch 4 --seq-len 1024 --host-memory 2T --gpu-memory 80G)
"$megatrain" "${two[@]}" --ncuda 1 >one_gpu.txt 2>&1
"$megatrain" "${two[@]}" --ncuda 2 >two_gpus.txt 2>&1
# the host ($2 = 1) or GPU ($2 = 2) bytes of the row named $3 in plan output $1: its first number,
# or the third field from the end (the pinned column may be empty)
col() { awk -v name="  $3 " -v c="$2" 'index($0, name) == 1 { $0 = substr($0, length(name) + 1); print c == 1 ? $1 : $(NF - 2) }' "$1"; }
g1=$(col one_gpu.txt 2 'gradients (fp32)') dh=$(col two_gpus.txt 1 "other devices' gradients (fp32)")
dg=$(col two_gpus.txt 2 "other devices' gradients (fp32)")
if [ -z "$g1" ] || [ "$dh" != 0 ] || [ "$dg" != "$g1" ] || grep -q "other devices" one_gpu.txt ||
   grep -q "clip speculation flags" two_gpus.txt ||
   ! grep -q "^  over 2 devices: micro-batch u on device u mod 2, .* summed on the GPUs into device 0's" two_gpus.txt; then
    bad "2 GPUs: device 0's room for the copies" "GPU gradients $g1, other devices' host $dh GPU $dg"
else ok "2 GPUs: device 0's room for the copies"; fi
"$megatrain" "${two[@]}" --ncuda 2 --host-layout compact >two_compact.txt 2>&1
rc=$? dc=$(col two_compact.txt 2 "other devices' gradients (fp32)")
if [ "$rc" -eq 0 ] && grep -q "compact host layout" two_compact.txt && [ "$dc" = "$g1" ] &&
   grep -q "^host layout: compact (--host-layout compact)" two_compact.txt; then ok "2 GPUs: the compact layout plans"
else bad "2 GPUs: the compact layout plans" "exit $rc, other devices' GPU $dc"; fi
# Over 2 GPUs in the full layout a device's gradient copies live as the compact layout's
# accumulators: counted on the GPU as those, as the compact plan of one GPU counts them.
"$megatrain" "${two[@]}" --ncuda 1 --host-layout compact >one_compact.txt 2>&1
"$megatrain" "${two[@]}" --ncuda 2 --host-layout full >two_full.txt 2>&1
af=$(col two_full.txt 2 'gradient accumulators (fp32)') ac=$(col one_compact.txt 2 'gradient accumulators (fp32)')
if [ -n "$ac" ] && [ "$ac" != 0 ] && [ "$af" = "$ac" ] && ! grep -q "gradient accumulators" one_gpu.txt; then
    ok "2 GPUs, full layout: the copies counted as accumulators"
else bad "2 GPUs, full layout: the copies counted as accumulators" "two GPUs full $af, one GPU compact $ac"; fi
# A GPU holds its own micro-batches' checkpoints and hidden states: 2 GPUs over 4 micro-batches,
# each GPU's, are one GPU's over 2; the host holds every micro-batch's (dh0's pinned homes).
"$megatrain" "${two[@]}" --ncuda 2 --accum 4 >two_accum4.txt 2>&1
"$megatrain" "${two[@]}" --ncuda 1 --accum 2 >one_accum2.txt 2>&1
"$megatrain" "${two[@]}" --ncuda 1 --accum 4 >one_accum4.txt 2>&1
c2=$(col two_accum4.txt 2 checkpoints) c1=$(col one_accum2.txt 2 checkpoints)
a2=$(col two_accum4.txt 2 'activations + gradients') a1=$(col one_accum2.txt 2 'activations + gradients')
h2=$(col two_accum4.txt 1 'activations + gradients') h1=$(col one_accum4.txt 1 'activations + gradients')
if [ -n "$c1" ] && [ "$c1" != 0 ] && [ "$c2" = "$c1" ] && [ -n "$a1" ] && [ "$a2" = "$a1" ] && [ -n "$h1" ] && [ "$h2" = "$h1" ]; then
    ok "2 GPUs: each GPU its own micro-batches' activations"
else bad "2 GPUs: each GPU its own micro-batches' activations" "checkpoints $c2 vs $c1, activations $a2 vs $a1, host $h2 vs $h1"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
