"""Sweep decode tiles and split counts on the GPU, timed under CUDA graphs (kernel time, no launch overhead), and
break down the host time of one eager call at B = 1.

Usage (on the GPU machine): PYTHONPATH=src python3 benchmarks/sweep_decode.py --json $OUT/sweep_decode.json
The winners go into src/onlineattn/ops/_configs.py (decode tiles, the num_splits rule) with the measured reason.
"""

import argparse
import itertools
import json
import time

import torch
import triton.testing

from onlineattn.api import attention_with_kvcache as api_call
from onlineattn.ops._configs import DecodeConfig
from onlineattn.ops.decode import attention_with_kvcache as kernel_call

HQ, HKV, D = 32, 8, 128
CASES = [(1, 4096), (1, 32768), (1, 131072), (16, 32768), (16, 131072), (64, 32768), (64, 131072)]
TILES = [DecodeConfig(bn, 64, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
SPLITS = (0, 4, 8, 16, 32, 64, 128)


def _inputs(b, length):
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return q, k, v, lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", nargs="*", default=None, help="B:L pairs (default: all)")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time breakdown")
    args = ap.parse_args()
    cases = [tuple(map(int, c.split(":"))) for c in args.cases] if args.cases else CASES
    results = []
    for b, length in cases:
        q, k, v, lens = _inputs(b, length)
        tbps = lambda ms: 2 * b * length * HKV * D * 2 / ms / 1e9
        scores = []
        for tile, splits in itertools.chain(((t, 0) for t in TILES), ((TILES[7], s) for s in SPLITS)):
            fn = lambda: kernel_call(q, k, v, None, None, lens, None, D**-0.5, False, splits, max_seqlen_k=length,
                                     config=tile)
            try:
                fn()
                torch.cuda.synchronize()  # a fault is charged to this config, not to the next one
                ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                torch.cuda.synchronize()
            except Exception as err:
                print(f"  B={b} L={length} {tile} splits={splits}: {type(err).__name__}: {str(err)[:80]}")
                continue
            scores.append((tbps(ms), ms, tile, splits))
            results.append({"B": b, "L": length, "tile": tile.__dict__, "splits": splits, "us": round(ms * 1e3, 2),
                            "tbps": round(tbps(ms), 3)})
        scores.sort(key=lambda t: -t[0])
        top = ", ".join(f"{tb:.2f} ({ms * 1e3:.1f}us) bn{t.block_n} w{t.num_warps} s{t.num_stages} sp{sp}"
                        for tb, ms, t, sp in scores[:5])
        print(f"B={b} L={length}: {top}", flush=True)
        del q, k, v
    if args.no_host:
        return _write(args.json, results)
    # Host time of one eager call at B = 1, L = 4096: the API (validation + dispatch) against the bare launcher.
    q, k, v, lens = _inputs(1, 4096)
    for name, fn in [
        ("api checked", lambda: api_call(q, k, v, cache_seqlens=lens, causal=False)),
        ("api unchecked", lambda: api_call(q, k, v, cache_seqlens=lens, causal=False, check_indices=False)),
        ("api int lengths", lambda: api_call(q, k, v, cache_seqlens=4096, causal=False, check_indices=False)),
        ("launcher", lambda: kernel_call(q, k, v, None, None, lens, None, D**-0.5, False, 0, max_seqlen_k=4096)),
    ]:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 200 * 1e6
        print(f"B=1 L=4096 {name}: host {host:.1f} us per call, wall {wall:.1f} us per call", flush=True)
    _write(args.json, results)


def _write(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
