"""Ring attention: shard layouts, the per-step block plan, bad calls, and forward + gradients on gloo rings of 1, 2 and 4
processes against single-process ``onlineattn.attention`` on the full sequence.

The reference ("exact") is always ``attention(..., backend="torch")`` on the float64 version of the inputs, which the
rest of the suite holds to the NumPy oracle at 1e-12. float64 rings must agree within 1e-12 and float32 within 1e-5
(relative), half precision under the rule of ENGINEERING.md section 3 (baseline: torch math attention in that dtype).

The 2- and 4-rank rings run every case in ONE launch per world size (``ring_worker.py``), so process start-up is paid
twice; each case is then checked by its own test.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import onlineattn
from onlineattn import reference as R
from onlineattn.distributed import ring_attention, shard_sequence, unshard_sequence
from onlineattn.distributed import layout as L

WORKER = Path(__file__).with_name("ring_worker.py")
SRC = Path(onlineattn.__file__).resolve().parents[1]  # the tree under test, for the workers' PYTHONPATH
LAUNCH_TIMEOUT_S = 150
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# Layouts and the block plan: no communication


def test_zigzag_holds_chunks_r_and_2w_minus_1_minus_r():
    x = torch.arange(8).reshape(1, 8, 1, 1)
    assert shard_sequence(x, 0, 2, "zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard_sequence(x, 1, 2, "zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert shard_sequence(x, 1, 2, "contiguous").flatten().tolist() == [4, 5, 6, 7]
    for rank in range(2):
        assert shard_sequence(x, rank, 2, "zigzag").flatten().tolist() == L.positions("zigzag", rank, 2, 4).tolist()


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_unshard_inverts_shard(layout, world):
    x = torch.randn(2, 4 * world, 3, 5)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 4, 3, 5) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    lse = torch.randn(2, 3, 4 * world)  # [B, H, S]: the sequence is dim 2
    lse_shards = [shard_sequence(lse, r, world, layout, seq_dim=2) for r in range(world)]
    assert torch.equal(unshard_sequence(lse_shards, layout, seq_dim=2), lse)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((torch.zeros(1, 10, 2, 4), 0, 4, "contiguous"), ValueError, "divide by 4"),
        ((torch.zeros(1, 12, 2, 4), 0, 4, "zigzag"), ValueError, r"divide by 8 \(2 · world"),
        ((torch.zeros(1, 8, 2, 4), 0, 2, "striped"), ValueError, "layout must be one of"),
        ((torch.zeros(1, 8, 2, 4), 0, 2, 3), TypeError, "layout must be a str"),
        ((torch.zeros(1, 8, 2, 4), 2, 2, "zigzag"), ValueError, r"rank must be in \[0, 2\)"),
        ((torch.zeros(1, 8, 2, 4), 0, 0, "zigzag"), ValueError, "world must be >= 1"),
        (([1, 2], 0, 1, "zigzag"), TypeError, "x must be a torch.Tensor"),
        ((torch.zeros(()), 0, 1, "contiguous"), ValueError, "x must have a sequence dim"),
    ],
)
def test_shard_sequence_rejects_bad_calls(args, error, match):
    with pytest.raises(error, match=match):
        shard_sequence(*args)


def test_unshard_rejects_bad_calls():
    with pytest.raises(ValueError, match="share one shape"):
        unshard_sequence([torch.zeros(1, 4, 2, 3), torch.zeros(1, 2, 2, 3)])
    with pytest.raises(ValueError, match="layout must be one of"):
        unshard_sequence([torch.zeros(1, 4, 2, 3)], "ring")
    with pytest.raises(ValueError, match="must be even"):
        unshard_sequence([torch.zeros(1, 3, 2, 3)], "zigzag")
    with pytest.raises(TypeError, match="non-empty list"):
        unshard_sequence([])
    with pytest.raises(TypeError, match="share one dtype"):  # not promoted silently
        unshard_sequence([torch.zeros(1, 4, 2, 3), torch.zeros(1, 4, 2, 3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="sequence dim"):
        unshard_sequence([torch.zeros(()), torch.zeros(())], seq_dim=0)


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_step_blocks_cover_exactly_the_visible_pairs(world, causal, layout):
    """Over a whole ring, the blocks hit every visible (query, key) pair of the full sequence once and nothing else;
    with zigzag + causal every rank does the same work at every step (a diagonal block counts half)."""
    n = 4
    seqlen = n * world
    hits = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    work = torch.zeros(world, world)
    for rank, step in itertools.product(range(world), range(world)):
        src = (rank - step) % world
        pos_q, pos_k = L.positions(layout, rank, world, n), L.positions(layout, src, world, n)
        for blk in L.step_blocks(layout, causal, rank, src, n):
            rows, cols = pos_q[blk.rows], pos_k[blk.cols]
            seen = torch.from_numpy(R.visible_mask(len(rows), len(cols), blk.causal))
            hits[rows[:, None], cols[None, :]] += seen.long()
            work[rank, step] += len(rows) * len(cols) / (2 if blk.causal else 1)
    assert torch.equal(hits, torch.from_numpy(R.visible_mask(seqlen, seqlen, causal)).long())
    if causal and layout == "zigzag":
        assert torch.all(work == work[0, 0])


# ---------------------------------------------------------------------------------------------------------------
# Cases: a spec, its inputs, the exact result and the same-dtype baseline


@dataclasses.dataclass(frozen=True)
class Spec:
    dtype: str
    layout: str
    causal: bool
    hq: int
    hkv: int
    batch: int = 1
    n_local: int = 6  # tokens per rank
    d: int = 16
    dv: int = 16
    scale: float | None = None
    return_lse: bool = True
    noncontiguous: bool = False
    triton: bool = False  # force the per-block Triton path (Triton's interpreter on CPU)
    overlap: bool = True  # False: the benchmarks' serialised schedule, which must give the same answers
    trim: tuple | None = None  # bad call: tokens dropped from each rank's shards
    per_rank: tuple | None = None  # bad call: each rank's keyword overrides


def _inputs(spec: Spec, world: int, seed: int) -> dict:
    """Full-sequence q, k, v and upstream gradients do (for o) and dlse (for lse, in lse's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[spec.dtype]
    s = spec.n_local * world
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "q": make(spec.batch, s, spec.hq, spec.d), "k": make(spec.batch, s, spec.hkv, spec.d),
        "v": make(spec.batch, s, spec.hkv, spec.dv), "do": make(spec.batch, s, spec.hq, spec.dv),
        "dlse": make(spec.batch, spec.hq, s).to(lse_dtype),
    }


def _loss_and_grads(attn, spec: Spec, x: dict, cast) -> dict:
    """o, lse and the gradients of ``sum(o·do) + sum(lse·dlse)`` (lse term only with return_lse) through ``attn``."""
    leaves = [cast(x[n]).detach().requires_grad_() for n in ("q", "k", "v")]
    o, lse = attn(*leaves)
    loss = (o.double() * x["do"].double()).sum()
    if spec.return_lse:
        loss = loss + (lse.double() * x["dlse"].double()).sum()
    loss.backward()
    return {"o": o.detach(), "lse": lse.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _exact(spec: Spec, x: dict) -> dict:
    """Single-process ``attention`` (torch path, float64) on the full sequence."""
    attn = lambda q, k, v: onlineattn.attention(  # noqa: E731
        q, k, v, causal=spec.causal, softmax_scale=spec.scale, return_lse=True, backend="torch"
    )
    return _loss_and_grads(attn, spec, x, lambda t: t.double())


def _baseline(spec: Spec, x: dict) -> dict | None:
    """Textbook attention in the inputs' own dtype, the rule's baseline; None for float32/float64 (relative rule)."""
    if spec.dtype in ("float32", "float64"):
        return None
    attn = lambda q, k, v: R.torch_math_attention(q, k, v, causal=spec.causal, softmax_scale=spec.scale)  # noqa: E731
    return _loss_and_grads(attn, spec, x, lambda t: t)


def _check_against_exact(spec: Spec, x: dict, ours: dict) -> None:
    exact, base = _exact(spec, x), _baseline(spec, x)
    assert ours["o"].dtype == DTYPES[spec.dtype] and ours["dk"].dtype == DTYPES[spec.dtype]
    for name in ("o", "lse", "dq", "dk", "dv"):
        if name in ours:
            R.assert_within_rule(name, ours[name], exact[name], None if base is None else base[name], spec.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Bad calls and a one-rank ring, in this process


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of world size 1 in this process (no peers, so no messages), torn down afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_raises_runtime_error():
    assert not dist.is_initialized()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


@pytest.mark.parametrize(
    "shapes,kwargs,error,match",
    [
        (((1, 4, 2, 8),) * 3, {"layout": "striped"}, ValueError, "layout must be one of"),
        (((1, 5, 2, 8),) * 3, {"layout": "zigzag"}, ValueError, "length must be even"),
        (((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), {}, ValueError, "q_local 4 and k_local 6"),
        (((1, 0, 2, 8),) * 3, {}, ValueError, "at least one token"),
        (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), {}, ValueError, "does not divide"),
        (((1, 4, 2, 8),) * 3, {"group": "world"}, TypeError, "group must be"),
        (((1, 4, 2, 8),) * 3, {"causal": 1}, TypeError, "causal must be a Python bool"),
    ],
)
def test_bad_local_calls_raise_before_any_communication(one_rank_group, shapes, kwargs, error, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(error, match=match):
        ring_attention(q, k, v, **kwargs)


ONE_RANK = [
    pytest.param(Spec("float64", "zigzag", True, 4, 2, batch=2, d=12, dv=8), "cpu", id="cpu-float64-zigzag-causal"),
    pytest.param(Spec("float32", "contiguous", False, 3, 1, n_local=7, noncontiguous=True), "cpu", id="cpu-float32"),
    *(
        pytest.param(Spec("bfloat16", layout, causal, 8, 2, batch=2, n_local=384, d=64, dv=64), "cuda",
                     marks=pytest.mark.gpu, id=f"cuda-bfloat16-{layout}-{'causal' if causal else 'full'}")
        for layout in L.LAYOUTS for causal in (False, True)
    ),
    *(  # blocks of 512 rows and more (zigzag: two of 512): lengths where the table runs the Gluon kernels for q's
        # dtype, which the blocks' float32 outputs must not reach (the forward) or take from registers (dK/dV)
        pytest.param(Spec("bfloat16", layout, causal, 4, 2, n_local=1024, d=128, dv=128), "cuda",
                     marks=pytest.mark.gpu, id=f"cuda-bfloat16-d128-1024-{layout}-{'causal' if causal else 'full'}")
        for layout in L.LAYOUTS for causal in (False, True)
    ),
]


@pytest.mark.parametrize("spec,device", ONE_RANK)
def test_one_rank_ring_matches_attention(one_rank_group, spec, device):
    """World size 1: one diagonal block, Triton's kernels on CUDA (bf16), the torch path on CPU."""
    x = {name: t.to(device) for name, t in _inputs(spec, 1, seed=3).items()}
    if spec.noncontiguous:
        x.update({n: x[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("q", "k", "v")})
    attn = lambda q, k, v: ring_attention(  # noqa: E731
        q, k, v, causal=spec.causal, layout=spec.layout, softmax_scale=spec.scale, return_lse=True
    )
    _check_against_exact(spec, x, _loss_and_grads(attn, spec, x, lambda t: t))


# ---------------------------------------------------------------------------------------------------------------
# Rings of 2 and 4 processes on gloo over loopback


def _specs(world: int) -> dict[str, Spec]:
    """Bad calls first, so that the good cases after them show the ring survives a rejected call."""
    specs = {}
    if world == 2:
        specs["bad-lengths-differ"] = Spec("float64", "contiguous", False, 2, 2, n_local=5, trim=(0, 1))
        specs["bad-causal-differs"] = Spec("float64", "zigzag", True, 2, 2, per_rank=({"causal": True},
                                                                                     {"causal": False}))
    else:
        specs["bad-scale-differs"] = Spec(
            "float64", "contiguous", True, 2, 2, per_rank=({}, {}, {}, {"softmax_scale": 0.5})
        )
    heads = [(3, 3), (6, 2)]  # MHA and GQA with a group of 3
    for i, (dtype, layout, causal, (hq, hkv)) in enumerate(
        itertools.product(("float64", "float32"), L.LAYOUTS, (False, True), heads)
    ):
        specs[f"{dtype}-{layout}-{'causal' if causal else 'full'}-h{hq}:{hkv}"] = Spec(
            dtype, layout, causal, hq, hkv,
            batch=1 + i % 2,
            n_local=5 if layout == "contiguous" else 6,  # odd shards where the layout allows them
            d=12 if i % 3 == 0 else 16, dv=8 if i % 3 == 0 else 16,  # head dims not powers of two, Dv != D
            scale=0.3 if i % 4 == 1 else None,
            return_lse=i % 5 != 4,  # a loss on o alone in some cases
            noncontiguous=i % 3 == 2,
        )
    specs["float32-zigzag-causal-h6:2-serialised"] = Spec("float32", "zigzag", True, 6, 2, overlap=False)
    # The per-block Triton path (fp32 outputs for half inputs, sliced blocks, the lse slice) through the interpreter.
    specs["triton-float32-zigzag-causal-h4:2"] = Spec("float32", "zigzag", True, 4, 2, d=16, triton=True)
    specs["triton-float16-contiguous-causal-h2:1"] = Spec("float16", "contiguous", True, 2, 1, n_local=5, triton=True)
    specs["triton-float16-zigzag-full-h2:2"] = Spec("float16", "zigzag", False, 2, 2, triton=True)
    return specs


WORLDS = (2, 4)
SPECS = {world: _specs(world) for world in WORLDS}
SEEDS = {world: {name: 100 * world + i for i, name in enumerate(SPECS[world])} for world in WORLDS}


def _launch(world: int, tmp_path: Path) -> list[dict]:
    """Run every case of this world size in ``world`` worker processes; return each rank's results."""
    cases = {
        name: {**dataclasses.asdict(spec), **_inputs(spec, world, SEEDS[world][name])}
        for name, spec in SPECS[world].items()
    }
    torch.save(cases, tmp_path / "cases.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TRITON_INTERPRET="1")  # every case runs on CPU tensors: Triton interprets
    init_url = f"file://{tmp_path}/store"
    start = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "cases.pt"), str(tmp_path), init_url, str(r),
                          str(world)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            remaining = LAUNCH_TIMEOUT_S - (time.perf_counter() - start)
            outputs.append(p.communicate(timeout=max(remaining, 1))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world}-rank ring did not finish within {LAUNCH_TIMEOUT_S} s (a hang)")
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} of {world} exited with {p.returncode}:\n{out}"
    print(f"{world}-rank ring: {len(cases)} cases in {time.perf_counter() - start:.1f} s")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """``ring_results(world)``: every rank's results for that world size, launched once and cached."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _launch(world, tmp_path_factory.mktemp(f"ring{world}"))
        return cache[world]

    return get


_NUMPY = tuple(int(x) for x in np.__version__.split(".")[:2])
GOOD = [(w, name) for w in WORLDS for name, s in SPECS[w].items() if not (s.trim or s.per_rank)]
BAD = [(w, name) for w in WORLDS for name, s in SPECS[w].items() if s.trim or s.per_rank]


@pytest.mark.parametrize("world,name", GOOD, ids=[f"w{w}-{n}" for w, n in GOOD])
def test_ring_matches_single_process_attention(ring_results, world, name):
    spec = SPECS[world][name]
    if spec.triton and _NUMPY >= (2, 4):
        pytest.skip("Triton 3.6's interpreter fails under numpy >= 2.4 (ENGINEERING.md section 4); the GPU test "
                    "test_one_rank_ring_matches_attention runs the Triton block path on CUDA instead")
    per_rank = [results[name] for results in ring_results(world)]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r} raised {res.get('error')}:\n{res.get('traceback')}"
    ours = {
        key: unshard_sequence([res[key] for res in per_rank], spec.layout, seq_dim=2 if key == "lse" else 1)
        for key in per_rank[0]
    }
    assert ("lse" in ours) == spec.return_lse
    _check_against_exact(spec, _inputs(spec, world, SEEDS[world][name]), ours)


@pytest.mark.parametrize("world,name", BAD, ids=[f"w{w}-{n}" for w, n in BAD])
def test_ranks_that_disagree_all_raise(ring_results, world, name):
    """Every rank raises ValueError naming what differs, none hangs, and later cases on the same ring still pass."""
    spec = SPECS[world][name]
    differing = "q_local length" if spec.trim else ", ".join(sorted({k for kw in spec.per_rank for k in kw}))
    for r, res in enumerate(ring_results(world)):
        assert res[name].get("error") == "ValueError", f"rank {r}: {res[name]}"
        assert "must agree across ranks" in res[name]["message"] and differing in res[name]["message"]
