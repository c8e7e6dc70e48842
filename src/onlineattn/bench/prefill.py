"""`onlineattn bench prefill`: time attention on the peers' grid, with the peers measured in the same run.

Grid (``../shared/anchors/h200-peers.md``): d ∈ {64, 128, 256}, N ∈ {512 … 16384}, B·N = 16384 tokens, H·d = 2048,
causal and not, bf16. FLOPs: forward 4·B·H·Sq·Sk·d, halved for causal when Sq = Sk (backward is 2.5× forward).
Each measurement becomes one JSON line (ENGINEERING.md section 5). ``--quick`` measures d = 128 at N ∈ {1024, 8192}.

Peers: SDPA's flash, cuDNN, efficient and math backends; FlexAttention (``torch.compile``d once, recompiled once per
shape under a raised recompile limit; a compile that fails or would fall back to eager gives no row); ``flash_attn``
and ``flash_attn.cute`` where importable. A provider that cannot be set up here is named and left out of the run.

``--cold`` times each call's device work alone (``rows.time_cold``: L2 cleared, then a sleep kernel holds the GPU
while the host enqueues the call; providers named ``+cold``), for the short lengths where an eager call's host path
(a training step's: several hundred µs on the H200 machine, NOTES v25-v26) is as long as its kernels and the
default timing reads the host. Every provider, SDPA's included, is timed the same way in the run.

``--window W`` adds the provider ``onlineattn-windowW``: causal sliding-window attention where each query sees its W
latest keys, itself included (``window_size=(W - 1, 0)``), timed in the same run as the full causal rows. Its rows
carry ``"window": [W - 1, 0]`` and count the FLOPs of the visible pairs only, and the table prints its time as a
fraction of full causal ``onlineattn`` (issue #6 asks for at most 1/8 at N = 16384, W = 1024).

``--sinks`` adds the provider ``onlineattn-sinks``: the case's call with one sink logit per query head (gpt-oss's
``s_aux``; fixed values spread over [-1, 1], not learned: the backward computes no dsinks), the same FLOPs as the
case. Its rows carry ``"sinks": true``, and the table prints its time as a multiple of the same call without sinks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .progress import Progress
from .rows import add_output_options, append_rows, environment, time_cold, warm_up_gpu

HEAD_DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HEAD_DIMS = (128,)
QUICK_SEQLENS = (1024, 8192)
FLEX_RECOMPILE_LIMIT = 256  # one compiled graph per (shape, mask): the full grid needs 36 per mode
TOKENS = 16384
HIDDEN = 2048
COLD_HOLD_CYCLES = 4_000_000  # ~2 ms at the H200's clock: longer than a training step's host path (<1 ms, NOTES v25)


@dataclass(frozen=True)
class Case:
    b: int
    h: int
    n: int
    d: int
    causal: bool

    def flops(self, mode: str, window: int | None = None) -> float:
        fwd = 4.0 * self.b * self.h * self.n * self.n * self.d * (0.5 if self.causal else 1.0)
        if window is not None:  # the visible pairs of a causal window of W keys: sum over i of min(i + 1, W)
            w = min(window, self.n)
            fwd = 4.0 * self.b * self.h * self.d * (w * (w + 1) / 2 + (self.n - w) * w)
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[mode]


def grid(head_dims=HEAD_DIMS, seqlens=SEQLENS, causal=(False, True)):
    return [Case(TOKENS // n, HIDDEN // d, n, d, c) for d in head_dims for c in causal for n in seqlens]


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):  # SDPA wants [B, H, S, D]; Sq = Sk here, so top-left causal = bottom-right
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
        return o.transpose(1, 2)

    return run


def _ours(q, k, v, causal):
    from ..api import attention

    return attention(q, k, v, causal=causal, backend="triton")


def _ours_any_order(q, k, v, causal):
    """``deterministic=False`` (flash-attn's default): the backward may sum dQ in no fixed order where faster."""
    from ..api import attention

    return attention(q, k, v, causal=causal, deterministic=False, backend="triton")


def _ours_window(window: int):
    from ..api import attention

    def run(q, k, v, causal):
        return attention(q, k, v, causal=True, window_size=(window - 1, 0), backend="triton")

    return run


def window_provider(window: int) -> str:
    return f"onlineattn-window{window}"


SINKS_PROVIDER = "onlineattn-sinks"


def _ours_sinks(q, k, v, causal):
    from ..api import attention

    return attention(q, k, v, causal=causal, sinks=_sink_logits(q.shape[2], str(q.device)), backend="triton")


@functools.lru_cache(maxsize=None)
def _sink_logits(heads: int, device: str) -> torch.Tensor:
    """The sinks of ``heads`` query heads, made once per (heads, device) so no call times their creation."""
    return torch.linspace(-1.0, 1.0, heads, device=device)


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex():
    """FlexAttention compiled once; each new shape recompiles (dynamic=False), under a limit raised for the grid.
    Hitting the limit raises rather than silently running uncompiled (an eager flex materialises the scores)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(config, name):
            setattr(config, name, True)
    compiled = torch.compile(flex_attention, dynamic=False)
    block_masks = {}

    def run(q, k, v, causal):
        block_mask = None
        if causal:  # Sq = Sk on this grid: top-left = bottom-right; one block mask per length, built outside timing
            key = (q.shape[1], q.device)
            if key not in block_masks:
                block_masks[key] = create_block_mask(_causal_mod, None, None, q.shape[1], k.shape[1], device=q.device)
            block_mask = block_masks[key]
        o = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return o.transpose(1, 2)

    return run


def _flash_attn(module_name: str):
    """flash-attn 2 (``flash_attn``) or 4 (``flash_attn.cute``), both in the [B, S, H, D] layout; the cute interface
    returns ``(out, lse)``."""

    def setup():
        import importlib

        fn = importlib.import_module(module_name).flash_attn_func

        def run(q, k, v, causal):
            out = fn(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return run

    return setup


# name -> setup() returning fn(q, k, v, causal) -> o; setup raises ImportError (or RuntimeError) where unavailable
PROVIDER_SETUPS = {
    "onlineattn": lambda: _ours,
    "onlineattn-nondet": lambda: _ours_any_order,
    "sdpa-flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": lambda: _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-math": lambda: _sdpa("MATH"),
    "flex": _flex,
    "flash-attn": _flash_attn("flash_attn"),
    "flash-attn-cute": _flash_attn("flash_attn.cute"),
}
PROVIDERS = tuple(PROVIDER_SETUPS)
SAME_FORWARD = ("onlineattn-nondet",)  # providers whose forward is onlineattn's: timed in backward modes only


def available(names) -> dict:
    """``{name: fn}`` for the providers that can be set up here; the others are printed with the reason."""
    found = {}
    for name in names:
        try:
            found[name] = PROVIDER_SETUPS[name]()
        except (ImportError, RuntimeError, AttributeError) as err:
            print(f"  {name}: not available ({type(err).__name__}: {str(err).splitlines()[0][:100]})")
    return found


def _timed(fn, mode: str, q, k, v, causal, cold: bool = False) -> float:
    """Median milliseconds of one forward, or of one backward alone (``autograd.grad`` with ``retain_graph``), by
    ``do_bench``, or with ``cold`` its device work alone (``time_cold``)."""
    import triton.testing

    def timed(call):
        call()  # compiles: then the warm-up, so the timing starts on a busy GPU
        warm_up_gpu()
        if cold:
            return time_cold(call, hold_cycles=COLD_HOLD_CYCLES)
        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")

    if mode == "fwd":
        with torch.no_grad():
            return timed(lambda: fn(q, k, v, causal))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, causal)
    do = torch.randn_like(o)
    if mode == "bwd":
        return timed(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return timed(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do))


def _inputs(case: Case, dtype) -> tuple:
    """q, k, v of a case: ``[B, N, H, d]`` standard normal, seeded by the case."""
    gen = torch.Generator(device="cuda").manual_seed(case.n * 1000 + case.d)
    shape = (case.b, case.n, case.h, case.d)
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3))


def _settle(case: Case, fns: dict, modes, dtype, cold: bool = False) -> None:
    """Time ``case`` once for every provider and mode, and drop the readings: the first point timed in a fresh
    process reads low, whichever provider runs it (d = 64, N = 512: ours read 331 and 334 TFLOP/s as a run's first
    point, 357.8 after another case and 356.7 after cuDNN's, NOTES v25), and the grid's first case would carry it.
    A peer that fails here is left to the grid, which reports it; our own failures stop the run, as in the grid."""
    q, k, v = _inputs(case, dtype)
    for mode in modes:
        for name, fn in fns.items():
            if mode == "fwd" and name in SAME_FORWARD:
                continue
            try:
                _timed(fn, mode, q, k, v, case.causal, cold)
            except Exception:  # noqa: BLE001 - the grid times this point again and reports what fails
                if name.startswith("onlineattn"):
                    raise
                torch.cuda.empty_cache()


def run(cases, providers, modes, *, out: Path | None, commit: str | None = None, dtype=torch.bfloat16,
        window: int | None = None, sinks: bool = False, cold: bool = False):
    """Measure every (case, mode, provider) of the providers available here; print a table; append rows to ``out``.
    Returns the rows. With ``window``, the provider ``onlineattn-window{window}`` (causal sliding window) joins,
    with ``sinks`` the provider ``onlineattn-sinks``; with ``cold``, every provider's device work alone is timed and
    its rows are named ``+cold``."""
    env = environment(commit)
    fns = available(providers)
    if window is not None:
        fns[window_provider(window)] = _ours_window(window)
    if sinks:
        fns[SINKS_PROVIDER] = _ours_sinks
    rows = []
    suffix = "+cold" if cold else ""
    width = max([15] + [len(p + suffix) for p in fns])  # a column per provider, as wide as its name
    header = f"{'op':6} {'d':>4} {'c':>2} {'N':>6} {'B':>3} {'H':>3} " + " ".join(f"{p + suffix:>{width}}" for p in fns)
    print(header)
    if cases:
        _settle(cases[0], fns, modes, dtype, cold)
    bar = Progress(len(cases) * len(modes) * len(fns), "prefill")
    for case in cases:
        q, k, v = _inputs(case, dtype)
        for mode in modes:
            cells, times = [], {}
            for name, fn in fns.items():
                windowed = window is not None and name == window_provider(window)
                bar.step(f"{mode} d={case.d} N={case.n} {name}")
                if mode == "fwd" and name in SAME_FORWARD:  # the same forward as onlineattn: no second row
                    cells.append(f"{'(same)':>{width}}")
                    continue
                try:
                    ms = _timed(fn, mode, q, k, v, case.causal, cold)
                except Exception as err:  # noqa: BLE001 - a peer that refuses the shape, runs out of memory, or
                    # fails to compile: that cell is n/a and the run goes on. Our own failures stop the run.
                    if name.startswith("onlineattn"):
                        raise
                    cells.append(f"{'n/a':>{width}}")
                    bar.print(f"  {name} {mode} {case}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                    torch.cuda.empty_cache()
                    continue
                times[name] = ms
                tflops = case.flops(mode, window if windowed else None) / ms / 1e9
                cells.append(f"{tflops:{width}.1f}")
                rows.append({
                    **env, "op": mode, "provider": name + suffix, "dtype": str(dtype).replace("torch.", ""),
                    "B": case.b, "Hq": case.h, "Hkv": case.h, "Sq": case.n, "Sk": case.n, "d": case.d,
                    "causal": True if windowed else case.causal, "ms": round(ms, 5), "tflops": round(tflops, 2),
                    **({"window": [window - 1, 0]} if windowed else {}),
                    **({"sinks": True} if name == SINKS_PROVIDER else {}),
                })
            bar.print(f"{mode:6} {case.d:4} {int(case.causal):2} {case.n:6} {case.b:3} {case.h:3} " + " ".join(cells))
            if window is not None and case.causal and {"onlineattn", window_provider(window)} <= times.keys():
                ratio = times[window_provider(window)] / times["onlineattn"]
                bar.print(f"       window {window}: {times[window_provider(window)]:.3f} ms = {ratio:.3f} x full "
                          f"causal {times['onlineattn']:.3f} ms")
            if {"onlineattn", SINKS_PROVIDER} <= times.keys():
                bar.print(f"       sinks: {times[SINKS_PROVIDER]:.3f} ms = "
                          f"{times[SINKS_PROVIDER] / times['onlineattn']:.3f} x without {times['onlineattn']:.3f} ms")
        del q, k, v
    bar.close()
    append_rows(out, rows)
    return rows


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("prefill", help="time forward/backward on the peers' grid against SDPA")
    p.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd", "all"), default="fwd")
    p.add_argument("--d", type=int, nargs="*", default=None, help=f"head dims (default: {HEAD_DIMS})")
    p.add_argument("--n", type=int, nargs="*", default=None, help="sequence lengths (default: the grid)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=list(PROVIDERS),
                   help="default: every one that is available here")
    p.add_argument("--quick", action="store_true",
                   help=f"about a minute: d in {QUICK_HEAD_DIMS}, N in {QUICK_SEQLENS} (unless --d/--n say otherwise)")
    p.add_argument("--cold", action="store_true",
                   help="time each call's device work alone, the GPU held ahead of the host: providers +cold")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="also time causal sliding-window attention over the W latest keys (window_size=(W-1, 0))")
    p.add_argument("--sinks", action="store_true",
                   help="also time each case's call with one sink logit per query head (provider onlineattn-sinks)")
    add_output_options(p)
    p.set_defaults(func=main)


def main(args) -> int:
    if not torch.cuda.is_available():
        print("onlineattn bench prefill needs a CUDA device")
        return 2
    seqlens = args.n or (QUICK_SEQLENS if args.quick else SEQLENS)
    head_dims = args.d or (QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    causal = {"0": (False,), "1": (True,), "both": (False, True)}[args.causal]
    modes = ("fwd", "bwd") if args.mode == "all" else (args.mode,)
    if args.window is not None and args.window < 1:
        print(f"--window must be at least 1, got {args.window}")
        return 2
    run(grid(head_dims, seqlens, causal), args.providers, modes, out=None if args.no_write else args.out,
        commit=args.commit, window=args.window, sinks=args.sinks, cold=args.cold)
    return 0

