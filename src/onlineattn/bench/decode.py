"""`onlineattn bench decode`: one query token per sequence against a KV cache, with SDPA measured in the same run.

Grid (issue #5; peers in ``../shared/anchors/h200-peers.md``): B ∈ {1, 16, 64}, L ∈ {4k, 32k, 128k}, Hq 32, Hkv 8,
d 128, bf16. TB/s counts the K and V bytes read, ``B · L · Hkv · (d + dv) · bytes per element``; the query, the output
and (for split-KV) the float32 partials are not counted. Each measurement becomes one JSON line (ENGINEERING.md §5)
with op ``decode`` and field ``tbps``.

Providers. Every one attends one new query token over L cached tokens (``Sq = 1``: causal or not is the same, so
every row says ``causal: false``), on its own copy of random normal K/V, built before and freed after its timing:

- ``onlineattn``: ``attention_with_kvcache`` on a contiguous cache ``[B, L, Hkv, d]``, ``cache_seqlens`` an int32
  device tensor, ``check_indices=False``: what a decode loop through ``onlineattn.cache`` runs (the caches know their
  indices on the host, so no device-to-host check per step).
- ``onlineattn-checked``: the same with the default ``check_indices=True``, which reads the lengths back to the host
  once per call: the row shows what that synchronisation costs.
- ``onlineattn-paged``: a page pool (``--page-size``, 256 by default) with a random block table, ``check_indices=False``.
- ``sdpa-default``: ``F.scaled_dot_product_attention(q [B, Hq, 1, d], k, v [B, Hkv, L, d], enable_gqa=True)``,
  SDPA's own backend choice, on K/V in its own contiguous layout.
- ``sdpa-flash``: the same, forced to the flash backend.

Timing. By default ``triton.testing.do_bench``: L2 cleared before each call, CUDA events around it. Where the host
takes longer to enqueue a call than the GPU takes to run the clear and the call (B = 1 at short L: on the H200's
host one eager call at B = 1, L = 4k, SDPA's included, took ~40-60 µs of Python and C++ in one run), the events time
the host, not the kernel. Two other modes, named in the provider (``+graph``, ``+cold``):

- ``--cuda-graph``: ``triton.testing.do_bench_cudagraph``: no launch overhead, and no L2 clearing, so a cache that
  fits in L2 (B = 1, L = 4k: 16 MiB) is read from L2.
- ``--cold``: ``time_cold``: L2 cleared before each call, then a sleep kernel holds the GPU while the host enqueues
  the call, so the events time the call's own device work from HBM: the cost of an eager decode step whose layer's
  K/V was evicted by the rest of the model, without the host.

In both, a provider that waits for the GPU inside the call (``onlineattn-checked``) is reported as n/a: a graph
cannot capture it, and under ``--cold`` its wait would put host time between the events (the ``+cold`` rows of
that provider at 943df2b and 13102d7 are such: host time, not device time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .progress import Progress
from .rows import add_output_options, append_rows, environment, time_cold, warm_up_gpu

BATCHES = (1, 16, 64)
LENGTHS = (4096, 32768, 131072)
QUICK_BATCHES = (1, 64)
QUICK_LENGTHS = (4096, 32768)


@dataclass(frozen=True)
class Case:
    b: int
    length: int
    hq: int = 32
    hkv: int = 8
    d: int = 128

    def kv_bytes(self, element_size: int) -> int:
        return 2 * self.b * self.length * self.hkv * self.d * element_size


def _randn(*shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def _ours(check_indices: bool, num_splits: int):
    def setup(case: Case, dtype, page_size):
        from ..api import attention_with_kvcache

        q = _randn(case.b, 1, case.hq, case.d, dtype=dtype, seed=1)
        k, v = (_randn(case.b, case.length, case.hkv, case.d, dtype=dtype, seed=s) for s in (2, 3))
        lens = torch.full((case.b,), case.length, dtype=torch.int32, device="cuda")
        return lambda: attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=False, num_splits=num_splits,
                                              check_indices=check_indices)

    return setup


def _ours_paged(num_splits: int):
    def setup(case: Case, dtype, page_size):
        from ..api import attention_with_kvcache

        per_seq = -(-case.length // page_size)
        q = _randn(case.b, 1, case.hq, case.d, dtype=dtype, seed=1)
        k, v = (_randn(case.b * per_seq, page_size, case.hkv, case.d, dtype=dtype, seed=s) for s in (2, 3))
        gen = torch.Generator().manual_seed(4)
        table = torch.randperm(case.b * per_seq, generator=gen).reshape(case.b, per_seq).int().cuda()
        lens = torch.full((case.b,), case.length, dtype=torch.int32, device="cuda")
        return lambda: attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, causal=False,
                                              num_splits=num_splits, check_indices=False)

    return setup


def _sdpa(backend_name: str | None):
    def setup(case: Case, dtype, page_size):
        import contextlib

        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = _randn(case.b, case.hq, 1, case.d, dtype=dtype, seed=1)
        k, v = (_randn(case.b, case.hkv, case.length, case.d, dtype=dtype, seed=s) for s in (2, 3))

        def run():
            context = sdpa_kernel(getattr(SDPBackend, backend_name)) if backend_name else contextlib.nullcontext()
            with context:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return run

    return setup


def providers(num_splits: int = 0):
    return {
        "onlineattn": _ours(check_indices=False, num_splits=num_splits),
        "onlineattn-checked": _ours(check_indices=True, num_splits=num_splits),
        "onlineattn-paged": _ours_paged(num_splits),
        "sdpa-default": _sdpa(None),
        "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    }


PROVIDER_NAMES = tuple(providers())


TIMINGS = {"eager": "", "graph": "+graph", "cold": "+cold"}  # timing mode -> provider suffix
# Providers that wait for the GPU inside the call (onlineattn-checked reads the lengths back to the host): under
# --cold that wait outlasts the hold and the events time host work, and a graph cannot capture them, so neither
# mode reports them.
SYNCHRONISING = frozenset({"onlineattn-checked"})


def _time(fn, timing: str) -> float:
    """Median milliseconds under ``timing`` (module docstring)."""
    import triton.testing

    with torch.no_grad():
        fn()  # compiles: then the warm-up, so the timing starts on a busy GPU
        warm_up_gpu()  # (it synchronises: a graph's capture stream then sees the inputs written)
        if timing == "graph":
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        if timing == "cold":
            return time_cold(fn)
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run(cases, names, *, out: Path | None, commit: str | None = None, dtype=torch.bfloat16, page_size: int = 256,
        num_splits: int = 0, timing: str = "eager"):
    """Measure every (case, provider); print a table of µs (TB/s); append rows to ``out``. Returns the rows."""
    env = environment(commit)
    setups = providers(num_splits)
    suffix = TIMINGS[timing]
    rows = []
    print(f"{'B':>3} {'L':>7} " + " ".join(f"{n + suffix:>22}" for n in names))
    bar = Progress(len(cases) * len(names), "decode")
    for case in cases:
        cells = []
        for name in names:
            bar.step(f"B={case.b} L={case.length} {name}")
            fn = None
            try:
                if timing != "eager" and name in SYNCHRONISING:
                    raise RuntimeError(f"{name} synchronises with the host: not timed {timing}")
                fn = setups[name](case, dtype, page_size)
                ms = _time(fn, timing)
            except RuntimeError as err:  # out of memory, an SDPA backend refusing the shape, a failed capture
                cells.append(f"{'n/a':>22}")
                bar.print(f"  {name} {case}: {str(err).splitlines()[0][:120]}")
                continue
            finally:
                del fn
                torch.cuda.empty_cache()
            tbps = case.kv_bytes(torch.finfo(dtype).bits // 8) / ms / 1e9
            cells.append(f"{ms * 1e3:11.1f}us ({tbps:5.2f})")
            rows.append({
                **env, "op": "decode", "provider": name + suffix, "dtype": str(dtype).replace("torch.", ""),
                "B": case.b, "Hq": case.hq, "Hkv": case.hkv, "Sq": 1, "Sk": case.length, "d": case.d,
                "causal": False, "ms": round(ms, 5), "tbps": round(tbps, 3),
            })
        bar.print(f"{case.b:3} {case.length:7} " + " ".join(cells))
    bar.close()
    append_rows(out, rows)
    return rows


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("decode", help="time one-token decoding over a KV cache against SDPA",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--b", type=int, nargs="*", default=None, help=f"batch sizes (default: {BATCHES})")
    p.add_argument("--L", type=int, nargs="*", default=None, dest="lengths",
                   help=f"cached tokens per sequence (default: {LENGTHS})")
    p.add_argument("--hq", type=int, default=32, help="query heads (default: 32)")
    p.add_argument("--hkv", type=int, default=8, help="kv heads (default: 8)")
    p.add_argument("--d", type=int, default=128, help="head dim (default: 128)")
    p.add_argument("--page-size", type=int, default=256, help="page size of onlineattn-paged (default: 256)")
    p.add_argument("--num-splits", type=int, default=0, help="onlineattn's num_splits (default: 0, automatic)")
    p.add_argument("--providers", nargs="*", default=list(PROVIDER_NAMES), choices=list(PROVIDER_NAMES))
    p.add_argument("--quick", action="store_true", help=f"B in {QUICK_BATCHES}, L in {QUICK_LENGTHS}")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--cuda-graph", action="store_true",
                        help="time with do_bench_cudagraph (no launch overhead, L2 not cleared): providers +graph")
    timing.add_argument("--cold", action="store_true",
                        help="time the device work from HBM, the GPU held ahead of the host: providers +cold")
    add_output_options(p)
    p.set_defaults(func=main)


def main(args) -> int:
    if not torch.cuda.is_available():
        print("onlineattn bench decode needs a CUDA device")
        return 2
    batches = args.b or (QUICK_BATCHES if args.quick else BATCHES)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    cases = [Case(b, length, args.hq, args.hkv, args.d) for b in batches for length in lengths]
    run(cases, args.providers, out=None if args.no_write else args.out, commit=args.commit,
        page_size=args.page_size, num_splits=args.num_splits,
        timing="graph" if args.cuda_graph else "cold" if args.cold else "eager")
    return 0
