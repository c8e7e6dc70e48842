"""`onlineattn bench long`: one causal training step (fwd + bwd) over a single very long sequence, timed once.

The issue #4 demonstration: B = 1, H = 16, d = 128, bf16, N up to 1M tokens on one H200. Exact attention at that
length is only possible because nothing N×N is ever allocated: memory is q, k, v, o, dO, dq, dk, dv and the row
statistics. A short warm-up at a small N compiles the kernels first, so the timed step is pure GPU work.
Each run appends one row, op ``fwdbwd_long``, with the forward and backward times and the peak memory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .prefill import Case
from .rows import add_output_options, append_rows, environment


def step(n: int, h: int, d: int, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Allocate inputs, run fwd then bwd once, return times (ms) and memory (bytes)."""
    from ..api import attention

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, n, h, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    o = attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    o.backward(do)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated()  # read before the check below, whose temporaries are GiBs at 1M tokens
    finite = all(bool(torch.isfinite(x).all()) for x in (o, q.grad, k.grad, v.grad))
    return {"fwd_ms": (t1 - t0) * 1e3, "bwd_ms": (t2 - t1) * 1e3, "peak_bytes": peak, "resident_bytes": resident,
            "finite": finite}


def run(n: int, h: int, d: int, *, out: Path | None, commit: str | None = None) -> dict:
    step(4096, h, d)  # compile and warm up
    result = step(n, h, d)
    case = Case(1, h, n, d, True)
    ms = result["fwd_ms"] + result["bwd_ms"]
    tensors = 8 * n * h * d * 2  # q k v o dO dq dk dv in bf16
    row = {
        **environment(commit), "op": "fwdbwd_long", "provider": "onlineattn", "dtype": "bfloat16",
        "B": 1, "Hq": h, "Hkv": h, "Sq": n, "Sk": n, "d": d, "causal": True,
        "ms": round(ms, 2), "tflops": round(case.flops("fwdbwd") / ms / 1e9, 2),
        "fwd_ms": round(result["fwd_ms"], 2), "bwd_ms": round(result["bwd_ms"], 2),
        "peak_gib": round(result["peak_bytes"] / 2**30, 3), "tensors_gib": round(tensors / 2**30, 3),
        "finite": result["finite"],
    }
    print(json.dumps(row))
    append_rows(out, [row])
    return row


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("long", help="one causal fwd+bwd step over a single long sequence (default 1M tokens)")
    p.add_argument("--n", type=int, default=1 << 20, help="sequence length")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    add_output_options(p)
    p.set_defaults(func=main)


def main(args) -> int:
    if not torch.cuda.is_available():
        print("onlineattn bench long needs a CUDA device")
        return 2
    run(args.n, args.heads, args.d, out=None if args.no_write else args.out, commit=args.commit)
    return 0
