"""onlineattn's blockwise torch path against PyTorch's SDPA, both on the CPU.

Cases: q, k, v of ``[B=1, N, H=8, d=64]`` float32 for N = 1024, 2048, 4096, non-causal and causal, forward
(``fwd``) and forward + backward (``fwdbwd``). Each case is timed as the median of several calls after a warm-up,
on random normal inputs, and printed with the ratio ours / SDPA (the target is <= 1.5).

Each measurement is appended as one JSON line to ``benchmarks/results/cpu.jsonl`` (``--no-write`` prints only):
``{"date","commit","gpu":"cpu","torch","triton","op","provider","dtype","B","Hq","Hkv","Sq","Sk","d","causal",
"ms","tflops"}``, where FLOPs are 4·B·H·Sq·Sk·d for the forward, halved when causal, and 3.5× that for fwd+bwd.

    .venv/bin/python benchmarks/cpu_vs_sdpa.py [--no-write] [--repeats 5] [--sizes 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

import onlineattn

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "cpu.jsonl"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
DTYPE = torch.float32
PROVIDERS = ("onlineattn-torch", "sdpa-cpu")
OPS = ("fwd", "fwdbwd")
BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs, so fwd+bwd is 3.5× fwd


def forward_flops(n: int, causal: bool) -> float:
    flops = 4.0 * BATCH * HEADS * n * n * HEAD_DIM
    return flops / 2 if causal else flops


def op_flops(op: str, n: int, causal: bool) -> float:
    return forward_flops(n, causal) * (1.0 if op == "fwd" else 1.0 + BWD_FACTOR)


def git_commit() -> str:
    """Short hash of HEAD, or ``"uncommitted"`` when there is no commit (or no git)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"
    return done.stdout.strip() or "uncommitted"


def _triton_version() -> str:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "none"


def make_calls(n: int, causal: bool, op: str, gen: torch.Generator) -> dict:
    """One zero-argument callable per provider, on the same random inputs in each provider's native layout.

    Ours takes ``[B, N, H, d]``; SDPA takes ``[B, H, N, d]``. Both get contiguous tensors, so neither pays for a
    transpose the other does not. For ``fwdbwd`` the gradients are dropped before each call, so no call pays for
    accumulating into the previous call's.
    """
    needs_grad = op == "fwdbwd"
    shape = (BATCH, n, HEADS, HEAD_DIM)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=DTYPE) for _ in range(4))
    ours_in = [x.clone().requires_grad_(needs_grad) for x in (q, k, v)]
    sdpa_in = [x.transpose(1, 2).contiguous().requires_grad_(needs_grad) for x in (q, k, v)]
    do_sdpa = do.transpose(1, 2).contiguous()

    def ours():
        return onlineattn.attention(*ours_in, causal=causal, backend="torch")

    def sdpa():
        # With Sq = Sk, SDPA's top-left causal alignment equals our bottom-right one.
        return F.scaled_dot_product_attention(*sdpa_in, is_causal=causal)

    if not needs_grad:
        return {"onlineattn-torch": ours, "sdpa-cpu": sdpa}

    def with_backward(fn, inputs, grad_out):
        def call():
            for x in inputs:
                x.grad = None
            fn().backward(grad_out)

        return call

    return {
        "onlineattn-torch": with_backward(ours, ours_in, do),
        "sdpa-cpu": with_backward(sdpa, sdpa_in, do_sdpa),
    }


def check_agreement(n: int, causal: bool, gen: torch.Generator) -> float:
    """Max |ours − SDPA| of the forward on one input: a timing of a wrong answer is worth nothing."""
    q, k, v = (torch.randn(BATCH, n, HEADS, HEAD_DIM, generator=gen, dtype=DTYPE) for _ in range(3))
    ours = onlineattn.attention(q, k, v, causal=causal, backend="torch")
    theirs = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    return float((ours - theirs.transpose(1, 2)).abs().max())


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def row(provider: str, op: str, n: int, causal: bool, ms: float, stamp: dict) -> dict:
    return {
        **stamp,
        "op": op,
        "provider": provider,
        "dtype": str(DTYPE).replace("torch.", ""),
        "B": BATCH,
        "Hq": HEADS,
        "Hkv": HEADS,
        "Sq": n,
        "Sk": n,
        "d": HEAD_DIM,
        "causal": causal,
        "ms": round(ms, 4),
        "tflops": round(op_flops(op, n, causal) / (ms * 1e-3) / 1e12, 5),
    }


def parse_args(argv=None) -> argparse.Namespace:
    def positive(text):
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        return value

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=positive, nargs="+", default=[1024, 2048, 4096], help="sequence lengths N")
    p.add_argument("--repeats", type=positive, default=5, help="timed calls per case; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--no-write", action="store_true", help=f"print the table only; do not append to {RESULTS}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    stamp = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "gpu": "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
    }
    gen = torch.Generator().manual_seed(0)
    print(
        f"onlineattn torch path vs SDPA on the CPU ({torch.get_num_threads()} threads), "
        f"{str(DTYPE).replace('torch.', '')}, B={BATCH}, H={HEADS}, d={HEAD_DIM}; "
        f"median of {args.repeats} after {args.warmup} warm-up; commit {stamp['commit']}"
    )
    print(f"{'N':>5} {'causal':>6} {'op':>6} {'ours ms':>9} {'SDPA ms':>9} {'ours/SDPA':>9} "
          f"{'ours TFLOPS':>11} {'SDPA TFLOPS':>11} {'max|diff|':>9}")
    rows = []
    for n in args.sizes:
        for causal in (False, True):
            diff = check_agreement(n, causal, gen)
            for op in OPS:
                calls = make_calls(n, causal, op, gen)
                ms = {name: median_ms(calls[name], args.warmup, args.repeats) for name in PROVIDERS}
                new = [row(name, op, n, causal, ms[name], stamp) for name in PROVIDERS]
                rows += new
                ours, sdpa = new
                print(f"{n:>5} {str(causal):>6} {op:>6} {ours['ms']:>9.1f} {sdpa['ms']:>9.1f} "
                      f"{ours['ms'] / sdpa['ms']:>9.2f} {ours['tflops']:>11.3f} {sdpa['tflops']:>11.3f} {diff:>9.1e}")
    if args.no_write:
        print("(--no-write: no rows appended)")
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"appended {len(rows)} rows to {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
