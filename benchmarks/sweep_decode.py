"""Sweep decode tiles and split counts on the GPU, timed under CUDA graphs (kernel time, no launch overhead), and
measure the host time of one eager call at B = 1.

Usage (on the GPU machine):
    PYTHONPATH=src python3 benchmarks/sweep_decode.py --quick            # the table's tile and the split rule, + host
    PYTHONPATH=src python3 benchmarks/sweep_decode.py --json $OUT/sweep_decode.json   # every tile and split count

``--paged PAGE`` runs every case on a page pool of that page size with a random block table (the bench's
``onlineattn-paged`` layout), so the paged kernel's tiles and stages are swept the same way.

``--cold`` times each call with the L2 cache cleared before it and the GPU held busy while the call is enqueued (a
sleep kernel after the clear), so the events time the kernel's own work from HBM, without the host: what an eager
decode step costs on the device when other work (the model's other layers) has evicted this layer's K/V.

Each case prints the automatic choice ("auto": the launcher's ``decode._choose``) beside the best measured
ones, so a rule that misses shows as a gap. The winners go into src/onlineattn/ops/_decode_configs.py with the reason.
"""

import argparse
import itertools
import json
import time

import torch
import triton.testing

from onlineattn.api import attention_with_kvcache as api_call
from onlineattn.bench.rows import time_cold
from onlineattn.ops import _decode_configs as C
from onlineattn.ops import decode as decode_ops
from onlineattn.ops.decode import attention_with_kvcache as kernel_call

HQ, HKV, D = 32, 8, 128
CASES = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (16, 131072), (64, 4096), (64, 32768),
         (64, 131072)]
TILES = [C.DecodeConfig(bn, 64, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4, 5))]
SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 64)


def _time(fn, cold):
    return time_cold(fn) if cold else triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def _inputs(b, length, page=0):
    """q, the caches, the lengths and the block table (None unless ``page``: then a pool of pages in random order)."""
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    if not page:
        k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return q, k, v, lens, None
    per_seq = -(-length // page)
    k, v = (torch.randn(b * per_seq, page, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(b * per_seq, device="cuda").reshape(b, per_seq).int()
    return q, k, v, lens, table


def _auto(q, k, v, table, length, splits=0, tile=None):
    """The launcher's own choice for this case, (tile, splits): ``decode._choose``, as a launch would make it."""
    chosen = decode_ops._choose(decode_ops._Step(), q, k, v, table, False, length, splits, tile)
    return chosen.tile, chosen.splits


def _tile(text):
    """``"block_n:warps:stages"`` -> a DecodeConfig of 64 packed rows."""
    block_n, warps, stages = (int(x) for x in text.split(":"))
    return C.DecodeConfig(block_n, 64, warps, stages)


def _label(tile, splits):
    return f"bn{tile.block_n} w{tile.num_warps} s{tile.num_stages} sp{splits}"


def sweep_case(b, length, tiles, splits_list, results, cold=False, page=0, cross=False):
    q, k, v, lens, table = _inputs(b, length, page)
    tbps = lambda ms: 2 * b * length * HKV * D * 2 / ms / 1e9
    auto_tile, auto_splits = _auto(q, k, v, table, length)
    configs = [("auto", auto_tile, auto_splits)]
    configs += [("tile", t, 0) for t in tiles]
    configs += [("splits", t, s) for t in (tiles if cross else [auto_tile]) for s in splits_list]
    scores = []
    for kind, tile, splits in configs:
        fn = lambda: kernel_call(q, k, v, None, None, lens, table, D**-0.5, False, splits, max_seqlen_k=length,
                                 return_lse=False, config=tile)
        try:
            fn()
            torch.cuda.synchronize()  # a fault is charged to this config, not to the next one
            ms = _time(fn, cold)
            torch.cuda.synchronize()
        except Exception as err:
            print(f"  B={b} L={length} {_label(tile, splits)}: {type(err).__name__}: {str(err)[:80]}", flush=True)
            continue
        used = splits or _auto(q, k, v, table, length, splits, tile)[1]
        scores.append((tbps(ms), ms, tile, used, kind))
        results.append({"B": b, "L": length, "page": page, "kind": kind, "cold": cold, "tile": tile.__dict__, "splits": used,
                        "us": round(ms * 1e3, 2), "tbps": round(tbps(ms), 3)})
    auto = scores[0] if scores and scores[0][4] == "auto" else None
    scores.sort(key=lambda t: -t[0])
    top = ", ".join(f"{tb:.2f} ({ms * 1e3:.1f}us) {_label(t, sp)}" for tb, ms, t, sp, _ in scores[:4])
    shown = f"{auto[0]:.2f} TB/s ({auto[1] * 1e3:.1f}us) {_label(auto[2], auto[3])}" if auto else "failed"
    print(f"B={b} L={length}{f' page {page}' if page else ''}: auto {shown} | best {top}", flush=True)


def host_times(results):
    """Host time of one eager call at B = 1, L = 4096 (the time to return, without waiting), and wall time with the
    GPU's work included, for the bare launcher and the API with and without its checks and a new token appended."""
    q, k, v, lens, _ = _inputs(1, 4096)
    k_new, v_new = k[:, :1].clone(), v[:, :1].clone()
    before = lens - 1
    for name, fn in [
        ("launcher", lambda: kernel_call(q, k, v, None, None, lens, None, D**-0.5, False, 0, max_seqlen_k=4096,
                                         return_lse=False)),
        ("api unchecked", lambda: api_call(q, k, v, cache_seqlens=lens, causal=False, check_indices=False)),
        ("api unchecked + append", lambda: api_call(q, k, v, k_new, v_new, cache_seqlens=before, causal=False,
                                                    check_indices=False)),
        ("api int lengths", lambda: api_call(q, k, v, cache_seqlens=4096, causal=False, check_indices=False)),
        ("api checked", lambda: api_call(q, k, v, cache_seqlens=lens, causal=False)),
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
        results.append({"B": 1, "L": 4096, "host": name, "host_us": round(host, 1), "wall_us": round(wall, 1)})
        print(f"B=1 L=4096 {name}: host {host:.1f} us per call, wall {wall:.1f} us per call", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", nargs="*", default=None, help="B:L pairs (default: all)")
    ap.add_argument("--quick", action="store_true", help="only the automatic choice per case, then the host times")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time measurement")
    ap.add_argument("--cold", action="store_true", help="time from HBM, GPU held ahead of the host (docstring)")
    ap.add_argument("--tiles", nargs="*", default=None, help="block_n:warps:stages tiles (default: the full set)")
    ap.add_argument("--splits", nargs="*", type=int, default=None, help="split counts (default: the full set)")
    ap.add_argument("--cross", action="store_true", help="every tile with every split count, not just the auto tile")
    ap.add_argument("--paged", type=int, default=0, metavar="PAGE", help="page pool of this page size (docstring)")
    args = ap.parse_args()
    cases = [tuple(map(int, c.split(":"))) for c in args.cases] if args.cases else CASES
    tiles = [_tile(t) for t in args.tiles] if args.tiles is not None else TILES
    splits = args.splits if args.splits is not None else SPLITS
    results = []
    for b, length in cases:
        sweep_case(b, length, [] if args.quick else tiles, [] if args.quick else splits, results, cold=args.cold,
                   page=args.paged, cross=args.cross)
    if not args.no_host:
        host_times(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
