#!/usr/bin/env python3
"""HF interop checks for the GPU machine (needs torch and transformers; not run in CI).

  hf_roundtrip.py load DIR                    load a directory megatrain saved (mt_hf_save) with
                                              transformers, print the parameter count and a loss
  hf_roundtrip.py save DIR --config CFG.json  save a random-init transformers model of that config
                                              (safetensors) into DIR, for mt_hf_load to read
"""
import argparse
import sys


def cmd_load(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.dir, torch_dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    # A fixed batch, so the same number can be compared with megatrain's loss on this directory.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=g)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"{args.dir}: {type(model).__name__}, {n} parameters, loss {loss:.6f} on {args.tokens} random tokens (seed 0)")


def cmd_save(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = AutoConfig.from_pretrained(args.config)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dir, safe_serialization=True, max_shard_size=args.max_shard_size)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.dir}: {type(model).__name__}, {n} parameters, {args.dtype}, shards of at most {args.max_shard_size}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("load", help="load a megatrain-saved directory with transformers")
    p.add_argument("dir")
    p.add_argument("--tokens", type=int, default=16, help="length of the random batch for the loss (default 16)")
    p.set_defaults(fn=cmd_load)
    p = sub.add_parser("save", help="save a random-init transformers model")
    p.add_argument("dir")
    p.add_argument("--config", required=True, help="a config.json (e.g. models/configs/tiny-byte.json)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-shard-size", default="5GB", help="as save_pretrained's max_shard_size (default 5GB)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_save)
    args = ap.parse_args()
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
