#!/usr/bin/env python3
"""Replays ranged clip speculation's range prediction on a norm log (megatrain bench --norm-log).

For each clipped run in the log, each norm t >= 2 and each layer or head tile f, it forms the
range a ranged run of tile f would have had (runtime/speculate/history.c, mt_norm_range: the
rest of the norm predicted from norm t - 1, times or over the spread; the spread grows after a norm the
prediction missed, as --clip-range-grow has it) and says whether norm t's clip scale fell
inside it ("held"). It then scores rules that decide, from earlier norms only, whether to
speculate a tile: a tile-step that is speculated and holds counts +1, one that is speculated and
misses -1 (a miss costs its tile's redo, about what a hit saves), one not speculated 0.

Rules: none (always speculate), last (megatrain's --clip-range-check: the last norm's range
held), last2 (the last two held), tol:X (the last norm's actual rest was within X times of its
prediction). Only norms from --from on are scored (default 3: bench's first measured step after
its 2 warm-up steps). The embedding table's early path is left out.
"""
import argparse
import csv
import math
import sys


def scale_of(clip, norm):
    s = clip / (norm + 1e-6)
    return min(s, 1.0)


def predicted_rest(prev, f, known, head_now):
    """prev: (tiles, table head part) of the last norm; as runtime/speculate/history.c predicted_rest."""
    tiles, head = prev
    same = head + sum(tiles[f:])
    other = sum(tiles[:f])
    seen = known + head_now
    return other * (seen / same) if same > 0 else other


def replay(run, clip, spread, grow=0.0, memory=1):
    """held[t][f], err[t][f] (actual rest / predicted, folded to >= 1) and the spread of each norm
    t's ranges: spread, or when the largest error over the tiles of the last `memory` norms was x,
    spread times x up to grow when grow > spread (runtime/speculate/history.c, mt_norm_record's
    next_spread)."""
    held, err, spreads = [], [], []
    for t, (tiles, head) in enumerate(run):
        n = len(tiles)
        if t == 0:
            held.append([True] * n)
            err.append([1.0] * n)
            spreads.append(spread)
            continue
        worst = max((max(err[j][1:], default=1.0) for j in range(max(1, t - memory), t)), default=1.0)
        sp = min(spread * worst, grow) if grow > spread else spread
        spreads.append(sp)
        scale = scale_of(clip, math.sqrt(sum(tiles)))
        h, e = [], []
        for f in range(n):
            known = sum(tiles[f:])
            rest = predicted_rest(run[t - 1], f, known, head)
            c_hi = scale_of(clip, math.sqrt(known + rest / sp))
            c_lo = scale_of(clip, math.sqrt(known + rest * sp))
            h.append(c_lo * (1 - 1e-6) <= scale <= c_hi * (1 + 1e-6))
            actual = sum(tiles[:f])
            if rest > 0 and actual > 0:
                e.append(max(actual / rest, rest / actual))
            else:
                e.append(1.0 if rest == actual else math.inf)
        held.append(h)
        err.append(e)
    return held, err, spreads


def rule_fn(name):
    if name == "none":
        return lambda held, err, t, f: True
    if name == "last":
        return lambda held, err, t, f: held[t - 1][f]
    if name == "last2":
        return lambda held, err, t, f: held[t - 1][f] and (t < 2 or held[t - 2][f])
    if name.startswith("tol:"):
        x = float(name[4:])
        return lambda held, err, t, f: err[t - 1][f] <= x
    raise ValueError(f"unknown rule '{name}' (none, last, last2, tol:X)")


def read_runs(path):
    """[(K, clip, [(tiles, table head part) per norm])] from a norm log."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
    except OSError as e:
        sys.exit(f"norm_replay: cannot read '{path}': {e.strerror}")
    if not rows or rows[0][:4] != ["K", "clip", "norm", "grad_norm"] or rows[0][-1] != "table_head_part":
        sys.exit(f"norm_replay: '{path}' is not a norm log (megatrain bench --norm-log): its header must start "
                 "K,clip,norm,grad_norm and end table_head_part")
    width = len(rows[0])
    runs = []
    for i, r in enumerate(rows[1:], start=2):
        if len(r) != width:
            sys.exit(f"norm_replay: '{path}' line {i}: {len(r)} fields, the header has {width}")
        try:
            k, clip, norm = int(r[0]), float(r[1]), int(r[2])
            vals = [float(x) for x in r[4:]]
        except ValueError:
            sys.exit(f"norm_replay: '{path}' line {i}: not a number")
        if norm == 1 or not runs or runs[-1][0] != k or runs[-1][1] != clip:
            runs.append((k, clip, []))
        if norm != len(runs[-1][2]) + 1:
            sys.exit(f"norm_replay: '{path}' line {i}: norm {norm} follows norm {len(runs[-1][2])}")
        runs[-1][2].append((vals[:-1], vals[-1]))
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Example: megatrain bench --shape qwen2.5-3b --clip 1 --norm-log norms.csv, "
                                        "then tools/norm_replay.py norms.csv (a recorded 3B log: "
                                        "git show d7c6981:docs/gpu-logs/37-norms.csv)")
    ap.add_argument("log", help="the CSV written by megatrain bench --norm-log")
    ap.add_argument("--spread", type=float, default=1.25, help="--clip-range of the replay (default 1.25)")
    ap.add_argument("--grow", type=float, default=3.0,
                    help="--clip-range-grow of the replay (default 3; 1: the spread stays fixed)")
    ap.add_argument("--memory", type=int, default=4,
                    help="--clip-range-memory of the replay (default 4; 1: the last norm only)")
    ap.add_argument("--from", dest="first", type=int, default=3, help="first norm scored (default 3)")
    ap.add_argument("--rules", default="none,last,last2,tol:1.15", help="comma-separated (default %(default)s)")
    a = ap.parse_args()
    if a.spread <= 1:
        sys.exit("norm_replay: --spread must be above 1")
    if not 1 <= a.memory <= 16:
        sys.exit("norm_replay: --memory must be 1..16")
    try:
        rules = [(n, rule_fn(n)) for n in a.rules.split(",")]
    except ValueError as e:
        sys.exit(f"norm_replay: --rules: {e}")
    runs = read_runs(a.log)
    for k, clip, run in runs:
        if clip <= 0:
            continue
        if all(math.sqrt(sum(tiles)) <= clip for tiles, _ in run):
            print(f"K={k} clip {clip:g}, {len(run)} norms: every norm within the bound (no range to replay)")
            continue
        held, err, spreads = replay(run, clip, a.spread, a.grow, a.memory)
        ntiles = len(run[0][0])
        tiles = range(1, ntiles)  # the layers and the head; the embedding tile's rest is always 0
        per_norm = " ".join(f"{t + 1}:{sum(held[t][f] for f in tiles)}/{len(tiles)}" for t in range(1, len(run)))
        grows = f" growing to {a.grow:g} (memory {a.memory})" if a.grow > a.spread else ""
        print(f"K={k} clip {clip:g}, {len(run)} norms, spread {a.spread:g}{grows}; ranges held per norm: {per_norm}")
        if a.grow > a.spread:
            print("  spread per norm: " + " ".join(f"{t + 1}:{spreads[t]:.3g}" for t in range(1, len(run))))
        for name, rule in rules:
            hit = miss = skip = 0
            for t in range(max(1, a.first - 1), len(run)):
                for f in tiles:
                    if not rule(held, err, t, f):
                        skip += 1
                    elif held[t][f]:
                        hit += 1
                    else:
                        miss += 1
            print(f"  rule {name:10s} held {hit:4d}  missed {miss:4d}  not speculated {skip:4d}  score {hit - miss:+d}")


if __name__ == "__main__":
    main()
