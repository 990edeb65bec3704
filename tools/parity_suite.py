#!/usr/bin/env python3
"""Parity with transformers for every supported family, and the CI fixtures that come out of it.
Runs where torch and transformers are installed (the GPU machine):

    python3 tools/parity_suite.py --megatrain build-gpu/tools/megatrain --out OUT [--ncuda 1]
    python3 tools/parity_suite.py --model DIR [--batch 2 --seq-len 64]    (your own HF directory)

For each family (Llama 3 with rope scaling, Qwen2 with q/k/v bias, Qwen3 with q/k norm and an
explicit head_dim, Mistral, the rope scalings linear, dynamic and yarn on sequences longer
than max_position_embeddings or the original context, and the mixtures of experts Qwen3-MoE,
Mixtral and GPT-OSS without and with the router's load-balancing loss) it
  1. builds a small random model in transformers (sizes not multiples of 64; norms and biases
     perturbed so that they matter) and saves it with save_pretrained, in a different on-disk
     dtype and shard layout per family (fp32 sharded, bf16, fp16, fp32 single file);
  2. reloads that directory in fp32 and computes the reference: loss, logits and every
     parameter gradient of one random batch (transformers' own causal-LM loss); a mixture of
     experts' batch is drawn again until no token's routing is a near-tie (routed_batch);
  3. runs `megatrain grads` on the same directory and batch: the fp32 CPU path must agree within
     1e-5 per tensor (||ours - ref|| / ||ref||); with a GPU (--ncuda 1) the fp32 GPU path
     (--dtype fp32) within 1e-5 too (--tol-gpu-fp32, at most --tol-gpu), and the bf16 GPU
     path within 1.25x of transformers' own bf16 autocast, measured the same way as a yardstick
     (--bf16-factor; bf16 operands cannot reach 1e-2 on these models, docs/benchmarks.md);
  4. loads the directory megatrain re-exported (`grads --save-model`) back into transformers:
     every parameter must equal the original bit for bit, and the loss must be the same;
  5. writes OUT/fixtures/<family>/ (the model directory, tokens.bin, batch.json and
     reference.safetensors), which tests/test_parity.c compares the CPU path with in CI.
--model DIR runs steps 2-4 on a directory of yours. --width N (hidden size N, vocab 1000),
--bf16-weights (random weights rounded to bf16 values, as published checkpoints hold),
--bf16-params REGEX (only the parameters whose names match, e.g. 'norm|embed') and
--batch/--seq-len vary the random models to see what the bf16 error depends on; fixtures are
written only at the default sizes.
Exits 1 when any check fails; the last lines are a table.
"""
import argparse
import inspect
import json
import os
import re
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
    # Rope scaling past the pretraining context: the batch's T = 24 positions run beyond
    # max_position_embeddings (linear, dynamic: whose base grows with the length run) or the
    # original context (yarn, whose attention factor scales cos and sin).
    "llama-linear": ("LlamaConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                         rope=dict(rope_theta=10000.0, rope_type="linear", factor=2.0)),
                     "float32", None),
    "qwen2-dynamic": ("Qwen2Config", dict(vocab_size=150, hidden_size=96, intermediate_size=72, num_hidden_layers=2,
                                          num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=16,
                                          rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                                          rope=dict(rope_theta=1000000.0, rope_type="dynamic", factor=4.0)),
                      "float32", None),
    # Qwen2.5's long-context block: max_position_embeddings kept, factor over the original
    "qwen2-yarn": ("Qwen2Config", dict(vocab_size=150, hidden_size=96, intermediate_size=72, num_hidden_layers=2,
                                       num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=16,
                                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                                       rope=dict(rope_theta=1000000.0, rope_type="yarn", factor=4.0,
                                                 original_max_position_embeddings=16)),
                   "float32", None),
    # every optional yarn key: betas, the mscales' attention factor, an unrounded ramp
    "qwen3-yarn": ("Qwen3Config", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       use_sliding_window=False,
                                       rope=dict(rope_theta=1000000.0, rope_type="yarn", factor=8.0, beta_fast=8.0,
                                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8, truncate=False,
                                                 original_max_position_embeddings=8)),
                   "float32", None),
    # Mixtures of experts (docs/moe.md): Qwen3-MoE (softmax router, top 2 of 6 renormalised, one
    # dense layer by mlp_only_layers) and Mixtral (top 2 of 4, w1/w3/w2 naming), each without and
    # with the router's load-balancing loss in transformers' loss (output_router_logits).
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72,
                                         moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6,
                                         tie_word_embeddings=True, use_sliding_window=False,
                                         output_router_logits=False,
                                         rope=dict(rope_theta=1000000.0, rope_type="default")),
                  "float32", None),
    "mixtral": ("MixtralConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_local_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                                      output_router_logits=False, rope=dict(rope_theta=1000000.0, rope_type="default")),
                "float32", None),
    # gpt_oss: q/k/v/o biases, a sink logit per head, a window of 8 keys on layer 0 and full
    # attention on layer 1, yarn past the original context, a biased router, biased experts with
    # the clamped SwiGLU (a limit low enough that some gates and ups reach it); fused expert
    # tensors on disk.
    "gpt_oss": ("GptOssConfig", dict(vocab_size=150, hidden_size=80, intermediate_size=72, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     rms_norm_eps=1e-5, tie_word_embeddings=False, output_router_logits=False,
                                     swiglu_limit=7.0,  # transformers' GptOssExperts clamps at 7.0 whatever this says
                                     rope=dict(rope_theta=150000.0, rope_type="yarn", factor=4.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False, original_max_position_embeddings=16)),
                "bfloat16", None),
}

# Families the CUDA decoder layer does not run (megatrain refuses them with CUDA workers): checked
# on the CPU path only.
CPU_ONLY = set()


def with_aux(family, disk_dtype, shard, **changes):
    """A family's entry with the router's load-balancing loss on (coefficient 0.05) and `changes`
    to its config, stored as disk_dtype in shard-sized files."""
    cls_name, kw, _, _ = FAMILIES[family]
    return cls_name, dict(kw, output_router_logits=True, router_aux_loss_coef=0.05, **changes), disk_dtype, shard


FAMILIES["qwen3_moe-aux"] = with_aux("qwen3_moe", "bfloat16", None, norm_topk_prob=False, mlp_only_layers=[],
                                     num_hidden_layers=2, tie_word_embeddings=False)
FAMILIES["mixtral-aux"] = with_aux("mixtral", "float32", "100KB")
FAMILIES["gpt_oss-aux"] = with_aux("gpt_oss", "float32", "100KB")


def hub_names(name, t, model_type):
    """A transformers parameter (or its gradient) under the names published checkpoints, and
    megatrain, give it: transformers 5 holds a layer's experts fused (experts.gate_up_proj
    [E, 2I, d], gate rows first; experts.down_proj [E, d, I]) and Mixtral's block under mlp.;
    checkpoints have one tensor per expert (Mixtral: block_sparse_moe.experts.e.w1/w3/w2). gpt_oss
    holds them fused in the checkpoints too, transposed (gate_up_proj [E, d, 2I], x @ W, gate j in
    column 2j and up j in 2j + 1; down_proj [E, I, d]); megatrain's `grads` writes them per expert
    under the Qwen3-MoE names. A name of neither form is returned as it is."""
    mixtral, gpt_oss = model_type == "mixtral", model_type == "gpt_oss"
    block = ".block_sparse_moe." if mixtral else ".mlp."
    if mixtral and (".mlp.gate." in name or ".mlp.experts." in name):
        name = name.replace(".mlp.", block)
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for fused in ("experts.gate_up_proj", "experts.down_proj"):
        if name.endswith(fused):
            prefix = name[: -len(fused)] + "experts."
            out = []
            for e in range(t.shape[0]):
                if fused.endswith("gate_up_proj"):
                    if gpt_oss:
                        g, u = t[e, :, 0::2].T, t[e, :, 1::2].T
                    else:
                        half = t.shape[1] // 2
                        g, u = t[e, :half], t[e, half:]
                    out += [(f"{prefix}{e}.{gate}.weight", g), (f"{prefix}{e}.{up}.weight", u)]
                else:
                    out.append((f"{prefix}{e}.{down}.weight", t[e].T if gpt_oss else t[e]))
            return [(n, x.contiguous()) for n, x in out]
    return [(name, t.contiguous())]


def grads_by_hub_name(model):
    out = {}
    for name, p in model.named_parameters():
        for n, g in hub_names(name, p.grad.detach().float(), model.config.model_type):
            out[n] = g
    return out


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


def scaled(kw, width):
    """The family's config at hidden size `width` (a multiple of 32): 6 heads of 64 (Qwen2: heads
    of 32), intermediate ~2.7x, vocab 1000: wider models to see how the bf16 error depends on
    size (--width)."""
    kw = dict(kw)
    kw.update(hidden_size=width, intermediate_size=(width * 27 // 10) | 1, vocab_size=1000,
              max_position_embeddings=1024)
    if "head_dim" in kw:
        kw.update(head_dim=64, num_attention_heads=6, num_key_value_heads=2)
    else:  # Qwen2: head_dim = hidden / heads
        kw["num_attention_heads"], kw["num_key_value_heads"] = width // 32, 1
    return kw


def write_tokens(path, ids):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{ids.numel()}i", *ids.flatten().tolist()))


def hf_forward(torch, model, ids):
    """transformers' loss and logits [B, T, V] of the batch megatrain trains on: inputs ids[:, :T],
    targets ids[:, 1:]. The forward must see the T inputs only where what it computes depends on
    how many positions it sees: with the router's load-balancing loss on (the loss counts the
    routing of every position), and with dynamic rope scaling (its frequencies follow the
    sequence's length): the cross-entropy, plus router_aux_loss_coef x transformers' aux_loss as
    its causal-LM loss adds it. Otherwise transformers' own shifted loss over the T + 1 ids, the
    same by causality."""
    T = ids.shape[1] - 1
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None)
    dynamic = isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic"
    aux = getattr(model.config, "output_router_logits", False)
    if aux or dynamic:
        out = model(input_ids=ids[:, :T])
        ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                               ids[:, 1:].reshape(-1))
        return (ce + model.config.router_aux_loss_coef * out.aux_loss if aux else ce), out.logits
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.logits[:, :T]


def hf_reference(transformers, torch, model_dir, ids, f32):
    """transformers' fp32 loss, logits and every parameter gradient of one batch."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **f32, attn_implementation="eager")
    ref.train()  # dropout is 0 in these configs; train() only enables grads
    loss, logits = hf_forward(torch, ref, ids)
    loss.backward()
    reference = {"loss": loss.detach().reshape(1).float(), "logits": logits.detach().float().contiguous()}
    reference.update(grads_by_hub_name(ref))
    return ref, loss.item(), reference


def hf_autocast_errors(transformers, torch, model_dir, ids, reference, f32):
    """What bf16 compute costs transformers itself: its own bf16 autocast on the GPU against its
    fp32 reference, the yardstick for megatrain's GPU path. Per tensor, loss first."""
    # sdpa, transformers' default on the GPU; eager where a model has no sdpa (GptOss: its sinks)
    try:
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **f32, attn_implementation="sdpa")
    except ValueError:
        hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **f32, attn_implementation="eager")
    hf16 = hf16.cuda()
    hf16.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss16, _ = hf_forward(torch, hf16, ids.cuda())
    loss16.backward()
    errs = {"loss": rel(loss16.detach().float().cpu().reshape(1), reference["loss"])}
    for name, g in grads_by_hub_name(hf16).items():
        errs[name] = rel(g.cpu(), reference[name])
    return errs


def megatrain_errors(args, load_file, model_dir, tok_path, B, T, ncuda, dtype, reference, work, export=None):
    """`megatrain grads` on the same directory and batch in dtype; per-tensor errors against the
    reference, or None (and the output printed) when it fails."""
    grads_out = os.path.join(work, f"grads{ncuda}{dtype}.safetensors")
    cmd = [args.megatrain, "grads", "--model", model_dir, "--tokens", tok_path, "--batch", str(B),
           "--seq-len", str(T), "--out", grads_out, "--ncuda", str(ncuda), "--dtype", dtype, "--logits"]
    if export:
        cmd += ["--save-model", export]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"megatrain grads failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        return None
    ours = load_file(grads_out)
    errs = {}
    for name, t in reference.items():
        if name == "logits" and ncuda:
            continue  # logits come from the CPU ops in both runs
        errs[name] = rel(ours[name], t) if name in ours else float("inf")
    return errs


def worst_of(errs):
    name = max(errs, key=errs.get)
    return name, errs[name]


ROUTING_MARGIN = 0.05  # of a layer's router-logit standard deviation
ROUTING_DRAWS = 4000


def routed_batch(torch, transformers, model_dir, f32, B, T, seed):
    """Token ids for a mixture of experts whose routing no bf16 rounding can turn: drawn as the
    dense families' are, again while some token's k-th and (k+1)-th router logits (transformers'
    fp32 model) lie closer than ROUTING_MARGIN standard deviations of that layer's logits. A
    near-tie that bf16 compute flips moves whole rows of gradient to another expert, and whether
    it flips under autocast or under megatrain is chance: the bf16 comparison is of arithmetic on
    the same routing. Returns ids, the smallest margin and the draws taken (the first draw is the
    dense families' batch)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **f32, attn_implementation="eager")
    k = model.config.num_experts_per_tok
    logits = []

    def capture(mod, inputs):  # the router's logits from its input, whatever its forward returns
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        y = x @ mod.weight.T
        logits.append(y + mod.bias if getattr(mod, "bias", None) is not None else y)

    hooks = [m.register_forward_pre_hook(capture) for n, m in model.named_modules()
             if re.search(r"\.mlp\.(gate|router)$", n) and isinstance(getattr(m, "weight", None), torch.Tensor)]
    g = torch.Generator().manual_seed(seed)
    best = (-1.0, None, 0)
    with torch.no_grad():
        for draw in range(1, ROUTING_DRAWS + 1):
            ids = torch.randint(0, model.config.vocab_size, (B, T + 1), generator=g)
            logits.clear()
            model(input_ids=ids[:, :T])
            margin = float("inf")
            for l in logits:
                top = l.sort(dim=-1, descending=True).values
                margin = min(margin, float(((top[:, k - 1] - top[:, k]) / l.std()).min()))
            if margin > best[0]:
                best = (margin, ids, draw)
            if margin >= ROUTING_MARGIN:
                break
    for h in hooks:
        h.remove()
    return best[1], best[0], best[2]


def check_family(args, torch, transformers, load_file, save_file, f32, label, model_dir, ids, work, table,
                 fixtures=None, disk_dtype=None):
    """Steps 2-5 of the module doc for one model directory; appends rows to table, returns the
    number of failed checks."""
    B, T = ids.shape[0], ids.shape[1] - 1
    ref, ref_loss, reference = hf_reference(transformers, torch, model_dir, ids, f32)
    tok_path = os.path.join(work, "tokens.bin")
    write_tokens(tok_path, ids)
    failed = 0
    if fixtures:
        shutil.rmtree(fixtures, ignore_errors=True)
        shutil.copytree(model_dir, fixtures)
        write_tokens(os.path.join(fixtures, "tokens.bin"), ids)
        with open(os.path.join(fixtures, "batch.json"), "w") as f:
            json.dump({"batch": B, "seq_len": T, "disk_dtype": disk_dtype, "family": label,
                       "torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
        save_file(reference, os.path.join(fixtures, "reference.safetensors"))
    gpu = args.ncuda and torch.cuda.is_available() and label not in CPU_ONLY
    if args.ncuda and not gpu:
        print(f"{label}: " + ("megatrain's CUDA layer does not run it yet" if label in CPU_ONLY
                              else "no CUDA device for torch") + "; the GPU path is not checked")
    hf_worst = float("inf")
    if gpu:
        errs = hf_autocast_errors(transformers, torch, model_dir, ids, reference, f32)
        for name, e in errs.items():
            print(f"{label:8s} {'HF bf16':9s} {name:50s} {e:.3e}")
        hf_worst = worst_of(errs)[1]
        table.append((label, "HF bf16 autocast (yardstick)", *worst_of(errs), float("inf"), median(errs)))
    # (path, CUDA workers, dtype, bound)
    paths = [("CPU fp32", 0, "fp32", args.tol_cpu)]
    if gpu:
        paths += [("GPU fp32", 1, "fp32", min(args.tol_gpu, args.tol_gpu_fp32)),
                  ("GPU bf16", 1, "bf16", args.bf16_factor * hf_worst)]
    for path, ncuda, dtype, tol in paths:
        export = os.path.join(work, "export") if ncuda == 0 and not args.no_export else None
        errs = megatrain_errors(args, load_file, model_dir, tok_path, B, T, ncuda, dtype, reference, work, export)
        if errs is None:
            table.append((label, path, "megatrain failed", float("inf"), tol, float("inf")))
            failed += 1
            continue
        for name, e in errs.items():
            print(f"{label:8s} {path:9s} {name:50s} {e:.3e}")
        name, worst = worst_of(errs)
        failed += not worst <= tol
        table.append((label, path, name, worst, tol, median(errs)))
        if export:
            back = transformers.AutoModelForCausalLM.from_pretrained(export, **f32, attn_implementation="eager")
            ref_params = dict(ref.named_parameters())
            diff = [n for n, p in back.named_parameters() if n not in ref_params or not torch.equal(p, ref_params[n])]
            with torch.no_grad():
                loss_back = hf_forward(torch, back, ids)[0].item()
            same = not diff and loss_back == ref_loss and len(ref_params) == len(dict(back.named_parameters()))
            failed += not same
            print(f"{label} export: transformers loaded {export}: {'bitwise equal' if not diff else 'differs in ' + ', '.join(diff[:4])}, "
                  f"loss {loss_back:.7f} vs {ref_loss:.7f}")
            table.append((label, "export->HF", "params bitwise, loss equal" if same else "MISMATCH",
                          0.0 if same else 1.0, 0.0, 0.0))
    return failed


def median(errs):
    v = sorted(errs.values())
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatrain", default="build-gpu/tools/megatrain")
    ap.add_argument("--out", default="out", help="where fixtures/ goes (random models at the default size only)")
    ap.add_argument("--ncuda", type=int, default=1, help="also check the GPU path (default 1; 0 skips it)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--model", help="check this HF directory instead of the random models (no fixtures written)")
    ap.add_argument("--width", type=int, help="random models at this hidden size (multiple of 32), vocab 1000; no fixtures")
    ap.add_argument("--bf16-weights", action="store_true",
                    help="round the random weights to bf16 values first (as published checkpoints are); no fixtures")
    ap.add_argument("--bf16-params", metavar="REGEX",
                    help="round to bf16 values first only the parameters whose names match REGEX (e.g. 'norm|embed':"
                         " what the GPU's bf16 path rounds and autocast does not); no fixtures")
    ap.add_argument("--batch", type=int, default=B)
    ap.add_argument("--seq-len", type=int, default=T)
    ap.add_argument("--tol-cpu", type=float, default=1e-5)
    ap.add_argument("--tol-gpu", type=float, default=1e-2, help="the fp32 GPU path's largest bound (default 1e-2)")
    ap.add_argument("--tol-gpu-fp32", type=float, default=1e-5,
                    help="the fp32 GPU path's own bound (default 1e-5, as the CPU's); the smaller of the two applies")
    ap.add_argument("--bf16-factor", type=float, default=1.25,
                    help="the bf16 GPU path's bound: this many times transformers' bf16 autocast worst error")
    ap.add_argument("--no-export", action="store_true", help="skip the export -> transformers check")
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
    default_models = not (args.width or args.bf16_weights or args.bf16_params) and (args.batch, args.seq_len) == (B, T)
    bf16_params = re.compile(args.bf16_params) if args.bf16_params else None
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        g = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g)
        os.makedirs(os.path.join(work, "model"))
        failed += check_family(args, torch, transformers, load_file, save_file, f32, os.path.basename(args.model.rstrip("/")),
                               args.model, ids, os.path.join(work, "model"), table)
    for fam in ([] if args.model else args.families.split(",")):
        if fam not in FAMILIES:
            sys.exit(f"parity_suite: unknown family {fam!r} (known: {', '.join(FAMILIES)})")
        cls_name, kw, disk_dtype, shard = FAMILIES[fam]
        if args.width:
            kw = scaled(kw, args.width)
        torch.manual_seed(args.seed)
        cfg = make_config(transformers, cls_name, kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg, **f32)
        with torch.no_grad():  # make norms and biases matter: HF initialises them to 1 and 0
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias") or name.endswith("_bias") or name.endswith(".sinks"):
                    p.copy_(0.05 * torch.randn_like(p))
                if args.bf16_weights or (bf16_params and bf16_params.search(name)):
                    p.copy_(p.to(torch.bfloat16).float())
        fam_work = os.path.join(work, fam)
        hf_dir = os.path.join(fam_work, "model")
        save_kw = {"max_shard_size": shard} if shard else {}
        model.to(getattr(torch, disk_dtype)).save_pretrained(hf_dir, safe_serialization=True, **save_kw)
        if getattr(cfg, "num_experts_per_tok", 0):
            ids, margin, draws = routed_batch(torch, transformers, hf_dir, f32, args.batch, args.seq_len, args.seed + 1)
            print(f"{fam}: batch of draw {draws}, smallest routing margin {margin:.3f} router-logit standard "
                  f"deviations (wanted {ROUTING_MARGIN})")
        else:
            g = torch.Generator().manual_seed(args.seed + 1)
            ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        fixtures = os.path.join(args.out, "fixtures", fam) if default_models else None
        failed += check_family(args, torch, transformers, load_file, save_file, f32, fam, hf_dir, ids, fam_work, table,
                               fixtures, disk_dtype)
    print(f"(batch {args.batch} x {args.seq_len}" + (f", hidden {args.width}" if args.width else "")
          + (", weights rounded to bf16" if args.bf16_weights else "")
          + (f", parameters matching '{args.bf16_params}' rounded to bf16" if args.bf16_params else "") + ")")
    print("| family | check | worst tensor | worst rel. error | median over tensors | bound | result |")
    print("|---|---|---|---|---|---|---|")
    for fam, path, name, e, tol, med in table:
        verdict = "(reference only)" if tol == float("inf") else ("ok" if e <= tol else "FAIL")
        print(f"| {fam} | {path} | {name} | {e:.2e} | {med:.2e} | {tol:g} | {verdict} |")
    checks = sum(1 for row in table if row[4] != float("inf"))
    print(f"parity_suite: {checks - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
