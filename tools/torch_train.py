#!/usr/bin/env python3
"""A plain PyTorch training loop with megatrain train's semantics, for comparing whole runs.

Same model (an HF directory, loaded as transformers does), same data (a `megatrain prepare`
directory, windows in order: `megatrain train --data-order sequential`), same step (micro-batches
of B windows of T tokens, gradients summed over `--accum` micro-batches and the loss averaged over
every counted target of the step), same AdamW (torch.optim.AdamW, fused on a GPU; weight decay on
matrices only, as HF Trainer and megatrain do), same schedule (linear warm-up, then cosine to
lr * min-lr-ratio; or constant), same global-norm clipping. bf16 autocast on a GPU (`--dtype bf16`,
the default there), fp32 otherwise. Prints one line a step and writes one JSON line a step to
`--out` ({"step", "loss", "grad_norm", "lr"}), the same fields `megatrain train --metrics` writes.

    python3 tools/torch_train.py --model DIR --data PREPARED --steps 100 --micro-batch 4 \\
        --lr 1e-4 --warmup 10 --out torch.jsonl

`--make-model SHAPE` instead writes a randomly initialised model of a published shape (those of
tools/torch_bench.py, transformers' own initialisation, seeded) to --model DIR and exits: the
common starting point of a comparison; with `--dtype bf16` its weights are saved in bf16, as
published checkpoints are (built on the GPU when there is one: a 7B model initialises in seconds).

`--eval N` instead prints the model's loss on the first N validation windows of --data (the sum
over counted targets over their count, bf16 autocast on a GPU, fp32 otherwise), the figure
`megatrain eval --max-sequences N` prints for the same directory, and exits.
"""
import argparse
import json
import math
import os
import struct
import sys


def read_split(data_dir, split):
    """(tokens, mask) int32 / uint8 arrays of shape (N, T + 1) for every shard of the split, in order."""
    import numpy as np
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    toks, masks = [], []
    for name in meta[split]["shards"]:
        path = os.path.join(data_dir, name)
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:8] != b"MTSHARDS":
                sys.exit(f"torch_train: {path}: not a megatrain shard (bad magic)")
            seq_len, n = struct.unpack_from("<QQ", head, 16)
            body = np.frombuffer(f.read(), dtype=np.uint8)
        w = seq_len + 1
        toks.append(body[: 4 * n * w].view("<i4").reshape(n, w))
        masks.append(body[4 * n * w: 4 * n * w + n * w].reshape(n, w))
    return np.concatenate(toks), np.concatenate(masks), meta["seq_len"]


def lr_at(args, s):
    """megatrain's schedule (runtime/train.c, mt_lr_at) at 1-based step s."""
    if args.warmup > 0 and s <= args.warmup:
        return args.lr * s / args.warmup
    if args.schedule == "constant":
        return args.lr
    span = args.steps - args.warmup
    prog = min((s - args.warmup) / span, 1.0) if span > 0 else 1.0
    low = args.lr * args.min_lr_ratio
    return low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * prog))


def evaluate(args, device, dtype):
    import numpy as np
    import torch
    import transformers
    tokens, mask, T = read_split(args.data, "val")
    n = min(args.eval, tokens.shape[0])
    if n < 1:
        sys.exit(f"torch_train: {args.data} has no validation windows")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    model.eval()
    total, counted = 0.0, 0
    with torch.no_grad():
        for i in range(n):
            w = torch.from_numpy(tokens[i:i + 1].astype(np.int64)).to(device)
            m = torch.from_numpy(mask[i:i + 1].astype(bool)).to(device)
            y = torch.where(m[:, 1:], w[:, 1:], torch.full_like(w[:, 1:], -100))
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = model(input_ids=w[:, :T]).logits
            total += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                                             ignore_index=-100, reduction="sum"))
            counted += int((y != -100).sum())
    loss = total / max(counted, 1)
    print(f"torch_train: {args.model}: loss {loss:.6f} on {n} validation windows ({counted} targets), "
          f"perplexity {math.exp(loss):.3f}, {dtype}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (config.json and safetensors)")
    ap.add_argument("--data", help="a `megatrain prepare` directory (required unless --make-model)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: none)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on a GPU, else fp32")
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (large models)")
    ap.add_argument("--out", help="one JSON line a step")
    ap.add_argument("--make-model", metavar="SHAPE", help="write a random model of SHAPE to --model and exit")
    ap.add_argument("--seed", type=int, default=0, help="--make-model's initialisation seed")
    ap.add_argument("--eval", type=int, metavar="N", help="print the loss on the first N validation windows and exit")
    args = ap.parse_args()
    try:
        import numpy as np
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"torch_train: {e}: needs numpy, torch and transformers")

    if args.make_model:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from torch_bench import SHAPES
        if args.make_model not in SHAPES:
            sys.exit(f"torch_train: --make-model: unknown shape '{args.make_model}' ({', '.join(sorted(SHAPES))})")
        cfg = transformers.Qwen2Config(**SHAPES[args.make_model], rope_theta=1e6, rms_norm_eps=1e-6,
                                       max_position_embeddings=32768)
        torch.manual_seed(args.seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.Qwen2ForCausalLM(cfg)
        if args.dtype == "bf16":
            model = model.to(torch.bfloat16)
        model.save_pretrained(args.model, safe_serialization=True)
        print(f"torch_train: a random {args.make_model} model ({args.dtype or 'fp32'}) in {args.model}")
        return
    if not args.data:
        sys.exit("torch_train: --data DIR is required (a `megatrain prepare` directory)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    if args.eval is not None:
        evaluate(args, device, dtype)
        return
    tokens, mask, T = read_split(args.data, "train")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                            fused=device == "cuda")
    out = open(args.out, "w") if args.out else None
    B, M, N = args.micro_batch, args.accum, tokens.shape[0]
    for s in range(1, args.steps + 1):
        first = (s - 1) * B * M
        idx = [(first + i) % N for i in range(B * M)]
        w = torch.from_numpy(tokens[idx].astype(np.int64)).to(device)
        m = torch.from_numpy(mask[idx].astype(bool)).to(device)
        x, y = w[:, :T], torch.where(m[:, 1:], w[:, 1:], torch.full_like(w[:, 1:], -100))
        counted = int((y != -100).sum())
        for g in opt.param_groups:
            g["lr"] = lr_at(args, s)
        total = 0.0
        for u in range(M):
            xs, ys = x[u * B:(u + 1) * B], y[u * B:(u + 1) * B]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = model(input_ids=xs).logits
            # the step's loss: the sum over its counted targets over their count, as megatrain's
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ys.flatten(), ignore_index=-100,
                                                     reduction="sum") / max(counted, 1)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": s, "loss": total, "grad_norm": float(norm), "lr": lr_at(args, s)}
        print(f"step {s:5d}/{args.steps} | loss {total:.4f} | grad-norm {float(norm):7.3f} | lr {rec['lr']:.2e}",
              flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    if out:
        out.close()


if __name__ == "__main__":
    main()
