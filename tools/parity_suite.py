#!/usr/bin/env python3
"""Parity with transformers for every supported family, and the CI fixtures that come out of it.
Runs where torch and transformers are installed (the GPU machine):

    python3 tools/parity_suite.py --megatrain build-gpu/tools/megatrain --out OUT [--ncuda 1]

For each family (Llama 3 with rope scaling, Qwen2 with q/k/v bias, Qwen3 with q/k norm and an
explicit head_dim, Mistral) it
  1. builds a small random model in transformers (sizes not multiples of 64; norms and biases
     perturbed so that they matter) and saves it with save_pretrained, in a different on-disk
     dtype and shard layout per family (fp32 sharded, bf16, fp16, fp32 single file);
  2. reloads that directory in fp32 and computes the reference: loss, logits and every
     parameter gradient of one random batch (transformers' own causal-LM loss);
  3. runs `megatrain grads` on the same directory and batch: the fp32 CPU path must agree within
     1e-5 per tensor (||ours - ref|| / ||ref||), the bf16 GPU path (--ncuda 1) within 1e-2;
  4. loads the directory megatrain re-exported (`grads --save-model`) back into transformers:
     every parameter must equal the original bit for bit, and the loss must be the same;
  5. writes OUT/fixtures/<family>/ (the model directory, tokens.bin, batch.json and
     reference.safetensors), which tests/test_parity.c compares the CPU path with in CI.
Exits 1 when any check fails; the last lines are a table.
"""
import argparse
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

B, T = 2, 24

# Head dim 32: the CUDA attention kernel takes 32, 64, 96 or 128. Every other size is not a
# multiple of 64, so no kernel sees only aligned shapes.
FAMILIES = {
    # name: (config class, config kwargs, on-disk dtype, save_pretrained max_shard_size)
    "llama3": ("LlamaConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope=dict(rope_theta=500000.0, rope_type="llama3", factor=8.0,
                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=16)),
               "float32", "60KB"),
    "qwen2": ("Qwen2Config", dict(vocab_size=150, hidden_size=96, intermediate_size=72, num_hidden_layers=2,
                                  num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
                                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                                  rope=dict(rope_theta=1000000.0, rope_type="default")),
              "bfloat16", None),
    "qwen3": ("Qwen3Config", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                  use_sliding_window=False, rope=dict(rope_theta=1000000.0, rope_type="default")),
              "float16", None),
    "mistral": ("MistralConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      sliding_window=None, rope=dict(rope_theta=10000.0, rope_type="default")),
                "float32", None),
}


def make_config(transformers, cls_name, kw):
    cls = getattr(transformers, cls_name)
    kw = dict(kw)
    rope = kw.pop("rope")
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers 5
        kw["rope_parameters"] = rope
    else:
        kw["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    kw["initializer_range"] = 0.05
    return cls(**kw)


def rel(a, b):
    n = b.norm().item()
    return (a - b).norm().item() / n if n > 0 else a.norm().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatrain", default="build-gpu/tools/megatrain")
    ap.add_argument("--out", default="out")
    ap.add_argument("--ncuda", type=int, default=1, help="also check the GPU path (default 1; 0 skips it)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file
    except ImportError as e:
        sys.exit(f"parity_suite: {e}: needs torch, transformers and safetensors")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    # transformers 5 renamed from_pretrained's torch_dtype to dtype
    f32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    table, failed = [], 0
    work = tempfile.mkdtemp(prefix="parity-")
    for fam in args.families.split(","):
        cls_name, kw, disk_dtype, shard = FAMILIES[fam]
        torch.manual_seed(args.seed)
        cfg = make_config(transformers, cls_name, kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg, **f32)
        with torch.no_grad():  # make norms and biases matter: HF initialises them to 1 and 0
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.05 * torch.randn_like(p))
        hf_dir = os.path.join(work, fam, "model")
        save_kw = {"max_shard_size": shard} if shard else {}
        model.to(getattr(torch, disk_dtype)).save_pretrained(hf_dir, safe_serialization=True, **save_kw)
        ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **f32,
                                                                attn_implementation="eager")
        ref.train()
        g = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        reference = {"loss": out.loss.detach().reshape(1).float(),
                     "logits": out.logits[:, :T].detach().float().contiguous()}
        for name, p in ref.named_parameters():
            reference[name] = p.grad.detach().float().contiguous()
        if args.ncuda and torch.cuda.is_available():
            # What bf16 compute costs transformers itself on this model: its own bf16 autocast
            # on the GPU against its fp32 reference, the yardstick for megatrain's GPU path.
            hf16 = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **f32, attn_implementation="sdpa").cuda()
            hf16.train()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                o16 = hf16(input_ids=ids.cuda(), labels=ids.cuda())
            o16.loss.backward()
            hf_worst, hf_name = rel(o16.loss.detach().float().cpu().reshape(1), reference["loss"]), "loss"
            for name, p in hf16.named_parameters():
                e = rel(p.grad.detach().float().cpu(), reference[name])
                print(f"{fam:8s} {'HF bf16':9s} {name:50s} {e:.3e}")
                if e > hf_worst:
                    hf_worst, hf_name = e, name
            table.append((fam, "HF bf16 autocast (yardstick)", hf_name, hf_worst, float("inf")))
            del hf16, o16
        fx = os.path.join(args.out, "fixtures", fam)
        shutil.rmtree(fx, ignore_errors=True)
        shutil.copytree(hf_dir, fx)
        with open(os.path.join(fx, "tokens.bin"), "wb") as f:
            f.write(struct.pack(f"<{ids.numel()}i", *ids.flatten().tolist()))
        with open(os.path.join(fx, "batch.json"), "w") as f:
            json.dump({"batch": B, "seq_len": T, "disk_dtype": disk_dtype, "family": fam,
                       "torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
        save_file(reference, os.path.join(fx, "reference.safetensors"))

        for ncuda in ([0, 1] if args.ncuda else [0]):
            tol = 1e-5 if ncuda == 0 else 1e-2
            path = "CPU fp32" if ncuda == 0 else "GPU bf16"
            grads_out = os.path.join(work, fam, f"grads{ncuda}.safetensors")
            export = os.path.join(work, fam, f"export{ncuda}")
            cmd = [args.megatrain, "grads", "--model", hf_dir, "--tokens", os.path.join(fx, "tokens.bin"),
                   "--batch", str(B), "--seq-len", str(T), "--out", grads_out, "--ncuda", str(ncuda), "--logits"]
            if ncuda == 0:
                cmd += ["--save-model", export]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{fam} {path}: megatrain grads failed ({r.returncode}):\n{r.stdout}{r.stderr}")
                table.append((fam, path, "megatrain failed", float("inf"), tol))
                failed += 1
                continue
            ours = load_file(grads_out)
            worst, worst_name = 0.0, ""
            for name, t in reference.items():
                if name == "logits" and ncuda:
                    continue  # logits come from the CPU ops in both runs
                if name not in ours:
                    print(f"{fam} {path}: megatrain wrote no {name}")
                    worst, worst_name = float("inf"), name
                    continue
                e = rel(ours[name], t)
                print(f"{fam:8s} {path:9s} {name:50s} {e:.3e}")
                if e > worst:
                    worst, worst_name = e, name
            ok = worst <= tol
            failed += not ok
            table.append((fam, path, worst_name, worst, tol))
            if ncuda == 0:
                back = transformers.AutoModelForCausalLM.from_pretrained(export, **f32,
                                                                         attn_implementation="eager")
                ref_params = dict(ref.named_parameters())
                diff = [n for n, p in back.named_parameters() if not torch.equal(p, ref_params[n])]
                with torch.no_grad():
                    loss_back = back(input_ids=ids, labels=ids).loss.item()
                same = not diff and loss_back == out.loss.item() and len(ref_params) == len(dict(back.named_parameters()))
                failed += not same
                print(f"{fam} export: transformers loaded {export}: {'bitwise equal' if not diff else 'differs in ' + ', '.join(diff[:4])}, "
                      f"loss {loss_back:.7f} vs {out.loss.item():.7f}")
                table.append((fam, "export->HF", "params bitwise, loss equal" if same else "MISMATCH", 0.0 if same else 1.0, 0.0))
    print("| family | check | worst tensor | worst rel. error | bound | result |")
    print("|---|---|---|---|---|---|")
    for fam, path, name, e, tol in table:
        verdict = "(reference only)" if tol == float("inf") else ("ok" if e <= tol else "FAIL")
        print(f"| {fam} | {path} | {name} | {e:.2e} | {tol:g} | {verdict} |")
    checks = sum(1 for row in table if row[4] != float("inf"))
    print(f"parity_suite: {checks - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
