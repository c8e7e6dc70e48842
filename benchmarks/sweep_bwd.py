"""Sweep backward tile configs on the GPU: the dK/dV kernel and the dQ kernel separately; print TFLOP/s, write JSON.

The two kernels take their tiles independently, so each is swept with the other's tile held at the table's entry
(the argmin of the sum is the argmin of each part), and the winners together give the printed best total.
Compiling ~100 variants one by one takes minutes, so ``--jobs`` worker processes first compile every variant once into
Triton's on-disk cache; the timing then runs alone in this process, one variant at a time.

Usage (on the GPU machine): PYTHONPATH=src python3 benchmarks/sweep_bwd.py --jobs 12 --json $OUT/sweep_bwd.json
The winners go into src/onlineattn/ops/_configs.py with the measured reason.
"""

import argparse
import dataclasses
import json
import subprocess
import sys

import torch
import triton.testing

from onlineattn.bench.prefill import Case
from onlineattn.ops._configs import BwdTile, bwd_config
from onlineattn.ops.backward import backward
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


def _inputs(case: Case):
    shape = (case.b, case.n, case.h, case.d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = forward(q, k, v, case.d**-0.5, case.causal)
    return do, q, k, v, o, lse


def _config(d, kernel, tile):
    base = bwd_config(d, d, torch.bfloat16, "cuda")
    return dataclasses.replace(base, **{kernel: tile})


def compile_shard(todo, n):
    for d, causal, kernel, tile in todo:
        do, q, k, v, o, lse = _inputs(Case(16384 // n, 2048 // d, n, d, causal))
        try:
            backward(do, q, k, v, o, lse, d**-0.5, causal, config=_config(d, kernel, tile))
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
    args = ap.parse_args()
    todo = variants(args.d, list(map(bool, args.causal)))
    if args.shard is not None:
        i, of = args.shard
        compile_shard(todo[i::of], args.n[0])
        return
    if args.jobs > 1:
        base = [sys.executable, __file__, "--d", *map(str, args.d), "--n", str(args.n[0]), "--causal",
                *map(str, args.causal)]
        workers = [subprocess.Popen(base + ["--shard", str(i), str(args.jobs)]) for i in range(args.jobs)]
        for w in workers:
            w.wait()
    results = []
    for d in args.d:
        for causal in map(bool, args.causal):
            for n in args.n:
                case = Case(16384 // n, 2048 // d, n, d, causal)
                inputs = _inputs(case)
                best = {}
                for _, _, kernel, tile in [t for t in todo if t[0] == d and t[1] == causal]:
                    cfg = _config(d, kernel, tile)
                    try:
                        ms = triton.testing.do_bench(
                            lambda: backward(*inputs, d**-0.5, causal, config=cfg), warmup=10, rep=40,
                            return_mode="median",
                        )
                    except Exception as err:
                        print(f"  d={d} {kernel} {tile}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                        continue
                    tf = case.flops("bwd") / ms / 1e9
                    results.append({"d": d, "causal": causal, "n": n, "kernel": kernel, "tile": tile.__dict__,
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
                    cfg = dataclasses.replace(bwd_config(d, d, torch.bfloat16, "cuda"), **winners)
                    ms = triton.testing.do_bench(lambda: backward(*inputs, d**-0.5, causal, config=cfg), warmup=10,
                                                 rep=40, return_mode="median")
                    print(f"d={d} causal={int(causal)} N={n} both winners: {case.flops('bwd') / ms / 1e9:.0f}",
                          flush=True)
                del inputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
