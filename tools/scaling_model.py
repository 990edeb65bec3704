#!/usr/bin/env python3
"""The expected step time of data-parallel megatrain on 1-8 GPUs of one node and on 2-16 nodes, from
measured rates of the one-GPU H200 box and stated assumptions for what was not measured. Prints the
tables of docs/scaling.md (its text explains every term).

    python3 tools/scaling_model.py                 # the tables, default assumptions
    python3 tools/scaling_model.py --host-bw 300 --net-gbit 400 --tokens 32768
"""
import argparse

# Measured on the H200 box (docs/benchmarks.md, docs/design.md section 4).
H2D_GBS, D2H_GBS, BOTH_GBS = 55.5, 55.3, 100.0      # pinned copies, one PCIe 5 x16 link
H2D_PER_WEIGHT_BYTE = 10.18 / (2 * 3.09)           # 3B step: 10.18 GB H2D for 6.18 GB of bf16 weights
ADAMW_S_PER_1E9 = 0.22                             # fused AdamW alone, 16 cores, full layout
MODEL_TFLOPS = {"3b": 365.0, "7b": 400.0, "72b": 400.0}  # one GPU's step; 7B, 72B: PyTorch's at the 7B/14B widths

SHAPES = {  # Qwen2.5: N in the convention (all but the embedding table; a tied head counts), total: every
    # parameter; boundary: the parameters whose update the next step's first task waits for (the
    # embedding table and layer 0: the step boundary's bubble)
    "3b": dict(N=3.09e9, total=3.09e9, layers=36, d=2048, boundary=0.311e9 + 0.077e9),
    "7b": dict(N=7.07e9, total=7.62e9, layers=28, d=3584, boundary=0.545e9 + 0.233e9),
    "72b": dict(N=71.5e9, total=72.7e9, layers=80, d=8192, boundary=1.246e9 + 0.876e9),
}


def step_terms(shape, gpus, nodes, a):
    s = SHAPES[shape]
    N, P, L, d = s["N"], s["total"], s["layers"], s["d"]
    tok = a.tokens                                   # per GPU per step
    flops = (6 * N + 6 * L * d * a.seq_len) * tok
    compute = flops / (MODEL_TFLOPS[shape] * 1e12)
    grad_bytes = 2 if a.layout == "compact" else 4   # what a GPU writes home per parameter
    h2d = H2D_PER_WEIGHT_BYTE * 2 * P                # per GPU: weights streamed in
    d2h = grad_bytes * P                             # per GPU: gradients home (before any reduction)
    pcie = max(h2d / (H2D_GBS * 1e9), d2h / (D2H_GBS * 1e9), (h2d + d2h) / (BOTH_GBS * 1e9))
    pcie *= a.gpus_per_link                          # GPUs sharing one host link
    # Host memory of one node: every GPU's weight streams; the gradients: reduced on the GPUs
    # first (one gradient comes home) or each GPU's home, then read and summed there; AdamW over
    # the node's shard.
    shard = P / nodes
    adamw_bytes = (26 if a.layout == "compact" else 30) * shard
    if a.reduce == "gpu" or gpus == 1:
        grad_traffic = d2h
    else:
        grad_traffic = gpus * d2h + gpus * d2h + d2h   # written home, read by the sum, the sum written
    host = (gpus * h2d + grad_traffic + adamw_bytes) / (a.host_bw * 1e9)
    rate = ADAMW_S_PER_1E9 / 1e9 * (16 / a.cores)
    adamw = rate * shard
    boundary = rate * s["boundary"] / nodes
    if nodes > 1:  # the boundary tiles' new weights reach the other nodes before their first layers run
        boundary += 2 * s["boundary"] / (a.net_gbit / 8 * 1e9)
    # Between nodes, ZeRO-1 over owners: the gradients reduced to each shard's owner (fp32 or
    # bf16) and the updated bf16 weights sent back, (n-1)/n of each through every node's link.
    net = 0.0
    if nodes > 1:
        net = (nodes - 1) / nodes * (grad_bytes + 2) * P / (a.net_gbit / 8 * 1e9)
    # Every stream overlaps the compute (weights under the layers, AdamW under the next forward, the
    # network under the backward and the next forward), so the longest bounds the step; the
    # boundary's bubble (the next step's first layers wait for their update) adds to it.
    step = max(compute, pcie, host, adamw, net) + boundary
    return dict(compute=compute, pcie=pcie, host=host, adamw=adamw, net=net, boundary=boundary, step=step,
                tflops=flops * gpus * nodes / step / 1e12, host_gb=(2 + 2 + grad_bytes + 12 / nodes) * P / 1e9)


def table(title, rows, a):
    print(f"\n{title}\n")
    print("| shape | GPUs x nodes | compute s | PCIe s | host memory s | AdamW s | network s | boundary s | step s "
          "| bound by | model TFLOP/s (all GPUs) | efficiency | host GB per node |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, g, n in rows:
        t = step_terms(shape, g, n, a)
        one = step_terms(shape, 1, 1, a)
        bound = max(("compute", "PCIe", "host memory", "AdamW", "network"),
                    key=lambda k: t[{"compute": "compute", "PCIe": "pcie", "host memory": "host", "AdamW": "adamw",
                                     "network": "net"}[k]])
        eff = t["tflops"] / (one["tflops"] * g * n)
        print(f"| {shape} | {g} x {n} | {t['compute']:.2f} | {t['pcie']:.2f} | {t['host']:.2f} | {t['adamw']:.2f} | "
              f"{t['net']:.2f} | {t['boundary']:.2f} | {t['step']:.2f} | {bound} | {t['tflops']:.0f} | {eff:.0%} | {t['host_gb']:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per GPU per step (default 16 x 2048)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--host-bw", type=float, default=300.0,
                    help="a multi-GPU node's host memory bandwidth, GB/s (assumed: two sockets of DDR5)")
    ap.add_argument("--cores", type=int, default=32, help="CPU cores per multi-GPU node running AdamW")
    ap.add_argument("--net-gbit", type=float, default=400.0, help="each node's network link, Gbit/s (assumed)")
    ap.add_argument("--gpus-per-link", type=int, default=1, help="GPUs sharing one PCIe link to the host")
    ap.add_argument("--layout", choices=["full", "compact"], default="compact")
    ap.add_argument("--reduce", choices=["gpu", "host"], default="gpu",
                    help="where the GPUs' gradients are summed: on the GPUs (one comes home) or on the host")
    a = ap.parse_args()
    print(f"tokens per GPU per step {a.tokens}, layout {a.layout}, host {a.host_bw:.0f} GB/s and {a.cores} cores, "
          f"gradients reduced on the {a.reduce}, network {a.net_gbit:.0f} Gbit/s per node, {a.gpus_per_link} GPU(s) "
          f"per PCIe link")
    table("One node, 1-8 GPUs", [(s, g, 1) for s in SHAPES for g in (1, 2, 4, 8)], a)
    table("2-16 nodes of 8 GPUs", [(s, 8, n) for s in SHAPES for n in (2, 4, 8, 16)], a)


if __name__ == "__main__":
    main()
