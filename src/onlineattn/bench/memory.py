"""Peak extra memory of one call, measured rather than computed.

On CUDA it reads the caching allocator's peak (``torch.cuda.max_memory_allocated``). On the CPU it reads the process's
resident-set high-water mark (``VmHWM`` in ``/proc/self/status``) after resetting it through ``/proc/self/clear_refs``,
so the figure counts every page the call touched, whatever allocated it.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in {_STATUS}")


def cpu_peak_supported() -> bool:
    """Whether this OS lets us reset and read the resident-set peak (Linux 4.0+)."""
    try:
        _CLEAR_REFS.write_text("5")
        _status_bytes("VmHWM:")
    except (OSError, RuntimeError):
        return False
    return True


def _release_freed_heap() -> None:
    """Hand freed heap pages back to the OS. glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB)
    resident, so without this an earlier call's buffers count as "already there" and the peak reads too low."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure is then a lower bound
        pass


def peak_extra_bytes(fn, device: torch.device | str = "cpu"):
    """Run ``fn()`` and return ``(result, bytes)``: how far memory rose above where it stood before the call."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    if not cpu_peak_supported():
        raise RuntimeError("measuring CPU peak memory needs Linux's /proc/self/clear_refs")
    _release_freed_heap()
    _CLEAR_REFS.write_text("5")
    before = _status_bytes("VmRSS:")
    result = fn()
    return result, max(0, _status_bytes("VmHWM:") - before)


# ---------------------------------------------------------------------------------------------------------
# `onlineattn bench memory`: peak memory vs N, onlineattn against the textbook and SDPA's backends

CUDA_SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
CPU_SEQLENS = (512, 1024, 2048, 4096)
QUICK_SEQLENS = {"cuda": (1024, 4096, 16384), "cpu": (512, 2048)}
MODES = ("fwd", "fwdbwd")


def _providers(device: str) -> dict:
    """``name -> fn(q, k, v, causal) -> o`` on ``[B, S, H, D]`` tensors. ``naive`` is the textbook (it holds the
    ``[B, H, N, N]`` scores); the SDPA rows pin one backend each (on the CPU, its default and math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import reference
    from ..api import attention

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
            return o.transpose(1, 2)

        return run

    providers = {
        "onlineattn": lambda q, k, v, causal: attention(q, k, v, causal=causal),
        "naive": lambda q, k, v, causal: reference.torch_math_attention(q, k, v, causal=causal)[0],
        "sdpa-math": sdpa(SDPBackend.MATH),
    }
    if device == "cuda":
        providers |= {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
                      "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    else:
        providers["sdpa-default"] = sdpa([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return providers


def measure(fn, mode: str, n: int, *, heads: int, d: int, causal: bool, dtype, device: str) -> tuple[float, int]:
    """``(ms, peak extra bytes)`` of one call (``fwd``, no graph) or one training step (``fwdbwd``) at length ``n``,
    B = 1. The inputs (and dO) exist before the measurement starts, so the figure is what the call itself adds."""
    import time

    gen = torch.Generator(device=device).manual_seed(n)
    q, k, v, do = (torch.randn(1, n, heads, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    if mode == "fwdbwd":
        q, k, v = (x.requires_grad_() for x in (q, k, v))

    def call():
        if mode == "fwd":
            with torch.no_grad():
                return fn(q, k, v, causal)
        fn(q, k, v, causal).backward(do)
        return q.grad

    start = time.perf_counter()
    result, extra = peak_extra_bytes(call, device)
    ms = (time.perf_counter() - start) * 1e3
    del result
    return ms, extra


def run(seqlens, names, modes, *, heads: int, d: int, causal: bool, out: Path | None, commit: str | None = None):
    """Measure every (mode, N, provider); print MiB; append rows (op ``memory``, fields ``mode``, ``peak_bytes``)."""
    from .progress import Progress
    from .rows import append_rows, environment

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    providers = _providers(device)
    names = [n for n in names if n in providers]
    env = environment(commit)
    rows = []
    print(f"peak extra memory (MiB), B=1 H={heads} d={d} causal={causal} {str(dtype).replace('torch.', '')} on "
          f"{env['gpu']}")
    print(f"{'mode':7} {'N':>6} " + " ".join(f"{n:>14}" for n in names))
    warm = min(seqlens)
    for name in names:  # first calls load code and kernels; that is not the call's memory
        measure(providers[name], "fwd", warm, heads=heads, d=d, causal=causal, dtype=dtype, device=device)
    bar = Progress(len(modes) * len(seqlens) * len(names), "memory")
    for mode in modes:
        for n in seqlens:
            cells = []
            for name in names:
                bar.step(f"{mode} N={n} {name}")
                try:
                    ms, extra = measure(providers[name], mode, n, heads=heads, d=d, causal=causal, dtype=dtype,
                                        device=device)
                except (RuntimeError, MemoryError) as err:  # out of memory, or a backend refusing the shape
                    cells.append(f"{'n/a':>14}")
                    bar.print(f"  {name} {mode} N={n}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                cells.append(f"{extra / 2**20:14.1f}")
                rows.append({
                    **env, "op": "memory", "mode": mode, "provider": name, "dtype": str(dtype).replace("torch.", ""),
                    "B": 1, "Hq": heads, "Hkv": heads, "Sq": n, "Sk": n, "d": d, "causal": causal,
                    "ms": round(ms, 3), "peak_bytes": int(extra),
                })
            bar.print(f"{mode:7} {n:6} " + " ".join(cells))
    bar.close()
    append_rows(out, rows)
    return rows


def add_parser(subparsers) -> None:
    from .rows import add_output_options

    p = subparsers.add_parser(
        "memory", help="peak memory vs N: onlineattn, the textbook and SDPA's backends (CUDA; CPU fallback)",
        description="Peak extra memory of one forward (fwd) and one training step (fwdbwd) as N doubles, B = 1. On "
        "CUDA: bf16, the caching allocator's peak. Without CUDA: float32, the process's resident-set peak, rows to "
        "benchmarks/results/cpu.jsonl unless --out says otherwise.")
    p.add_argument("--n", type=int, nargs="*", default=None, help=f"lengths (default: {CUDA_SEQLENS} on CUDA, "
                   f"{CPU_SEQLENS} on CPU)")
    p.add_argument("--heads", type=int, default=None, help="heads (default: 16 on CUDA, 4 on CPU)")
    p.add_argument("--d", type=int, default=None, help="head dim (default: 128 on CUDA, 64 on CPU)")
    p.add_argument("--causal", action="store_true", help="causal masking (default: off)")
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--providers", nargs="*", default=None,
                   help="default: onlineattn naive sdpa-math, and sdpa-flash sdpa-efficient sdpa-cudnn on CUDA "
                   "(sdpa-default on CPU)")
    p.add_argument("--quick", action="store_true", help=f"lengths {QUICK_SEQLENS}")
    add_output_options(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from .rows import CPU_OUT, DEFAULT_OUT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not cpu_peak_supported():
        print("onlineattn bench memory without CUDA needs Linux's /proc/self/clear_refs")
        return 2
    seqlens = args.n or (QUICK_SEQLENS[device] if args.quick else CUDA_SEQLENS if device == "cuda" else CPU_SEQLENS)
    heads = args.heads or (16 if device == "cuda" else 4)
    d = args.d or (128 if device == "cuda" else 64)
    out = None if args.no_write else (CPU_OUT if device == "cpu" and args.out == DEFAULT_OUT else args.out)
    names = args.providers or list(_providers(device))
    modes = MODES if args.mode == "all" else (args.mode,)
    run(seqlens, names, modes, heads=heads, d=d, causal=args.causal, out=out, commit=args.commit)
    return 0
