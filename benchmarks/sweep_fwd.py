"""Sweep forward tile configs on the GPU; print TFLOP/s per (shape, config) and write JSON to --json.

Usage (on the GPU machine): PYTHONPATH=src python3 benchmarks/sweep_fwd.py --json $OUT/sweep.json
Long sequences (one 512k-token call takes seconds): --batch 1 --heads 16 --d 128 --n 131072 524288 --causal 1
Sliding window (issue #6): --window 1024 times causal attention where each query sees its 1024 latest keys
(window_size=(1023, 0)), FLOPs counted over the visible pairs, with the table's full causal call beside it.
The winners go into src/onlineattn/ops/_configs.py with the measured reason.
"""

import argparse
import json
import re
import statistics
import time
from dataclasses import replace

import torch
import triton.testing

from onlineattn._mods import PLAIN, Mods
from onlineattn.bench.prefill import Case
from onlineattn.ops._configs import FwdConfig
from onlineattn.ops.forward import forward

CANDIDATES = {
    "small_d": [
        FwdConfig(bm, bn, w, s, tma)
        for bm, bn, w, s, tma in [
            (64, 64, 4, 3, True), (64, 64, 4, 4, True), (64, 64, 4, 2, True), (128, 64, 8, 3, True),
            (128, 128, 8, 3, True), (64, 128, 4, 3, True), (128, 64, 4, 3, True), (64, 32, 4, 3, True),
            (64, 64, 4, 3, False), (128, 64, 8, 3, False),
        ]
    ],
    "d256": [
        FwdConfig(bm, bn, w, s, tma)
        for bm, bn, w, s, tma in [
            (128, 32, 8, 3, False), (128, 32, 8, 3, True), (64, 32, 4, 3, True), (64, 64, 4, 2, True),
            (64, 64, 8, 2, True), (128, 32, 8, 2, True),
        ]
    ],
}


def _parse_tiles(text):
    tiles = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)t([01])(p[01])?", item.strip())
        if not m:
            raise SystemExit(f"--tiles: cannot read {item!r}")
        bm, bn, w, st, tma = map(int, m.groups()[:5])
        tiles.append(FwdConfig(bm, bn, w, st, bool(tma), pipeline=m.group(6) == "p1"))
    return tiles


def _warm_up(seconds):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--n", type=int, nargs="*", default=[1024, 8192])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="round-robin passes over the configs; the median is kept")
    ap.add_argument("--heads-per-group", type=int, nargs="*", default=[1],
                    help="longest-first grouping of (batch, kv head) columns to try with each tile")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size (default: the peers' grid, 16384 // N; give 1 for N > 16384)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default: the peers' grid, 2048 // d)")
    ap.add_argument("--tiles", default=None,
                    help="only these tiles, e.g. '64x64w4s3t1,128x128w8s3t1p1' (block_m x block_n, warps, stages, tma, "
                         "and p1 for the software-pipelined key loop)")
    ap.add_argument("--window", type=int, default=None,
                    help="causal sliding window of this many keys (causal is forced on); the table's full causal "
                         "time is printed beside it")
    args = ap.parse_args()
    mods = PLAIN if args.window is None else Mods(window_left=args.window - 1, window_right=0)
    causals = [1] if args.window is not None else args.causal
    results = []
    _warm_up(seconds=3.0)  # a cool GPU reads ~7% fast for the first second or so (NOTES.md): rank on a warm one
    for d in args.d:
        for causal in map(bool, causals):
            for n in args.n:
                case = Case(args.batch or 16384 // n, args.heads or 2048 // d, n, d, causal)
                if case.b < 1:
                    raise SystemExit(f"N = {n} is past the peers' grid (B = 16384 // N = 0): pass --batch")
                q, k, v = (torch.randn(case.b, n, case.h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                tiles = _parse_tiles(args.tiles) if args.tiles else CANDIDATES["d256" if d > 128 else "small_d"]
                configs = [replace(t, heads_per_group=g) for t in tiles for g in args.heads_per_group]
                times = {cfg: [] for cfg in configs}
                for _ in range(args.repeat):  # round robin: drift of the clock hits every config alike
                    for cfg in configs:
                        if times[cfg] is None:
                            continue
                        try:
                            times[cfg].append(triton.testing.do_bench(
                                lambda: forward(q, k, v, d**-0.5, causal, config=cfg, mods=mods), warmup=10, rep=40,
                                return_mode="median",
                            ))
                        except Exception as err:  # out of shared memory or registers for this tile
                            times[cfg] = None
                            msg = str(err).splitlines()[0][:100] if str(err) else ""
                            print(f"  d={d} {cfg}: {type(err).__name__}: {msg}")
                flops = case.flops("fwd", args.window)
                scores = []
                for cfg, ms in times.items():
                    tf = flops / statistics.median(ms) / 1e9 if ms else 0.0
                    scores.append((tf, cfg))
                    results.append({"d": d, "causal": causal, "n": n, "window": args.window, "config": cfg.__dict__,
                                    "ms": round(statistics.median(ms), 4) if ms else None, "tflops": round(tf, 1),
                                    "runs": [round(flops / t / 1e9, 1) for t in ms or []]})
                if args.window is not None:
                    full = triton.testing.do_bench(lambda: forward(q, k, v, d**-0.5, True), warmup=10, rep=40,
                                                   return_mode="median")
                    best = min((statistics.median(ms) for ms in times.values() if ms), default=float("nan"))
                    print(f"d={d} N={n}: full causal (table) {full:.4f} ms; best window tile {best:.4f} ms, "
                          f"ratio {best / full:.3f}", flush=True)
                    results.append({"d": d, "n": n, "full_causal_ms": round(full, 4)})
                scores.sort(key=lambda t: -t[0])
                top = ", ".join(
                    f"{tf:.0f} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} tma{int(c.tma)} g{c.heads_per_group}"
                    f" p{int(c.pipeline)}"
                    for tf, c in scores[:6]
                )
                print(f"d={d} causal={int(causal)} N={n}: {top}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
