#!/usr/bin/env python3
"""The expected rope frequencies of tests/test_rope.c: transformers' rope functions
(src/transformers/modeling_rope_utils.py, transformers 5) written out in plain Python floats
(double precision, where transformers computes in fp32), for the configs the test names.
Needs Python 3 only (no torch):

    python3 tools/rope_reference.py

prints, per config, the attention factor and inv_freq at the listed pairs j, as C initialisers
to paste into tests/test_rope.c.
"""
import math


def default_inv_freq(base, dim):
    # _compute_default_rope_parameters: 1 / base^(arange(0, dim, 2) / dim)
    return [1.0 / (base ** (j / dim)) for j in range(0, dim, 2)]


def linear(c, seq_len):
    # _compute_linear_scaling_rope_parameters: the default frequencies / factor
    return [f / c["factor"] for f in default_inv_freq(c["rope_theta"], c["head_dim"])], 1.0


def dynamic(c, seq_len):
    # _compute_dynamic_ntk_parameters: seq_len = max(seq_len, max_position_embeddings)
    dim, max_pos, factor = c["head_dim"], c["max_position_embeddings"], c["factor"]
    seq_len = max(seq_len, max_pos)
    base = c["rope_theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim), 1.0


def yarn(c, seq_len):
    # _compute_yarn_parameters
    base, dim = c["rope_theta"], c["head_dim"]
    factor = c.get("factor")
    attention_factor = c.get("attention_factor")
    mscale, mscale_all_dim = c.get("mscale"), c.get("mscale_all_dim")
    original = c["original_max_position_embeddings"]
    if factor is None:
        factor = c["max_position_embeddings"] / original

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = c.get("beta_fast") or 32
    beta_slow = c.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001
        return [min_max_clamp((j - min) / (max - min)) for j in range(dim)]

    def min_max_clamp(x):
        return 0.0 if x < 0 else 1.0 if x > 1 else x

    pos_freqs = [base ** (j / dim) for j in range(0, dim, 2)]
    extrapolation = [1.0 / p for p in pos_freqs]
    interpolation = [1.0 / (factor * p) for p in pos_freqs]
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original, c.get("truncate", True))
    extrapolation_factor = [1 - r for r in linear_ramp_factor(low, high, dim // 2)]
    inv_freq = [i * (1 - e) + x * e for i, x, e in zip(interpolation, extrapolation, extrapolation_factor)]
    return inv_freq, attention_factor, (low, high)


# (name, rope function, config, sequence length, pairs j to print)
CASES = [
    # Vicuna-7B-v1.5-16k's scaling: Llama 2 (theta 1e4, head_dim 128), linear factor 4 over 4096
    ("linear", linear, dict(rope_theta=10000.0, head_dim=128, factor=4.0, max_position_embeddings=4096),
     16384, [0, 1, 17, 63]),
    # Qwen2.5-3B (theta 1e6, head_dim 128, 32768 positions) with dynamic factor 4, at 131072 tokens,
    # at 65536, and at 16384 (within max_position_embeddings: the model's own base)
    ("dynamic 131072", dynamic, dict(rope_theta=1e6, head_dim=128, factor=4.0, max_position_embeddings=32768),
     131072, [0, 1, 32, 63]),
    ("dynamic 65536", dynamic, dict(rope_theta=1e6, head_dim=128, factor=4.0, max_position_embeddings=32768),
     65536, [0, 1, 32, 63]),
    ("dynamic 16384", dynamic, dict(rope_theta=1e6, head_dim=128, factor=4.0, max_position_embeddings=32768),
     16384, [0, 1, 32, 63]),
    # Qwen2.5-3B with the yarn block of Qwen's long-context instructions: factor 4 over 32768
    ("yarn qwen2.5", yarn, dict(rope_theta=1e6, head_dim=128, factor=4.0, original_max_position_embeddings=32768,
                                max_position_embeddings=32768), 131072, [0, 22, 23, 24, 30, 39, 40, 63]),
    # gpt-oss-20b's block: theta 150000, head_dim 64, factor 32 over 4096, truncate false
    ("yarn gpt-oss", yarn, dict(rope_theta=150000.0, head_dim=64, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                original_max_position_embeddings=4096, max_position_embeddings=131072,
                                truncate=False), 131072, [0, 8, 9, 12, 17, 18, 31]),
    # DeepSeek-V2-style mscales (1.0 over 0.707), theta 1e4, head_dim 64, factor 40 over 4096
    ("yarn mscale", yarn, dict(rope_theta=10000.0, head_dim=64, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                               original_max_position_embeddings=4096, max_position_embeddings=163840),
     163840, [0, 10, 11, 20, 23, 24, 31]),
    # an explicit attention_factor, beta_fast 16, beta_slow 2, factor 8 over 2048, theta 5e5, head_dim 96
    ("yarn attention_factor", yarn, dict(rope_theta=500000.0, head_dim=96, factor=8.0, beta_fast=16.0,
                                         beta_slow=2.0, attention_factor=0.875,
                                         original_max_position_embeddings=2048, max_position_embeddings=16384),
     16384, [0, 10, 11, 12, 16, 19, 20, 47]),
]


def main():
    for name, fn, c, seq_len, pairs in CASES:
        out = fn(c, seq_len)
        inv_freq, attention = out[0], out[1]
        ramp = f", ramp dims [{out[2][0]}, {out[2][1]}]" if len(out) > 2 else ""
        print(f"/* {name}: {c}, seq_len {seq_len}{ramp} */")
        print(f"attention_factor {attention!r}")
        print("{" + ", ".join(f"{{{j}, {inv_freq[j]!r}}}" for j in pairs) + "}")


if __name__ == "__main__":
    main()
