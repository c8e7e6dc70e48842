"""``onlineattn demo``: the online-softmax idea made visible, with embedded defaults.

It does three things, in this order:

1. **Exactness.** One query against N = 4096 keys (``q [1, 1, 1, 64]``, ``k, v [1, 4096, 1, 64]``) in float64:
   the blockwise recurrence of ``reference.online_attention`` (block 64) against ``reference.naive_attention``,
   printed as ``exactness: max|online - naive| = <x>``.
2. **Memory and time.** For N in a doubling range it runs textbook attention (which materialises the
   ``[B, H, N, N]`` scores) and ``onlineattn.attention`` on ``q, k, v [1, N, 4, 64]`` and prints the measured peak
   extra memory and the median wall time of each. Runs on CUDA when present, else on the CPU.
3. **Plot.** Writes a two-panel PNG (memory vs N, time vs N, log-log) when matplotlib is importable.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import reference
from .api import _resolve_backend, attention
from .bench.memory import peak_extra_bytes

SEED = 0
EXACT_KEYS, EXACT_HEAD_DIM, EXACT_BLOCK = 4096, 64, 64
EXACT_TOLERANCE = 1e-12
MIB = 2.0**20


@dataclass(frozen=True)
class Setup:
    """What the memory/time sweep runs: ``q, k, v [batch, N, heads, head_dim]`` for each N in ``sizes``."""

    device: torch.device
    dtype: torch.dtype
    sizes: tuple[int, ...]
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    min_repeats: int = 3  # timed calls per point, more while they fit in budget_s; the median is reported
    max_repeats: int = 10
    budget_s: float = 0.5


@dataclass(frozen=True)
class Point:
    """One N of the sweep: peak extra memory in MiB and median time in ms, for naive and onlineattn."""

    n: int
    naive_mib: float
    ours_mib: float
    naive_ms: float
    ours_ms: float


def doubling(start: int, stop: int) -> tuple[int, ...]:
    """Sizes ``start, 2·start, ...`` up to and including ``stop``; just ``(stop,)`` when ``stop < start``.

    >>> doubling(512, 8192)
    (512, 1024, 2048, 4096, 8192)
    >>> doubling(512, 3000)
    (512, 1024, 2048)
    >>> doubling(512, 100)
    (100,)
    """
    if stop < start:
        return (stop,)
    sizes = [start]
    while sizes[-1] * 2 <= stop:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def default_setup(max_n: int | None = None) -> Setup:
    """CPU: float32, N = 512..8192 (under a minute on 2 cores). CUDA: float16, N = 1024..32768."""
    if torch.cuda.is_available():
        device, dtype, start, stop = torch.device("cuda"), torch.float16, 1024, 32768
    else:
        device, dtype, start, stop = torch.device("cpu"), torch.float32, 512, 8192
    return Setup(device=device, dtype=dtype, sizes=doubling(start, max_n or stop))


def exactness_error(seed: int = SEED) -> float:
    """Max |online − naive| in float64 for one query against ``EXACT_KEYS`` keys, online in blocks of 64."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 1, EXACT_HEAD_DIM))
    k = rng.standard_normal((1, EXACT_KEYS, 1, EXACT_HEAD_DIM))
    v = rng.standard_normal((1, EXACT_KEYS, 1, EXACT_HEAD_DIM))
    online = reference.online_attention(q, k, v, block=EXACT_BLOCK)
    naive = reference.naive_attention(q, k, v)
    return float(np.abs(online - naive).max())


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook ``softmax(q kᵀ / sqrt(D)) v`` in torch, materialising the ``[B, H, Sq, Sk]`` scores.

    q ``[B, Sq, H, D]``, k ``[B, Sk, H, D]``, v ``[B, Sk, H, Dv]`` -> ``[B, Sq, H, Dv]``. Only the baseline of the
    memory/time comparison: the oracle for correctness is ``onlineattn.reference``.
    """
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(fn, device: torch.device) -> float:
    _, extra = peak_extra_bytes(fn, device)
    return extra / MIB


def _median_ms(fn, setup: Setup) -> float:
    """Median wall time of ``min_repeats`` to ``max_repeats`` calls: small N gets more calls, so noise counts less."""
    times = []
    while len(times) < setup.min_repeats or (len(times) < setup.max_repeats and sum(times) < setup.budget_s * 1e3):
        _sync(setup.device)
        start = time.perf_counter()
        fn()
        _sync(setup.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(setup: Setup, log=print) -> list[Point]:
    """Run the sweep. Each implementation's memory call comes first and doubles as the warm-up of its timing."""
    gen = torch.Generator(device=setup.device).manual_seed(SEED)

    def inputs(n):
        shape = (setup.batch, n, setup.heads, setup.head_dim)
        return [torch.randn(shape, generator=gen, device=setup.device, dtype=setup.dtype) for _ in range(3)]

    # One small call of each first, so one-off start-up costs (thread pools, kernel compilation) land nowhere.
    q, k, v = inputs(min(setup.sizes))
    naive_attention(q, k, v)
    attention(q, k, v)

    points = []
    for n in setup.sizes:
        q, k, v = inputs(n)
        results = {}
        for name, fn in (("naive", lambda: naive_attention(q, k, v)), ("ours", lambda: attention(q, k, v))):
            results[name] = (_peak_mib(fn, setup.device), _median_ms(fn, setup))
        point = Point(n, results["naive"][0], results["ours"][0], results["naive"][1], results["ours"][1])
        log(_format_row(point))
        points.append(point)
        del q, k, v
    return points


_HEADER = f"{'N':>6}  {'naive MiB':>10}  {'onlineattn MiB':>14}  {'naive ms':>9}  {'onlineattn ms':>13}"


def _format_row(p: Point) -> str:
    return f"{p.n:>6}  {p.naive_mib:>10.1f}  {p.ours_mib:>14.1f}  {p.naive_ms:>9.1f}  {p.ours_ms:>13.1f}"


def describe(setup: Setup) -> str:
    """One line naming the device, dtype and shapes of the sweep, and the backend ``attention`` picks there."""
    dtype = str(setup.dtype).replace("torch.", "")
    if setup.device.type == "cuda":
        where = f"cuda ({torch.cuda.get_device_name(setup.device)})"
    else:
        where = f"cpu ({torch.get_num_threads()} threads)"
    backend = _resolve_backend("auto", q=torch.empty(0, device=setup.device))
    shapes = f"q/k/v [B={setup.batch}, N, H={setup.heads}, d={setup.head_dim}]"
    return f"{where}, {dtype}, {shapes}, onlineattn backend: {backend}"


def plot(points: list[Point], setup: Setup, out: Path) -> bool:
    """Write the two-panel log-log PNG to ``out``; return False (and say so) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written (pip install 'onlineattn[plots]')")
        return False

    ns = [p.n for p in points]
    # Log axes cannot show 0, which a measurement below the page granularity can read; leave such points out.
    positive = lambda values: [x if x > 0 else float("nan") for x in values]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    panels = (
        (ax_mem, "peak extra memory (MiB)", "naive_mib", "ours_mib"),
        (ax_time, "time per call (ms, median)", "naive_ms", "ours_ms"),
    )
    for ax, ylabel, naive_key, ours_key in panels:
        ax.plot(ns, positive(getattr(p, naive_key) for p in points), "o-", color="tab:red",
                label="naive: softmax(QKᵀ)V, materialises N×N scores")
        ax.plot(ns, positive(getattr(p, ours_key) for p in points), "s-", color="tab:blue",
                label="onlineattn.attention (online softmax)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("sequence length N (queries = keys)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax_mem.set_title("memory: O(N²) vs O(N)")
    ax_time.set_title("time: both O(N²) work")
    fig.suptitle(describe(setup), fontsize=10)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def run(out: str | Path = "demo.png", max_n: int | None = None) -> int:
    """The whole demo; returns the process exit code (1 if the exactness check fails)."""
    err = exactness_error()
    print(f"exactness: max|online - naive| = {err:.3e}")
    print(
        f"  (float64, one query against {EXACT_KEYS} keys, d={EXACT_HEAD_DIM}, online in blocks of {EXACT_BLOCK})"
    )

    setup = default_setup(max_n)
    print()
    print(f"peak extra memory and time, {describe(setup)}")
    print(
        f"  memory: measured peak above the starting point; "
        f"time: median of {setup.min_repeats} to {setup.max_repeats} calls"
    )
    print(_HEADER)
    points = measure(setup)

    out = Path(out)
    if plot(points, setup, out):
        print(f"\nwrote {out}")
    if err > EXACT_TOLERANCE:
        print(f"error: the exactness gap {err:.3e} exceeds {EXACT_TOLERANCE:g}")
        return 1
    return 0
