#!/bin/sh
# `megatrain plan` against what `megatrain train` holds: for the built-in model and for a model of a
# few hundred MB, a CPU run of 2 steps reports its peak resident set (VmHWM), and plan, given the
# same options, must put its host total within 10% of it (docs/design.md, section 1.2).
# Usage: test_plan_rss.sh MEGATRAIN
set -u
M=${1:?usage: test_plan_rss.sh MEGATRAIN}
# meson test sets MALLOC_PERTURB_, with which glibc writes every block it hands out or takes back:
# pages a run never touches become resident. A user's run has it unset.
unset MALLOC_PERTURB_
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

fail() {
    echo "FAIL: $1: $2"
    failures=$((failures + 1))
}

# "12.34 MiB" (or B, KiB, GiB, TiB) as bytes.
to_bytes() {
    awk -v v="$1" -v u="$2" 'BEGIN { m["B"] = 1; m["KiB"] = 1024; m["MiB"] = 1048576; m["GiB"] = 1073741824;
        m["TiB"] = 1099511627776; if (!(u in m)) exit 1; printf "%.0f\n", v * m[u] }'
}

# check NAME OPTIONS...: trains 2 steps with OPTIONS, plans with OPTIONS, compares.
check() {
    name=$1
    shift
    if ! "$M" train --steps 2 --sample-bytes 0 --eval-every 0 "$@" >"$work/train.out" 2>&1; then
        fail "$name" "train failed: $(tail -3 "$work/train.out")"
        return
    fi
    line=$(grep '^megatrain: peak host memory ' "$work/train.out")
    if [ -z "$line" ]; then fail "$name" "train printed no 'peak host memory' line"; return; fi
    # megatrain: peak host memory 312.45 MiB (plan 300.00 MiB)
    set -- $line "$@"
    peak=$(to_bytes "$5" "$6") || { fail "$name" "unreadable line: $line"; return; }
    train_plan=$(to_bytes "${8#(}" "${9%)}") || { fail "$name" "unreadable line: $line"; return; }
    shift 9
    if ! "$M" plan "$@" >"$work/plan.out" 2>&1; then
        fail "$name" "plan failed: $(tail -3 "$work/plan.out")"
        return
    fi
    # the host layouts' line of the chosen one is the plan's host total (train's "plan" figure)
    total=$(awk '$1 == "total" { print $2; exit }' "$work/plan.out")
    if [ -z "$total" ]; then fail "$name" "plan printed no total row"; return; fi
    awk -v p="$total" -v t="$train_plan" -v r="$peak" -v n="$name" 'BEGIN {
        printf "%s: peak RSS %.1f MiB, plan %.1f MiB (train planned %.1f MiB): %+.1f%%\n", n, r / 1048576,
            p / 1048576, t / 1048576, 100 * (p - r) / r
        # train rounds its figure to 3 digits; plan and train must plan the same run
        if (t < p * 0.99 || t > p * 1.01) { print "FAIL: " n ": plan and train disagree"; exit 1 }
        if (p < r * 0.9 || p > r * 1.1) { print "FAIL: " n ": plan not within 10% of the peak"; exit 1 }
    }' || failures=$((failures + 1))
}

# The data named to both: plan without --data counts none, train reads its default corpus.
data=/usr/share/games/fortunes
check "built-in model, CPU" --ncpu 2 --ncuda 0 --data "$data"

# A Qwen2-like model of 25M parameters (500 MB of fp32 state), its vocabulary large beside its
# width, as a fine-tuning's head is.
cat >"$work/mid.json" <<'EOF'
{"model_type": "qwen2", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 8,
 "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 16384, "max_position_embeddings": 1024,
 "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}
EOF
check "25M-parameter Qwen2-like model, CPU" --config "$work/mid.json" --micro-batch 4 --seq-len 64 --ncpu 2 --ncuda 0 \
    --data "$data"

if [ "$failures" -ne 0 ]; then
    echo "$failures failed"
    exit 1
fi
echo "all passed"
