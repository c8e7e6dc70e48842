"""Sweep backward tile configs on the GPU: the dK/dV kernel and the dQ kernel separately; print TFLOP/s, write JSON.

The two kernels take their tiles independently, so each is swept with the other's tile held at the table's entry
(the argmin of the sum is the argmin of each part), and the winners together give the printed best total.
Compiling ~100 variants one by one takes minutes, so ``--jobs`` worker processes first compile every variant once into
Triton's on-disk cache; the timing then runs alone in this process, one variant at a time.

Usage (on the GPU machine): PYTHONPATH=src python3 benchmarks/sweep_bwd.py --jobs 12 --json $OUT/sweep_bwd.json
The winners go into src/onlineattn/ops/_configs.py with the measured reason.
Sliding window (issue #6): --window 1024 --batch 1 --heads 16 --d 128 --n 16384 --causal 1 times causal attention where
each query sees its 1024 latest keys, FLOPs counted over the visible pairs, with the table's full causal call beside it.
"""

import argparse
import dataclasses
import json
import subprocess
import sys

import torch
import triton.testing

from onlineattn._mods import PLAIN, Mods
from onlineattn.bench.prefill import Case
from onlineattn.ops._configs import BwdTile, bwd_config
from onlineattn.ops.backward import gradients
from onlineattn.ops.forward import forward

# BwdTile(block_m, block_n, num_warps, num_stages, tma, split_scores)
CANDIDATES = {
    "small_d": {
        "dkdv": [
            BwdTile(64, 64, 4, 2), BwdTile(64, 64, 4, 2, True), BwdTile(64, 64, 4, 3, True),
            BwdTile(32, 64, 4, 3, True), BwdTile(32, 128, 4, 2, True), BwdTile(32, 128, 4, 3, True),
            BwdTile(32, 128, 8, 3, True), BwdTile(64, 128, 8, 2, True), BwdTile(64, 128, 8, 3, True),
            BwdTile(16, 128, 4, 4, True),
            # v8: 8 warps over 64 keys with the score tiles split across warpgroups; lost at d = 128
            BwdTile(64, 64, 8, 2, False, True), BwdTile(128, 64, 8, 2, False, True),
        ],
        "dq": [
            BwdTile(64, 64, 4, 2), BwdTile(64, 64, 4, 2, True), BwdTile(64, 64, 4, 3, True),
            BwdTile(128, 64, 8, 2, True), BwdTile(128, 64, 8, 3, True), BwdTile(128, 32, 8, 3, True),
            BwdTile(128, 32, 4, 3, True), BwdTile(64, 32, 4, 3, True), BwdTile(128, 128, 8, 2, True),
        ],
    },
    "d256": {
        # 64 keys put Sᵀ = K Qᵀ on wgmma (M = 64) and need 8 warps for the dK/dV accumulators; split_scores gives each
        # warpgroup half of the score tile instead of all of it twice (backward.py). 32 keys with 4 warps run on
        # mma.sync. Fits checked with .devrun/bwd_warn.py on the CPU machine (the TMA forms of 64x64 w8 s2 make ptxas
        # crash non-causal; the sweep reports it and goes on).
        "dkdv": [
            BwdTile(32, 32, 4, 2, True), BwdTile(64, 64, 8, 2), BwdTile(64, 64, 8, 2, False, True),
            BwdTile(64, 64, 8, 2, True, True), BwdTile(32, 64, 8, 3, True, True), BwdTile(32, 64, 8, 2, False, True),
        ],
        "dq": [
            BwdTile(64, 32, 4, 2, True), BwdTile(64, 32, 4, 3, True), BwdTile(64, 64, 4, 2, True),
            BwdTile(128, 32, 8, 2, True),
        ],
    },
}


def variants(head_dims, causals):
    """Every (d, causal, kernel, tile) to try, in a fixed order (workers shard it by index)."""
    out = []
    for d in head_dims:
        for causal in causals:
            for kernel, tiles in CANDIDATES["d256" if d > 128 else "small_d"].items():
                out += [(d, causal, kernel, tile) for tile in tiles]
    return out


def _mods(window):
    """The score variants swept: none, or a causal window of ``window`` keys (each query sees its latest ones)."""
    return PLAIN if window is None else Mods(window_left=window - 1, window_right=0)


def _case(args, n, d, causal):
    return Case(args.batch or 16384 // n, args.heads or 2048 // d, n, d, causal or args.window is not None)


def _inputs(case: Case, mods=PLAIN):
    shape = (case.b, case.n, case.h, case.d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = forward(q, k, v, case.d**-0.5, case.causal, mods=mods)
    return do, q, k, v, o, lse


def _backward(inputs, case: Case, cfg=None, mods=PLAIN):
    return gradients(*inputs, case.d**-0.5, case.causal, config=cfg, mods=mods)


def _config(d, causal, kernel, tile):
    base = bwd_config(d, d, torch.bfloat16, "cuda", causal=causal)
    return dataclasses.replace(base, **{kernel: tile})


def compile_shard(todo, args):
    mods = _mods(args.window)
    for d, causal, kernel, tile in todo:
        case = _case(args, args.n[0], d, causal)
        try:
            _backward(_inputs(case, mods), case, _config(d, causal, kernel, tile), mods)
        except Exception:  # out of shared memory or registers: the timing pass reports it
            pass
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--n", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--jobs", type=int, default=1, help="processes that compile the variants first")
    ap.add_argument("--shard", type=int, nargs=2, default=None, help=argparse.SUPPRESS)  # i, of: a compile worker
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the peers' grid, 16384 // N)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default: the peers' grid, 2048 // d)")
    ap.add_argument("--window", type=int, default=None,
                    help="causal sliding window of this many keys (causal forced on); the table's full causal "
                         "time is printed beside it")
    args = ap.parse_args()
    if args.window is not None:
        args.causal = [1]
    mods = _mods(args.window)
    todo = variants(args.d, list(map(bool, args.causal)))
    if args.shard is not None:
        i, of = args.shard
        compile_shard(todo[i::of], args)
        return
    if args.jobs > 1:
        base = [sys.executable, __file__, "--d", *map(str, args.d), "--n", str(args.n[0]), "--causal",
                *map(str, args.causal)]
        for flag in ("batch", "heads", "window"):
            if getattr(args, flag) is not None:
                base += [f"--{flag}", str(getattr(args, flag))]
        workers = [subprocess.Popen(base + ["--shard", str(i), str(args.jobs)]) for i in range(args.jobs)]
        for w in workers:
            w.wait()
    results = []
    for d in args.d:
        for causal in map(bool, args.causal):
            for n in args.n:
                case = _case(args, n, d, causal)
                inputs = _inputs(case, mods)
                flops = case.flops("bwd", args.window)
                best = {}
                for _, _, kernel, tile in [t for t in todo if t[0] == d and t[1] == causal]:
                    cfg = _config(d, causal, kernel, tile)
                    try:
                        ms = triton.testing.do_bench(
                            lambda: _backward(inputs, case, cfg, mods), warmup=10, rep=40,
                            return_mode="median",
                        )
                    except Exception as err:
                        print(f"  d={d} {kernel} {tile}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                        continue
                    tf = flops / ms / 1e9
                    results.append({"d": d, "causal": causal, "n": n, "window": args.window, "kernel": kernel,
                                    "tile": tile.__dict__,
                                    "ms": round(ms, 4), "tflops": round(tf, 1)})
                    best.setdefault(kernel, []).append((tf, tile))
                for kernel, scores in best.items():
                    scores.sort(key=lambda t: -t[0])
                    top = ", ".join(
                        f"{tf:.0f} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages} tma{int(t.tma)}"
                        f"{' split' if t.split_scores else ''}"
                        for tf, t in scores[:5]
                    )
                    print(f"d={d} causal={int(causal)} N={n} {kernel}: {top}", flush=True)
                winners = {kernel: scores[0][1] for kernel, scores in best.items()}
                if len(winners) == 2:
                    cfg = dataclasses.replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=causal), **winners)
                    ms = triton.testing.do_bench(lambda: _backward(inputs, case, cfg, mods), warmup=10, rep=40,
                                                 return_mode="median")
                    print(f"d={d} causal={int(causal)} N={n} both winners: {flops / ms / 1e9:.0f} ({ms:.4f} ms)",
                          flush=True)
                if args.window is not None:
                    table = _inputs(case)
                    full = triton.testing.do_bench(lambda: _backward(table, case), warmup=10, rep=40,
                                                   return_mode="median")
                    print(f"d={d} N={n}: full causal backward (table) {full:.4f} ms", flush=True)
                    results.append({"d": d, "n": n, "full_causal_ms": round(full, 4)})
                    del table
                del inputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
