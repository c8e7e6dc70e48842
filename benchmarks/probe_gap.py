"""Why does `bench prefill` read under `sweep_fwd.py` for the same kernel and shape? Time the entry points side by side
and measure the host's time per call (calls queued without a sync: the GPU queue is far from full, so the wall time
per call is the host's), against the kernel's own time.

Usage (GPU machine): PYTHONPATH=src python3 benchmarks/probe_gap.py --d 128 --n 512 4096 --causal 0 1
"""

import argparse
import cProfile
import pstats
import time

import torch
import triton.testing

from onlineattn.api import attention
from onlineattn.bench.prefill import Case, _timed
from onlineattn.ops.forward import forward


def host_us(fn, calls=200):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[128])
    ap.add_argument("--n", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--profile", action="store_true", help="cProfile 200 launcher and 200 API calls of the last case")
    args = ap.parse_args()
    for d in args.d:
        for n in args.n:
            for causal in map(bool, args.causal):
                case = Case(16384 // n, 2048 // d, n, d, causal)
                q, k, v = (torch.randn(case.b, n, case.h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                tf = lambda ms: f"{case.flops('fwd') / ms / 1e9:.1f}"
                direct = lambda: forward(q, k, v, d**-0.5, causal)
                api = lambda: attention(q, k, v, causal=causal)
                with torch.no_grad():
                    t_direct = triton.testing.do_bench(direct, warmup=25, rep=100, return_mode="median")
                    t_api = triton.testing.do_bench(api, warmup=25, rep=100, return_mode="median")
                    t_bench = _timed(lambda q, k, v, c: attention(q, k, v, causal=c), "fwd", q, k, v, causal)
                    h_direct, h_api = host_us(direct), host_us(api)
                print(f"d={d} N={n} causal={int(causal)}: TFLOP/s direct {tf(t_direct)} api {tf(t_api)} bench "
                      f"{tf(t_bench)}; kernel {t_direct * 1e3:.0f} us; host per call: launcher {h_direct:.0f} us, "
                      f"api {h_api:.0f} us", flush=True)
    if args.profile:
        for label, fn in (("launcher", direct), ("api", api)):
            with torch.no_grad():
                prof = cProfile.Profile()
                prof.runcall(lambda: [fn() for _ in range(200)])
            torch.cuda.synchronize()
            print(f"--- cProfile, 200 {label} calls (cumulative) ---")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
