"""Time the forward or backward through the table at a few grid points, for A/B runs of two trees on one GPU.

Run it once per tree, alternating trees in separate processes (PYTHONPATH picks the tree), and compare the lines:

    for r in 1 2; do for t in .base/src src; do
      PYTHONPATH=$t python3 benchmarks/ab_time.py --label $t --mode bwd --points 128:1:512,128:1:1024 --det both
    done; done

Points are ``d:causal:N`` on the bench grid (bf16, H = 2048 / d, B = 16384 / N). ``--timing graph`` (the default)
takes ``triton.testing.do_bench_cudagraph``'s mean of graph replays (as NOTES v22's sweeps did) over the launchers
(``ops.forward.forward`` / ``ops.backward.backward`` with the table's config), once; ``--timing bench`` takes the
bench's own measurement (``bench.prefill._timed``: autograd after a GPU warm-up, ``do_bench``), ``--repeat`` times,
which is where the rows' spread between runs shows. ``--det`` picks the backward's deterministic setting (the
``onlineattn`` provider is deterministic, ``onlineattn-nondet`` is not).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from onlineattn.bench import prefill
from onlineattn.ops import backward as B
from onlineattn.ops import forward as F


def _graph_ms(mode: str, q, k, v, causal: bool, det: bool) -> float:
    scale = q.shape[-1] ** -0.5
    o, lse = F.forward(q, k, v, scale, causal)
    if mode == "fwd":
        fn = lambda: F.forward(q, k, v, scale, causal)  # noqa: E731
    else:
        do = torch.randn_like(q)
        fn = lambda: B.backward(do, q, k, v, o, lse, scale, causal, deterministic=det)  # noqa: E731
    fn(), fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="tree")
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--points", required=True, help="comma-separated d:causal:N, e.g. 128:1:512,64:0:2048")
    p.add_argument("--det", choices=("1", "0", "both"), default="both", help="backward: deterministic or not")
    p.add_argument("--timing", choices=("graph", "bench"), default="graph")
    p.add_argument("--repeat", type=int, default=3, help="bench timing: measurements per point")
    args = p.parse_args()
    dets = {"1": (True,), "0": (False,), "both": (True, False)}[args.det] if args.mode == "bwd" else (True,)
    for point in args.points.split(","):
        d, causal, n = (int(x) for x in point.split(":"))
        b, h = 16384 // n, 2048 // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = prefill.Case(b, h, n, d, bool(causal)).flops(args.mode)
        for det in dets:
            if args.timing == "graph":
                ms = [_graph_ms(args.mode, q, k, v, bool(causal), det)]
            else:
                fn = prefill._ours if det else prefill._ours_any_order
                ms = [prefill._timed(fn, args.mode, q, k, v, bool(causal)) for _ in range(args.repeat)]
            tag = "" if args.mode == "fwd" else (" det" if det else " nondet")
            print(f"{args.label:10} {args.mode} d={d:3} causal={causal} N={n:5}{tag:7} "
                  + " ".join(f"{flops / m / 1e9:6.1f}" for m in ms) + " TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
