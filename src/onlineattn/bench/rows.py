"""What every ``onlineattn bench`` subcommand shares: a row's environment fields, the output options, the JSON-lines
file that rows are appended to (ENGINEERING.md section 5; rows are never edited or deleted), the GPU warm-up
before each timed point, and the timing of a call's device work alone (``time_cold``: the ``+cold`` rows)."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path("benchmarks/results/h200.jsonl")
CPU_OUT = Path("benchmarks/results/cpu.jsonl")  # where CPU fallbacks (``bench memory`` without CUDA) append


def environment(commit: str | None) -> dict:
    """``date``, ``commit`` (default: ``git rev-parse --short HEAD``), ``gpu`` (``"cpu"`` without CUDA), ``torch``
    and ``triton`` (``"none"`` where it is not installed) of a row."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if commit is None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
    }


def add_output_options(p) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON-lines file the rows are appended to")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--commit", default=None, help="commit measured (default: git rev-parse)")


def append_rows(out: Path | None, rows) -> None:
    """Append one JSON line per row to ``out`` (nothing when ``out`` is None, as with ``--no-write``)."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


WARM_UP_SECONDS = 0.25


def warm_up_gpu(seconds: float = WARM_UP_SECONDS) -> int:
    """Keep the GPU busy with bfloat16 matmuls for about ``seconds``. The bench calls it before each timed point,
    after the point's first call (its compile, which can leave the GPU idle for seconds), so every point starts at
    the clocks of a busy GPU: the first point of a pass had read low (NOTES v14: d = 256 causal N = 512 200.5 in one
    pass, 331.1 in the next), whichever provider came first. Returns the matmuls run (none without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    done = 0
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        done += 8
        torch.cuda.synchronize()
    del a
    return done


def time_cold(fn, reps: int = 200, warmup: int = 10, hold_cycles: int = 200_000) -> float:
    """Median milliseconds of ``fn``'s device work with its data in HBM: before each call the L2 is cleared (as in
    ``do_bench``) and a sleep kernel of ``hold_cycles`` (200,000: ~100 µs at the H200's clock) is enqueued, so the
    host has enqueued the call before the GPU reaches it and the events around it time the kernels alone. The hold
    must outlast the call's host path; where it does not, host time shows between the events."""
    from triton import runtime

    clear = runtime.driver.active.get_empty_cache_for_benchmark()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(warmup):
        fn()
    for start, end in zip(starts, ends):
        runtime.driver.active.clear_cache(clear)
        torch.cuda._sleep(hold_cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in zip(starts, ends))[reps // 2]
