#!/usr/bin/env python3
"""The PyTorch reference for `megatrain bench`: the same shape, all on the GPU, HF transformers,
bf16 autocast, gradient checkpointing, fused AdamW, clipping at 1.0. Reports medians over the
measured steps in the project's convention: model TFLOP/s = (6 N + 6 L d T) tokens / time, N all
parameters but the embedding table (the LM head counts also when tied; of a mixture of experts the
active parameters only), recompute not counted.
Also times torch's flash SDPA forward+backward at the attention benchmark's shape, and with
--moe-block a mixture of experts' sparse block alone (router, experts, combine; bf16, forward and
backward) at `test_cuda_moe`'s benchmark token counts, beside `MT_CUDA_BENCH=1 test_cuda_moe`.

    python3 tools/torch_bench.py --shape qwen2.5-3b --micro-batch 16 --seq-len 2048
    python3 tools/torch_bench.py --shape qwen2.5-7b --layers 12    # the 7B width, 12 layers
    python3 tools/torch_bench.py --config models/configs/qwen3-30b-a3b.json --layers 8 --accum 2
    python3 tools/torch_bench.py --config models/configs/qwen3-30b-a3b.json --moe-block
"""
import argparse
import json
import statistics
import sys
import time

SHAPES = {  # the published shapes megatrain bench knows (HF config.json values)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def build_config(args, transformers):
    """The shape's Qwen2 config, or an HF config.json's (--config), with --layers applied."""
    if args.config:
        with open(args.config) as f:
            values = json.load(f)
        if args.layers:
            values["num_hidden_layers"] = args.layers
            values.pop("layer_types", None)  # sized by the layer count; derived again
        # fp32 parameters, gradients and moments, as megatrain's masters: with a published config's
        # bf16 dtype, from_config would build a bf16 model and this would time pure bf16 training
        values.pop("torch_dtype", None)
        values.pop("dtype", None)
        values["max_position_embeddings"] = max(values.get("max_position_embeddings", 0), args.seq_len)
        values["use_cache"] = False
        cfg = transformers.AutoConfig.for_model(**values)
        cfg._attn_implementation = "sdpa"
        if args.experts:
            cfg._experts_implementation = args.experts
        return cfg
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return transformers.Qwen2Config(**shape, rope_theta=1e6, rms_norm_eps=1e-6,
                                    max_position_embeddings=max(32768, args.seq_len), attn_implementation="sdpa")


def flops_params(model, cfg):
    """N of the convention: every parameter but the embedding table (the head counts when tied);
    of a mixture of experts, the parameters one token uses (its top-k experts of each sparse
    layer), as megatrain's mt_config_flops_params counts them."""
    n = sum(p.numel() for p in model.parameters())
    V, d = cfg.vocab_size, cfg.hidden_size
    if not cfg.tie_word_embeddings:
        n -= V * d
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        k = cfg.num_experts_per_tok
        width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        skip = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        sparse = sum(1 for i in range(cfg.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
        n -= sparse * (experts - k) * 3 * width * d
    return n


def model_bench(args, torch, transformers):
    cfg = build_config(args, transformers)
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised in place: a CPU init of billions of parameters takes minutes
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # no sdpa for this model (GptOss: its sinks): transformers' eager attention
            cfg._attn_implementation = "eager"
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    experts_impl = getattr(model.config, "_experts_implementation", None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    B, T, A = args.micro_batch, args.seq_len, args.accum
    xs = [torch.randint(0, cfg.vocab_size, (B, T), device="cuda") for _ in range(A)]
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in xs:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            (loss / A).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    n = flops_params(model, cfg)
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    step = statistics.median(times)
    tokens = A * B * T
    tflops = (6 * n + 6 * L * d * T) * tokens / step / 1e12
    peak = torch.cuda.max_memory_allocated() / 2**30
    name = (args.config or args.shape) + (f" ({L} layers)" if args.layers else "")
    extra = f" | params {str(next(model.parameters()).dtype).replace('torch.', '')}"
    extra += f" | attention {model.config._attn_implementation}"
    extra += f" | experts {experts_impl}" if experts_impl else ""
    print(f"| torch {name} | {A} x {B} x {T} | step {step:.3f} s | {tokens / step:.0f} tok/s | "
          f"{tflops:.1f} model TFLOP/s | peak GPU {peak:.1f} GiB | loss {loss.item():.4f}{extra} |")


def moe_block_bench(args, torch, transformers):
    """The first layer's sparse block of --config in bf16, forward then backward, medians (and the
    best) of 10 after 3, at 8,192 and 32,768 tokens of N(0, 1.7) hidden states; model TFLOP/s as
    test_cuda_moe's: 6 x (the router's E d + the k experts' 3 Ie d) per token."""
    args.layers = 1
    cfg = build_config(args, transformers)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    block = model.model.layers[0].mlp.to(torch.bfloat16)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        sys.exit("torch_bench: --moe-block needs a mixture of experts' config")
    k, d = cfg.num_experts_per_tok, cfg.hidden_size
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    active = experts * d + k * 3 * width * d
    impl = getattr(model.config, "_experts_implementation", None)
    for n in (8192, 32768):
        x = (torch.randn(1, n, d, device="cuda") * 1.7).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(1, n, d, device="cuda", dtype=torch.bfloat16)
        fwd, bwd = [], []
        for i in range(13):
            for p in block.parameters():
                p.grad = None
            x.grad = None
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            out = block(x)
            y = out[0] if isinstance(out, tuple) else out
            e[1].record()
            y.backward(dy)
            e[2].record()
            torch.cuda.synchronize()
            if i >= 3:
                fwd.append(e[0].elapsed_time(e[1]))
                bwd.append(e[1].elapsed_time(e[2]))
        tf, tb = statistics.median(fwd), statistics.median(bwd)
        best = min(f + b for f, b in zip(fwd, bwd))  # test_cuda_moe prints its best
        print(f"| torch MoE block {args.config} | {n} tokens | forward {tf:.2f} ms | backward {tb:.2f} ms | "
              f"{6 * n * active / ((tf + tb) * 1e9):.1f} model TFLOP/s (best {best:.2f} ms, "
              f"{6 * n * active / (best * 1e9):.1f}) | experts {impl} |")


def attention_bench(torch):
    B, T, H, KV, D = 8, 2048, 16, 2, 128
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.nn.functional.scaled_dot_product_attention
    fwd, bwd = [], []
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = f(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    flops = 4 * B * H * T * T * D / 2
    tf, tb = statistics.median(fwd), statistics.median(bwd)
    print(f"| torch sdpa B={B} T={T} H={H} KV={KV} D={D} | forward {tf * 1e3:.2f} ms {flops / tf / 1e12:.0f} TFLOP/s | "
          f"backward {tb * 1e3:.2f} ms {2.5 * flops / tb / 1e12:.0f} TFLOP/s |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-3b", choices=sorted(SHAPES))
    ap.add_argument("--config", help="an HF config.json instead of --shape (e.g. models/configs/qwen3-30b-a3b.json)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step, gradients accumulated")
    ap.add_argument("--experts", help="transformers' experts implementation of an MoE (eager, grouped_mm, ...; "
                    "default: transformers' own choice)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's own)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--moe-block", action="store_true",
                    help="time --config's sparse block alone (router, experts, combine), not a training step")
    args = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"torch_bench: {e}: needs torch and transformers (the GPU machine has both)")
    if not torch.cuda.is_available():
        sys.exit("torch_bench: no CUDA device")
    if args.moe_block:
        moe_block_bench(args, torch, transformers)
        return
    attention_bench(torch)
    if not args.attention_only:
        model_bench(args, torch, transformers)


if __name__ == "__main__":
    main()
