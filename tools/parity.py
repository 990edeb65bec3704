#!/usr/bin/env python3
"""Parity with transformers: the same batch through HF transformers (fp32, on CPU or GPU) and
through megatrain (`megatrain grads`), loss and every parameter gradient compared per tensor as
||ours - ref|| / ||ref||. Runs where torch and transformers are installed (the GPU machine).

    python3 tools/parity.py --model DIR --megatrain build-gpu/tools/megatrain [--ncuda 0|1]
        [--batch 2] [--seq-len 64] [--tol 1e-5]

With --ncuda 0 megatrain runs its fp32 CPU path (bound 1e-5); with --ncuda 1 its bf16 GPU path
(bound 1e-2). Exits 1 when a tensor is over the bound.
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory (config.json + safetensors)")
    ap.add_argument("--megatrain", default="build/tools/megatrain")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--ncuda", type=int, default=0)
    ap.add_argument("--tol", type=float, default=None, help="default 1e-5 (CPU path) or 1e-2 (GPU path)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tol = args.tol if args.tol is not None else (1e-5 if args.ncuda == 0 else 1e-2)
    try:
        import torch
        import transformers
        from safetensors.torch import load_file
    except ImportError as e:
        sys.exit(f"parity: {e}: needs torch, transformers and safetensors")

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    model.train()  # dropout is 0 in these configs; train() only enables grads
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        tok_path, out_path = os.path.join(tmp, "tokens.bin"), os.path.join(tmp, "grads.safetensors")
        with open(tok_path, "wb") as f:
            f.write(struct.pack(f"<{ids.numel()}i", *ids.flatten().tolist()))
        cmd = [args.megatrain, "grads", "--model", args.model, "--tokens", tok_path, "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--out", out_path, "--ncuda", str(args.ncuda)]
        subprocess.run(cmd, check=True)
        ours = load_file(out_path)

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    rows, worst, failed = [], 0.0, 0
    ref_loss = loss.item()
    l_err = abs(ours["loss"].item() - ref_loss) / abs(ref_loss)
    rows.append(("loss", l_err))
    names = dict(model.named_parameters())
    for name, p in names.items():
        if name not in ours:
            print(f"parity: megatrain wrote no gradient for {name}")
            failed += 1
            continue
        ref = p.grad.detach()
        err = ((ours[name] - ref).norm() / ref.norm()).item() if ref.norm() > 0 else ours[name].norm().item()
        rows.append((name, err))
    for name, err in rows:
        worst = max(worst, err)
        bad = err > tol
        failed += bad
        print(f"{name:60s} {err:.3e}{'  FAIL' if bad else ''}")
    print(f"parity ({'CPU fp32' if args.ncuda == 0 else 'GPU bf16'} path): loss {ours['loss'].item():.6f} vs "
          f"{ref_loss:.6f}; worst per-tensor relative error {worst:.3e} (bound {tol:g}); {len(rows) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
