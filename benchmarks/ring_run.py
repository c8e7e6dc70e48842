"""Ring attention on several GPUs (issue #10), one process per GPU under torchrun: correctness, then time at scale.

1. Correctness, bf16: for causal and not, both layouts, MHA and GQA, the local shards of o, lse, dq, dk and dv are
   held to the rule of ENGINEERING.md section 3: error vs float64 ``attention`` (torch path, the exact result) at most
   2 × the error of torch math attention in bf16 + 2 bf16 quanta. The error of single-GPU ``attention`` (Triton) is
   printed beside it. Any failure makes the exit code 1.
2. Scale: one causal sequence (zigzag, H = 16, d = 128, bf16), forward and backward, with the transfers overlapped
   and serialised (ring_attention's internal ``_overlap=False``), and the K/V (+ dK/dV) ring alone. Rows ``ring_fwd``
   and ``ring_bwd`` (ENGINEERING.md section 5, plus ``world``, ``layout``, ``overlap``, ``ms_per_step``, ``comm_ms``)
   go to ``--out`` (rank 0 writes). ``ms`` is the slowest rank's median; TFLOP/s are per GPU (causal FLOPs / world).

    torchrun --standalone --nproc-per-node 8 benchmarks/ring_run.py --out $OUT/ring.jsonl --commit <sha>

On one GPU (world 1, nothing travels) use ``--nproc-per-node 1 --seqlen 262144``: the default 1M tokens take ~10 s
per forward there. Near the 10-minute limit, ``--reps 1 --warmup 0 --overlap-only`` cut the run to one pass each.

With ``--warmup 0`` the first timed pass (the overlapped one) is also the first use of its buffers: at 2M tokens on two
GPUs it ran 12% slower than the serialised pass after it, where with a warmup the two were equal at 1M (rows of
a52d225). Rows record ``warmup`` and ``reps`` so such rows can be told apart.

Smoke test on CPU with gloo: ``torchrun --standalone --nproc-per-node 2 benchmarks/ring_run.py --device cpu
--dtype float32 --check-seqlen 32 --seqlen 256 --heads 4 --head-dim 16 --reps 1 --no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

# NVLink multicast stays off on the lent machines (issue #10); set before NCCL initialises.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from the source tree
import onlineattn  # noqa: E402
from onlineattn import reference as R  # noqa: E402
from onlineattn.distributed import ring as ring_module  # noqa: E402
from onlineattn.distributed import ring_attention, shard_sequence  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NAMES = ("o", "lse", "dq", "dk", "dv")


def _say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _outputs_and_grads(attn, q, k, v, do, dlse):
    """``(o, lse, dq, dk, dv)`` of ``attn`` for the loss ``sum(o·do) + sum(lse·dlse)``."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o, lse = attn(*leaves)
    ((o.double() * do.double()).sum() + (lse.double() * dlse.double()).sum()).backward()
    return [o.detach(), lse.detach(), *(x.grad for x in leaves)]


def check(args, device, dtype) -> bool:
    """Correctness of every combination; returns whether all passed on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s, h, d = args.check_seqlen, args.heads, args.head_dim
    all_ok = True
    _say(f"correctness: S={s} H={h} d={d} {args.dtype}, world {world}; max error / bound (single-GPU attention's error)")
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            for hkv in (h, max(1, h // 4)):
                gen = torch.Generator().manual_seed(1000 * causal + 10 * hkv + (layout == "zigzag"))
                make = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
                q, k, v, do = make(1, s, h, d), make(1, s, hkv, d), make(1, s, hkv, d), make(1, s, h, d)
                dlse = make(1, h, s).float()
                shard = lambda x, dim=1: shard_sequence(x, rank, world, layout, seq_dim=dim)  # noqa: E731
                ring_out = _outputs_and_grads(
                    lambda q_, k_, v_: ring_attention(q_, k_, v_, causal=causal, layout=layout, return_lse=True),
                    shard(q), shard(k), shard(v), shard(do), shard(dlse, 2),
                )
                full = lambda backend, cast: _outputs_and_grads(  # noqa: E731
                    lambda q_, k_, v_: onlineattn.attention(q_, k_, v_, causal=causal, return_lse=True,
                                                            backend=backend),
                    cast(q), cast(k), cast(v), do, dlse,
                )
                exact = full("torch", lambda x: x.double())
                single = full("auto", lambda x: x)
                base = _outputs_and_grads(lambda q_, k_, v_: R.torch_math_attention(q_, k_, v_, causal=causal),
                                          q, k, v, do, dlse)
                cells, ok = [], True
                for i, name in enumerate(NAMES):
                    dim = 2 if name == "lse" else 1
                    want = shard(exact[i], dim)
                    bound = R.error_bound(want, shard(base[i], dim), args.dtype)
                    err = (ring_out[i].double() - want).abs().max()
                    err_single = (shard(single[i], dim).double() - want).abs().max()
                    # One all-reduce (max) of the errors, the bound and a failure flag over the ranks.
                    stats = torch.tensor([float(err), float(err_single), bound, float(err > bound)],
                                         dtype=torch.float64, device=device)
                    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                    err, err_single, bound, failed = stats.tolist()
                    ok &= not failed
                    cells.append(f"{name} {err:.2e}/{bound:.2e} ({err_single:.2e})")
                all_ok &= ok
                _say(f"  {'PASS' if ok else 'FAIL'} causal={int(causal)} {layout:10} Hkv={hkv:2}: " + "  ".join(cells))
                del exact, single, base, ring_out
    return all_ok


def _timed(fn, reps: int, warmup: int, device) -> float:
    """Median wall milliseconds of ``fn`` over ``reps`` runs after ``warmup`` runs, all ranks started together; the
    slowest rank's median (the ring moves at the pace of its slowest member)."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _comm_only(k, v, backward: bool) -> None:
    """The transfers of one ring pass without its attention: world − 1 K/V shifts, and for the backward also world
    shifts of float32 dK/dV."""
    ring = ring_module._Ring(None)
    kv = (k, v)
    for _ in range(ring.world - 1):
        kv = ring.shift(kv).wait()
    if backward:
        dkv = tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v))
        for _ in range(ring.world):
            dkv = ring.shift(dkv).wait()


def scale(args, device, dtype, env: dict) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    s, h, d, layout = args.seqlen, args.heads, args.head_dim, "zigzag"
    n = s // world
    gen = torch.Generator(device=device).manual_seed(rank)  # each rank draws its own shard: no full tensor anywhere
    q, k, v, do = (torch.randn(1, n, h, d, generator=gen, device=device, dtype=dtype) for _ in range(4))
    fwd_flops = 4.0 * h * s * s * d / 2 / world  # causal, per GPU
    timed = lambda fn: _timed(fn, args.reps, args.warmup, device)  # noqa: E731
    comm = {mode: timed(lambda: _comm_only(k, v, mode == "bwd")) for mode in ("fwd", "bwd")}
    rows = []
    _say(f"scale: S={s} ({n} per GPU), H={h}, d={d}, {args.dtype}, causal {layout}, world {world}; "
         f"comm alone: fwd {comm['fwd']:.2f} ms, bwd {comm['bwd']:.2f} ms")
    measured = {}
    overlaps = (True,) if args.overlap_only else (True, False)
    for overlap in overlaps:
        run = lambda q_, k_, v_: ring_attention(q_, k_, v_, causal=True, layout=layout, _overlap=overlap)  # noqa: E731
        with torch.no_grad():
            measured["fwd", overlap] = timed(lambda: run(q, k, v))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = run(*leaves)
        measured["bwd", overlap] = timed(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True))
        del o, leaves
    for mode, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
        overlapped = measured[mode, True]
        line = f"  {mode}: overlapped {overlapped:.1f} ms ({flops / overlapped / 1e9:.1f} TFLOP/s per GPU)"
        if (mode, False) in measured:
            serial = measured[mode, False]
            hidden = (serial - overlapped) / comm[mode] if comm[mode] > 0 else float("nan")
            line += f", serialised {serial:.1f} ms, comm alone {comm[mode]:.2f} ms: the overlap hides {hidden:.0%} of it"
        _say(line)
        for overlap in overlaps:
            ms = measured[mode, overlap]
            rows.append({
                **env, "op": f"ring_{mode}", "provider": "onlineattn", "dtype": args.dtype, "B": 1, "Hq": h,
                "Hkv": h, "Sq": s, "Sk": s, "d": d, "causal": True, "ms": round(ms, 4),
                "tflops": round(flops / ms / 1e9, 2), "world": world, "layout": layout, "overlap": overlap,
                "ms_per_step": round(ms / world, 4), "comm_ms": round(comm[mode], 4),
                "warmup": args.warmup, "reps": args.reps,
            })
    return rows


def _environment(commit: str | None, device) -> dict:
    if device.type == "cuda":
        from onlineattn.bench.prefill import environment

        return environment(commit)
    import triton

    return {"date": datetime.date.today().isoformat(), "commit": commit or "unknown", "gpu": "cpu",
            "torch": torch.__version__, "triton": triton.__version__}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/h200.jsonl"), help="rows appended here")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--commit", default=None, help="commit measured (default: git rev-parse, if there is a .git)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-seqlen", type=int, default=8192, help="full length of the correctness cases")
    p.add_argument("--seqlen", type=int, default=1 << 20, help="full length of the scale run (all GPUs together)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones (0 at huge sizes)")
    p.add_argument("--overlap-only", action="store_true", help="skip the serialised (no-overlap) runs")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-scale", action="store_true")
    args = p.parse_args()

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)  # NCCL's point-to-point calls need it set
        device = torch.device("cuda", local)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    for name in ("check_seqlen", "seqlen"):
        if getattr(args, name) % (2 * world):
            p.error(f"--{name.replace('_', '-')} must divide by 2 · world = {2 * world}")
    dtype = DTYPES[args.dtype]
    ok = True
    try:
        if not args.skip_check:
            ok = check(args, device, dtype)
        if not args.skip_scale:
            rows = scale(args, device, dtype, _environment(args.commit, device))
            if dist.get_rank() == 0 and not args.no_write:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)
                print(f"{len(rows)} rows appended to {args.out}")
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
