"""The launch cache (ops/_launch.py): host time per call and the kernel it launches.

Without a GPU, the active Triton driver is replaced by one that reports an sm_90 target and whose launcher does nothing, so every
launch runs all of Triton's Python (binder, specialisation, cache lookup, launch metadata) and our own, and stops at
the C launch. Kernels compile for sm_90 with Triton's ptxas (cached on disk after the first run).

    python benchmarks/probe_launch.py time            # host µs per forward / backward call, cache off vs on
    python benchmarks/probe_launch.py decode          # host µs of one attention_with_kvcache call (API and op)
    python benchmarks/probe_launch.py step            # host µs of attention + autograd.grad (a training step)
    python benchmarks/probe_launch.py check [i ...]   # every cached launch is the kernel run() would pick
    python benchmarks/probe_launch.py repeat          # kept fwd/bwd launches pass what the full path passes
    python benchmarks/probe_launch.py gpu [i ...]     # on the GPU: outputs bitwise equal with the cache off / on

``check`` runs on the GPU machine too, with the real driver and CUDA tensors. The case indices are those of
tests/ops/test_launch.py's ``CASES``.

``check`` wraps ``launch`` and ``Relaunch.go`` (the kept launches): after each call it asks Triton's own
``run(..., warmup=True)`` for the kernel of the same arguments and requires the very object the cached path launched.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.runtime.jit
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parent.parent


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0, 1024  # module, function, n_regs, n_spills, n_max_threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}


class Sm90NoLaunch:
    """Enough of a CUDA driver for Triton to compile (compile_sm90.py uses it too) and to 'launch': the launch itself
    is a no-op. Set it active before onlineattn is imported with TRITON_INTERPRET unset."""

    utils = _Utils()

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def launcher_cls(self, src, metadata):
        return lambda *args: None


def _cases():
    """(name, forward call, backward call) on CPU tensors (their pointers are 16-byte aligned, as CUDA's are), with
    the H200's config tables (TMA descriptors where they apply) and with the interpreter's (no descriptors)."""
    from onlineattn.ops import backward as B
    from onlineattn.ops import forward as F
    from onlineattn.ops._configs import bwd_config, fwd_config

    b, n, h, d = (int(x) for x in os.environ.get("PROBE_SHAPE", "4 512 16 128").split())
    q, k, v, do = (torch.randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(4))
    o, lse = torch.randn_like(q), torch.randn(b, h, n)
    for table in ("cuda", "cpu"):
        for causal in (False, True):
            fcfg = fwd_config(d, d, q.dtype, causal, table, seqlen_q=n)
            bcfg = bwd_config(d, d, q.dtype, table, causal=causal)
            yield (f"B={b} N={n} H={h} d={d} causal={causal:d} {table} tiles",
                   lambda c=causal, cfg=fcfg: F.forward(q, k, v, 0.1, c, config=cfg),
                   lambda c=causal, cfg=bcfg: B.backward(do, q, k, v, o, lse, 0.1, c, config=cfg))


def time_calls(reps: str = "1000") -> None:
    reps = int(reps)
    from onlineattn.ops import _launch

    for name, fwd, bwd in _cases():
        for label, fn in (("fwd", fwd), ("bwd", bwd)):
            row = []
            for enabled in (False, True, False, True):  # interleaved, twice
                _launch.enabled = enabled
                for _ in range(50):
                    fn()
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                row.append((time.perf_counter() - t) / reps * 1e6)
            print(f"{name} {label}: cache off {row[0]:.1f} / {row[2]:.1f} us, on {row[1]:.1f} / {row[3]:.1f} us",
                  flush=True)


def time_decode(reps: str = "3000") -> None:
    """Host time of one decoding step, B = 1, L = 4k, Hq 32, Hkv 8, d 128, bf16 (the bench's smallest point): the
    public call (checks included, ``check_indices=False`` as the bench's ``onlineattn`` provider) and the launcher
    alone. CPU tensors stand in for CUDA ones; the API is told the backend is Triton, and the launcher takes the
    H200's tile table and SM count (so the split count, the workspace and its stream lookup are the GPU's)."""
    from onlineattn import api
    from onlineattn.ops import _decode_configs, decode

    reps = int(reps)
    api._resolve_backend = lambda backend, **tensors: "triton"
    decode.decode_config = lambda d, dv, dtype, device_type, **kw: _decode_configs.decode_config(d, dv, dtype, "cuda",
                                                                                                 **kw)
    decode._sm_count = lambda device: 132
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4096, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), 4096, dtype=torch.int32)
    calls = {
        "attention_with_kvcache": lambda: api.attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=False,
                                                                     check_indices=False),
        "ops.decode launcher": lambda: decode.attention_with_kvcache(q, k, v, None, None, lens, None, 0.1, False, 0),
        "ops.decode launcher, max_seqlen_k one longer each call (as check_indices=True gives)": lambda: (
            decode.attention_with_kvcache(q, k, v, None, None, lens, None, 0.1, False, 0,
                                          max_seqlen_k=2048 + next(growing))),
    }
    growing = itertools.count()
    for name, fn in calls.items():
        print(f"{name}: {_best_us(fn, reps, warmup=200):.1f} us (min of 5 x {reps})", flush=True)


def time_step(reps: str = "300") -> None:
    """Host time of one training call through the public API: ``attention(q, k, v, causal=True)`` and
    ``torch.autograd.grad`` of its output, B, N, H, d from PROBE_SHAPE (default 4 512 16 128), bf16, the H200's
    tiles; CPU tensors stand in for CUDA ones and the API is told the backend is Triton."""
    import onlineattn
    from onlineattn import api
    from onlineattn.ops import _configs, backward, forward

    reps = int(reps)
    api._resolve_backend = lambda backend, **tensors: "triton"
    forward.fwd_config = lambda d, dv, dtype, causal, device_type, **kw: _configs.fwd_config(d, dv, dtype, causal,
                                                                                              "cuda", **kw)
    backward.bwd_config = lambda d, dv, dtype, device_type, **kw: _configs.bwd_config(d, dv, dtype, "cuda", **kw)
    b, n, h, d = (int(x) for x in os.environ.get("PROBE_SHAPE", "4 512 16 128").split())
    leaves = [torch.randn(b, n, h, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

    def step():
        o = onlineattn.attention(*leaves, causal=True)
        torch.autograd.grad(o, leaves, o)

    for label, fn in (("forward, no graph", lambda: onlineattn.attention(*(x.detach() for x in leaves), causal=True)),
                      ("forward + autograd.grad", step)):
        best = _best_us(fn, reps, warmup=30)
        print(f"B={b} N={n} H={h} d={d} causal, {label}: {best:.1f} us (min of 5 x {reps})", flush=True)


def _best_us(fn, reps: int, warmup: int) -> float:
    """Microseconds per call of ``fn``: the best of 5 timed loops of ``reps`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e6)
    return best


def gpu(*indices: str) -> None:
    """On a CUDA machine (real launches): each case with the cache off, then twice with it on (a miss, then a hit);
    the outputs must be bitwise equal, and every launch the kernel run() picks (as in ``check``)."""
    from onlineattn.ops import _launch

    sys.path.insert(0, str(ROOT / "tests" / "ops"))
    from test_launch import CASES, call_case

    bits = lambda x: x.detach().contiguous().view(torch.uint8)  # noqa: E731
    failures = 0
    for case in [CASES[int(i)] for i in indices] if indices else CASES:
        _launch.enabled = False
        want = call_case(case, "cuda")
        _launch.enabled = True
        for attempt in ("miss", "hit"):
            got = call_case(case, "cuda")
            same = len(got) == len(want) and all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
            failures += not same
            print(f"{case} {attempt}: {'bitwise equal' if same else 'DIFFERENT'}", flush=True)
    torch.cuda.synchronize()
    print(f"{failures} cases differ")
    if failures:
        raise SystemExit(1)


def check(*indices: str) -> None:
    """Forward, backward and decode over the cases of tests/ops/test_launch.py (those at ``indices``, else all; each
    distinct specialisation compiles once, seconds each), every call twice: a miss, then a hit."""
    from onlineattn.ops import _launch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine: real launches, real driver
    launched = []
    original = _launch.launch

    def checked(kernel, grid, *args, **kwargs):
        compiled = original(kernel, grid, *args, **kwargs)
        expected = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        launched.append(compiled is expected)
        if compiled is not expected:
            print(f"MISMATCH {kernel.fn.__name__}", flush=True)
        return compiled

    _launch.launch = checked  # forward and backward launch through _launch.start, decode through prepare: both call it
    relaunch = _launch.Relaunch.go

    def checked_relaunch(self, grid, arrays, *pointers):  # kept launches (decode, forward, backward): run()'s kernel
        relaunch(self, grid, arrays, *pointers)
        expected = self.kernel.run(*arrays, *self.rest, grid=grid, warmup=True, **self.options)
        launched.append(self.compiled is expected)
        if self.compiled is not expected:
            print(f"MISMATCH relaunch {self.kernel.fn.__name__}", flush=True)

    _launch.Relaunch.go = checked_relaunch
    misses = []  # launches that went through run() (warmup=False): the rest were cache hits
    run = triton.runtime.jit.JITFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        misses.append(warmup)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    triton.runtime.jit.JITFunction.run = counted
    sys.path.insert(0, str(ROOT / "tests" / "ops"))
    from test_launch import CASES, call_case

    for case in [CASES[int(i)] for i in indices] if indices else CASES:
        for _ in range(2):
            call_case(case, device)
        print(f"{case}: {len(launched)} launches so far, all the run() kernel: {all(launched)}", flush=True)
    entries = sum(len(s.entries) for s in _launch._kernels.values())
    through_run = misses.count(False)
    print(f"{len(launched)} launches checked, {sum(launched)} launched the kernel run() picks; "
          f"{len(launched) - through_run} were cache hits, {through_run} went through run(); {entries} cache entries")
    if not all(launched):
        raise SystemExit(1)


def repeat() -> None:
    """The forward's and the backward's repeats (``_repeat``: kept launches) hand the launcher exactly what the full
    path hands it for the same call: tensors by address, descriptors by their fields, every scalar, the grids. Each
    call has fresh tensors and runs twice, through the kept launches and then through the full path (an empty step
    table). CPU machine only (the launcher records instead of launching)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from onlineattn.ops import _launch
    from onlineattn.ops import backward as B
    from onlineattn.ops import forward as F
    from onlineattn.ops._configs import bwd_config, fwd_config

    calls, relaunched = [], []
    Sm90NoLaunch.launcher_cls = lambda self, src, metadata: lambda *args: calls.append(args)
    go = _launch.Relaunch.go
    _launch.Relaunch.go = lambda self, grid, arrays, *ptrs: relaunched.append(1) or go(self, grid, arrays, *ptrs)

    def seen(args):  # grid, then the arguments after stream, function, metadata and hooks
        return args[:3], [("desc", a.base.data_ptr(), tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                           a.padding) if isinstance(a, TensorDescriptor) else
                          ("tensor", a.data_ptr()) if isinstance(a, torch.Tensor) else (type(a), a) for a in args[9:]]

    def twice(module, call):
        """(launches through the kept steps, launches through the full path) of one call, and the relaunch count."""
        calls.clear(), relaunched.clear()
        call()
        kept, count = [seen(c) for c in calls], len(relaunched)
        steps, module._STEPS = module._STEPS, {}
        calls.clear()
        try:
            call()
        finally:
            module._STEPS = steps
        return kept, [seen(c) for c in calls], count

    ok = True
    for b, n, hq, hkv, d, causal, with_dlse, out_dtype in [
            (2, 100, 4, 2, 128, True, False, torch.bfloat16), (2, 100, 4, 2, 128, False, True, torch.float32),
            (3, 65, 8, 8, 64, True, False, torch.bfloat16), (1, 77, 4, 1, 256, True, True, torch.bfloat16)]:
        F._STEPS.clear(), B._STEPS.clear()
        results = []
        for i in range(3):  # the first call keeps the launches; the next two repeat them, each with fresh tensors
            q, do = (torch.randn(b, n, hq, d, dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(b, n, hkv, d, dtype=torch.bfloat16) for _ in range(2))
            o, lse = torch.randn_like(q), torch.randn(b, hq, n)
            dlse = torch.randn(b, hq, n) if with_dlse else None
            out = (torch.empty(q.shape, dtype=out_dtype), torch.empty(k.shape, dtype=out_dtype),
                   torch.empty(v.shape, dtype=out_dtype))
            delta, empty = torch.empty((b, hq, n)), torch.empty  # one delta per call for both paths: same address
            fcfg = fwd_config(d, d, q.dtype, causal, "cuda", seqlen_q=n, seqlen_k=n)
            bcfg = bwd_config(d, d, q.dtype, "cuda", causal=causal)
            fwd = twice(F, lambda: F.forward(q, k, v, 0.1, causal, out=o, lse_out=lse, config=fcfg))
            torch.empty = lambda *a, **kw: delta if a and a[0] == (b, hq, n) else empty(*a, **kw)
            try:
                bwd = twice(B, lambda: B.backward(do, q, k, v, o, lse, 0.1, causal, dlse, out=out, config=bcfg))
            finally:
                torch.empty = empty
            if i:  # repeats: relaunched, and what the full path passes for the same tensors
                results.append(fwd[2] == 1 and fwd[0] == fwd[1] and len(fwd[0]) == 1)
                results.append(bwd[2] == 2 and bwd[0] == bwd[1] and len(bwd[0]) == 2)  # dQ (with delta), dK/dV
        ok &= all(results)
        print(f"B={b} N={n} Hq={hq} Hkv={hkv} d={d} causal={causal:d} dlse={with_dlse:d} out {out_dtype}: repeats "
              f"(forward, backward) x 2 relaunched with the full path's arguments: {results}", flush=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # read when onlineattn's kernels are decorated, below
    sys.path.insert(0, str(ROOT / "src"))
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(Sm90NoLaunch())
    elif mode in ("time", "decode", "step", "repeat"):
        raise SystemExit("time stubs the launches: run it where CUDA is absent (on the GPU: probe_host.py)")
    {"time": time_calls, "decode": time_decode, "step": time_step, "check": check, "gpu": gpu,
     "repeat": repeat}[mode](*sys.argv[2:])
