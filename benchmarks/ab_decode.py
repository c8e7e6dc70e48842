"""Time one-token decode at chosen shapes, ours beside SDPA's default in the same process, for A/B runs of two trees.

Run it once per tree, alternating trees in separate processes (PYTHONPATH picks the tree), and compare the lines:

    for r in 1 2; do for t in .base/src src; do
      PYTHONPATH=$t python3 benchmarks/ab_decode.py --label $t --shapes 32:8:1:32768,32:1:1:8192
    done; done

Shapes are ``Hq:Hkv:B:L`` (d 128, bf16, contiguous cache, every sequence L long). ``--timing``: ``graph`` (the
default), medians in µs of ``triton.testing.do_bench_cudagraph`` (kernel time, no launch overhead; a cache that fits
in L2 is read from L2); ``cold``, the bench's cold timing (L2 cleared before each call, the host hidden); ``host``,
the host µs of one eager call, with the GPU held busy so that no call waits for it (where an eager row times the
host, this is why); ``eager``, the bench's default timing (``do_bench`` after the bench's GPU warm-up, under
no_grad), which times the host wherever the host takes longer than do_bench's L2 clear and the call. ``--causal``
passes ``causal=True`` (one query token: the same result; the launcher picks its causal build where that reads
faster). ``--set NAME=VALUE`` overrides an integer of ``onlineattn.ops._decode_configs`` for this process (a rule's
threshold, for example ``MERGE_TREE_MAX_ROWS=32``); ``--splits`` forces a split count; ``--no-tma`` keeps pointer
loads wherever the launcher would stream K and V by TMA. Each line also names the
tile, split count and merge the launcher chose.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton.testing

from onlineattn.api import attention_with_kvcache
from onlineattn.bench.decode import _time as bench_time
from onlineattn.bench.rows import time_cold
from onlineattn.ops import _decode_configs as C
from onlineattn.ops import decode as D


def _time_us(fn, timing: str) -> float:
    fn(), fn()
    torch.cuda.synchronize()
    if timing == "host":
        return _host_us(fn)
    if timing == "eager":
        return 1e3 * bench_time(fn, "eager")
    return 1e3 * (time_cold(fn) if timing == "cold" else
                  triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _host_us(fn, calls: int = 200) -> float:
    """Host µs per eager call, the GPU held busy by a sleep kernel so that no call waits for it (median of 5)."""
    times = []
    for _ in range(5):
        torch.cuda._sleep(calls * 200_000)  # ~100 µs a call at the H200's clock: longer than the host takes
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[2]


def _choice() -> str:
    """The tile, splits and merge of the step the last call launched (the launcher's cached choice)."""
    step = next(reversed(D._STEPS.values()))
    chosen = next(reversed(step.lengths.values()))
    config, splits, merge = chosen.tile, chosen.splits, chosen.merge
    return f"bn{config.block_n}s{config.num_stages}x{config.per_sm} splits {splits} node {merge['MERGE_SPLITS']}" + (
        " tree" if merge["MERGE_TREE"] else "") + (" tma" if chosen.tma else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="tree")
    p.add_argument("--shapes", required=True, help="comma-separated Hq:Hkv:B:L")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--timing", choices=("graph", "cold", "host", "eager"), default="graph")
    p.add_argument("--splits", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--head-major", action="store_true",
                   help="our caches as views of [B, Hkv, L, d] memory (SDPA's layout) instead of [B, L, Hkv, d]")
    p.add_argument("--no-tma", action="store_true", help="pointer loads wherever the launcher would take TMA")
    args = p.parse_args()
    if args.no_tma:
        D._tma = lambda *_: False
    for item in args.set:
        name, value = item.split("=")
        if type(getattr(C, name, None)) is not int:  # not a bool flag, not a missing name
            raise SystemExit(f"--set: {name} is not an integer of _decode_configs")
        setattr(C, name, int(value))
        if hasattr(D, name):  # decode.py imports a few (DECODE_WIDE_ROWS, INTERPRETER_SMS) by value
            setattr(D, name, int(value))
    for shape in args.shapes.split(","):
        hq, hkv, b, length = (int(x) for x in shape.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        if args.head_major:
            k, v = (torch.randn(b, hkv, length, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                    for _ in "kv")
        else:
            k, v = (torch.randn(b, length, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        D._STEPS.clear()
        ours = _time_us(lambda: attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=args.causal,
                                                        num_splits=args.splits, check_indices=False), args.timing)
        line = f"{args.label} {hq}/{hkv} B={b} L={length}: ours {ours:.2f} ({_choice()})"
        if not args.no_sdpa:
            qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            sdpa = _time_us(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
                            args.timing)
            line += f" sdpa {sdpa:.2f} ({sdpa / ours:.3f}x)"
        print(line, flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
