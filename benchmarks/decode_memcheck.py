"""Run one split-KV decode launch with a given shape, tile and split count, then synchronise: a target for
``compute-sanitizer --tool memcheck`` when a sweep reports an illegal address.

Usage: compute-sanitizer --tool memcheck python3 benchmarks/decode_memcheck.py B L BLOCK_N WARPS STAGES SPLITS [--graph]
"""

import sys

import torch
import triton.testing

from onlineattn import reference as R
from onlineattn.ops._decode_configs import DecodeConfig
from onlineattn.ops.decode import attention_with_kvcache

HQ, HKV, D = 32, 8, 128


def main():
    b, length, block_n, warps, stages, splits = map(int, sys.argv[1:7])
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    cfg = DecodeConfig(block_n, 64, warps, stages)
    fn = lambda: attention_with_kvcache(q, k, v, None, None, lens, None, D**-0.5, False, splits, max_seqlen_k=length,
                                        config=cfg)
    o, lse = fn()
    torch.cuda.synchronize()
    rows = slice(0, 1)
    exact_o, exact_lse = R.torch_math_attention(q[rows].double(), k[rows].double(), v[rows].double())
    err = (o[rows].double() - exact_o).abs().max().item()
    print(f"B={b} L={length} {cfg} splits={splits}: eager ok, max |o - exact| (batch 0) = {err:.3g}", flush=True)
    if "--graph" in sys.argv:
        triton.testing.do_bench_cudagraph(fn, rep=20)
        torch.cuda.synchronize()
        print("  graph replays ok", flush=True)


if __name__ == "__main__":
    main()
