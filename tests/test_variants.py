"""The score variants of issue #6 (window, softcap, ALiBi, additive bias, sinks, dropout, varlen) through the public
API, on the torch path and on the Triton kernels (through Triton's interpreter without CUDA: fp32 and fp16, whose
interpreted bf16 dot is wrong), forward and every gradient, against the oracle under the rule of ENGINEERING.md §3.
GPU tests at the end: bf16, large shapes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import triton
import triton.language as tl

import onlineattn
from onlineattn import reference as R
from onlineattn.dropout import draw_rng_state, dropout_mask
from onlineattn.ops._common import band_key_range, band_row_range

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    sq: int = 17
    sk: int = 23
    hq: int = 4
    hkv: int = 2
    d: int = 40
    dv: int = 24
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: tuple | None = None  # slopes' shape: (Hq,) or (B, Hq)
    bias: tuple | None = None  # bias's shape, broadcastable to (B, Hq, Sq, Sk)
    sinks: bool = False
    dropout_p: float = 0.0
    q_scale: float = 1.0


def _inputs(case: Case, dtype, device, seed, *, rows=None):
    """Leaves q, k, v (and bias, sinks) requiring grad, upstream do and dlse, the API's keywords and the oracle's.
    ``rows``: packed varlen ``(total_q, total_k)`` instead of ``[B, S, H, D]``."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).to(device=device, dtype=dtype)
    lead_q, lead_k = ((rows[0],), (rows[1],)) if rows else ((case.b, case.sq), (case.b, case.sk))
    q = rand(*lead_q, case.hq, case.d, s=case.q_scale).requires_grad_()
    k, v = rand(*lead_k, case.hkv, case.d).requires_grad_(), rand(*lead_k, case.hkv, case.dv).requires_grad_()
    do = rand(*lead_q, case.hq, case.dv)
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap)
    if case.alibi:
        kw["alibi_slopes"] = torch.rand(*case.alibi, generator=gen).to(device)
    if case.bias:
        bias = rand(*case.bias)
        if case.bias[-2:] == (case.sq, case.sk):  # hide some keys of row 1 completely: an empty row by bias alone
            bias[..., 1, :] = float("-inf")
        kw["attn_bias"] = bias.requires_grad_()
    if case.sinks:
        kw["sinks"] = rand(case.hq).requires_grad_()
    oracle = dict(kw)
    if case.dropout_p:
        kw.update(dropout_p=case.dropout_p, generator=torch.Generator(device).manual_seed(seed))
        rng = draw_rng_state(torch.Generator(device).manual_seed(seed), device)
        oracle.update(dropout_p=case.dropout_p, dropout_mask=dropout_mask(rng, case.b, case.hq, case.sq, case.sk,
                                                                          case.dropout_p))
    return q, k, v, do, kw, oracle


def _leaves(q, k, v, kw):
    return {"dq": q, "dk": k, "dv": v, "dbias": kw.get("attn_bias"), "dsinks": kw.get("sinks")}


def _loss(o, lse, do, dlse):
    """``sum(o ∘ do) + sum(lse ∘ dlse)``, the lse of empty rows (-inf) left out."""
    return (o.float() * do.float()).sum() + (lse.float().masked_fill(torch.isinf(lse), 0.0) * dlse).sum()


def _baseline(fn, q, k, v, do, dlse, kw):
    """torch math attention in the inputs' own dtype, with autograd: the rule's baseline for o, lse and each
    gradient (None in float32/float64, where the rule is relative)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return {}
    copies = {n: x.detach().clone().requires_grad_() for n, x in (("q", q), ("k", k), ("v", v))}
    kw = {n: (x.detach().clone().requires_grad_() if n in ("attn_bias", "sinks") else x) for n, x in kw.items()}
    o, lse = fn(copies["q"], copies["k"], copies["v"], **kw)
    _loss(o, lse, do, dlse).backward()
    leaves = _leaves(copies["q"], copies["k"], copies["v"], kw)
    return {"o": o, "lse": lse, **{n: x.grad for n, x in leaves.items() if x is not None}}


def _check_all(name_dtype, got: dict, exact: dict, base: dict) -> None:
    for name, value in got.items():
        R.assert_within_rule(name, value, exact[name], base.get(name), name_dtype)


def run_case(case: Case, backend: str, dtype, *, device=DEVICE, seed=0) -> None:
    """Forward and gradients of ``attention`` with the case's variants against the oracle, under the rule."""
    q, k, v, do, kw, oracle = _inputs(case, dtype, device, seed)
    o, lse = onlineattn.attention(q, k, v, return_lse=True, backend=backend, **kw)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    dlse = dlse.masked_fill(torch.isinf(lse), 0.0)
    _loss(o, lse, do, dlse).backward()
    o_exact, lse_exact = R.naive_attention(q, k, v, return_lse=True, **oracle)
    grads = R.naive_attention_grads(q, k, v, do, dlse=dlse, **oracle)
    got = {"o": o, "lse": lse, **{n: x.grad for n, x in _leaves(q, k, v, kw).items() if x is not None}}
    base = _baseline(R.torch_math_attention, q, k, v, do, dlse, oracle)
    _check_all(_name(dtype), got, {"o": o_exact, "lse": lse_exact, **grads}, base)
    empty = np.isneginf(lse_exact)
    if empty.any():  # rows that see no key: o = 0, and no NaN anywhere
        assert torch.all(o.detach().transpose(1, 2)[torch.from_numpy(empty)] == 0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_minus_inf_sink_over_rows_that_see_no_key_has_gradient_0(backend):
    """A sink of -inf (no sink for that head) on rows that see no key (causal, Sq > Sk): their lse is -inf, and
    the sink's probability exp(sink - lse) must be 0 there, not exp(-inf + inf) = NaN, in dsinks (and the oracle's)."""
    dtype = torch.float16 if backend == "triton" else torch.float32
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, s, h, 32, generator=gen).to(DEVICE, dtype).requires_grad_()
               for s, h in ((9, 4), (4, 2), (4, 2)))
    sinks = torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0], device=DEVICE).requires_grad_()
    o = onlineattn.attention(q, k, v, causal=True, sinks=sinks, backend=backend)
    do = torch.randn(o.shape, generator=gen).to(DEVICE, dtype)
    o.backward(do)
    exact = R.naive_attention_grads(q, k, v, do, causal=True, sinks=sinks)
    assert np.isfinite(exact["dsinks"]).all() and (exact["dsinks"][[0, 2]] == 0).all()
    assert torch.isfinite(sinks.grad).all() and (sinks.grad[[0, 2]] == 0).all()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    R.torch_math_attention(*leaves[:3], causal=True, sinks=leaves[3])[0].backward(do)
    R.assert_within_rule("dsinks", sinks.grad, exact["dsinks"], leaves[3].grad, _name(dtype))


CASES = {
    # one variant at a time
    "window": Case(window=(5, 3), sq=29),
    "window-causal-masked-rows": Case(causal=True, window=(6, -1), sq=31, sk=19),
    "softcap": Case(softcap=5.0, sq=17, sk=33),
    "alibi": Case(alibi=(4,), causal=True, sq=17, sk=17, d=32, dv=32),
    "bias": Case(bias=(1, 4, 17, 23)),
    "sinks-masked-rows": Case(sinks=True, causal=True, sq=25, sk=13, hkv=1),
    "dropout": Case(dropout_p=0.3, b=1, sq=19, sk=21),
    # combinations
    "window-causal-gqa3-softcap": Case(causal=True, window=(7, 0), softcap=3.0, hq=6, hkv=2, sq=33, sk=33, d=32),
    "alibi-window-sinks": Case(window=(4, 4), alibi=(2, 4), sinks=True, sq=21),
    "bias-softcap-causal": Case(bias=(2, 1, 1, 23), softcap=2.0, causal=True, sq=13),
    "sinks-dropout-causal": Case(sinks=True, dropout_p=0.2, causal=True, sq=19, sk=15),
    "everything": Case(causal=True, window=(5, 0), softcap=4.0, alibi=(4,), bias=(17, 23), sinks=True,
                       dropout_p=0.25),
}
BACKEND_DTYPES = [("torch", torch.float64), ("torch", torch.bfloat16), ("triton", torch.float32),
                  ("triton", torch.float16)]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES, ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x)
@pytest.mark.parametrize("name", list(CASES))
def test_variant_matches_oracle(name, backend, dtype):
    run_case(CASES[name], backend, dtype, device=DEVICE if backend == "triton" else "cpu", seed=len(name))


@pytest.mark.parametrize("name", list(CASES))
def test_variant_through_the_pipelined_forward_loop(name, monkeypatch):
    """Every variant through the forward's software-pipelined key loop (16-key blocks, so the unmasked loop of the
    longer cases runs several iterations)."""
    from onlineattn.ops import forward as F

    table = F.fwd_config
    monkeypatch.setattr(F, "fwd_config", lambda *a, **kw: dataclasses.replace(table(*a, **kw), block_n=16,
                                                                                  pipeline=True))
    case = dataclasses.replace(CASES[name], sk=CASES[name].sk + 40) if not CASES[name].bias else CASES[name]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    run_case(case, "triton", dtype, seed=len(name))


@pytest.mark.parametrize("name", list(CASES))
def test_variant_through_split_score_tiles(name, monkeypatch):
    """Every variant through the dK/dV kernel's SPLIT_SCORES branch (the d = 256 table entry on the GPU)."""
    from onlineattn.ops import backward as B

    table = B.bwd_config

    def split(*a, **kw):
        config = table(*a, **kw)
        return dataclasses.replace(config, dkdv=dataclasses.replace(config.dkdv, split_scores=True))

    monkeypatch.setattr(B, "bwd_config", split)
    monkeypatch.setattr(B, "_STEPS", {})  # a step kept by an earlier window / sink call would skip the table
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    run_case(CASES[name], "triton", dtype, seed=len(name) + 1)


def test_softcap_tames_logits_near_fp16_overflow():
    """q scaled by 60 in float16: raw scores in the thousands, capped to ±20."""
    run_case(Case(softcap=20.0, causal=True, q_scale=60.0, sq=33, sk=47, d=64, dv=64), "triton", torch.float16)


@pytest.mark.parametrize("shape", [(23,), (17, 23), (2, 1, 1, 23), (1, 4, 1, 1), (2, 4, 17, 23)], ids=str)
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)], ids=["torch", "triton"])
def test_bias_gradient_reduces_over_broadcast_dims(shape, backend, dtype):
    run_case(Case(bias=shape, causal=True, sq=17, sk=23, d=16, dv=16), backend, dtype)


def test_bias_without_grad_and_non_contiguous_inputs():
    """A bias that needs no gradient gets none; q, k, v, ALiBi slopes and sinks as strided views."""
    case = Case(bias=(2, 4, 17, 23), window=(3, 3))
    q, k, v, do, kw, oracle = _inputs(case, torch.float32, DEVICE, seed=3)
    kw["attn_bias"] = kw["attn_bias"].detach()
    oracle["alibi_slopes"] = kw["alibi_slopes"] = torch.rand(2, 8, device=DEVICE)[:, ::2]
    oracle["sinks"] = kw["sinks"] = torch.randn(8, device=DEVICE)[1::2]
    q2 = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # [B, S, H, D] view of [B, H, S, D]
    assert not q2.is_contiguous()
    o = onlineattn.attention(q2, k, v, backend="triton", **kw)
    o.backward(do)
    R.assert_within_rule("o", o, R.naive_attention(q, k, v, **oracle))
    R.assert_within_rule("dq", q2.grad, R.naive_attention_backward(q, k, v, do, **oracle)[0])
    assert kw["attn_bias"].grad is None


# ---- varlen ---------------------------------------------------------------------------------------------------


def run_varlen(case: Case, lengths_q, lengths_k, backend, dtype, *, device=DEVICE, seed=0):
    """``attention_varlen`` over sequences of the given lengths (zero allowed) against the oracle's varlen."""
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32, device=device)
    n, max_q, max_k = len(lengths_q), max(lengths_q), max(lengths_k)
    case = dataclasses.replace(case, b=n, sq=max_q, sk=max_k)  # the padded shape of the dropout mask
    q, k, v, do, kw, oracle = _inputs(case, dtype, device, seed, rows=(sum(lengths_q), sum(lengths_k)))
    o, lse = onlineattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, backend=backend, **kw)
    assert o.shape == (sum(lengths_q), case.hq, case.dv) and lse.shape == (case.hq, sum(lengths_q))
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    dlse = dlse.masked_fill(torch.isinf(lse), 0.0)
    _loss(o, lse, do, dlse).backward()
    o_exact, lse_exact = R.naive_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **oracle)
    grads = R.naive_attention_varlen_grads(q, k, v, do, cu_q, cu_k, dlse=dlse, **oracle)
    got = {"o": o, "lse": lse, **{n: x.grad for n, x in _leaves(q, k, v, kw).items() if x is not None}}
    fn = lambda q, k, v, **kw: R.torch_math_attention_varlen(q, k, v, cu_q, cu_k, **kw)
    base = _baseline(fn, q, k, v, do, dlse, oracle)
    _check_all(_name(dtype), got, {"o": o_exact, "lse": lse_exact, **grads}, base)


VARLEN_CASES = {
    "causal": Case(causal=True),
    "window-causal-gqa-softcap-sinks-alibi-dropout": Case(causal=True, window=(4, 0), softcap=3.0, sinks=True,
                                                          alibi=(5, 4), dropout_p=0.2),
    "window-two-sided": Case(window=(3, 5), hq=6, hkv=3),
}


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES, ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x)
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_matches_oracle(name, backend, dtype):
    """Five sequences: odd lengths, an empty one, one with queries but no key, Sq > Sk (masked rows) and Sq < Sk."""
    run_varlen(VARLEN_CASES[name], [5, 0, 33, 3, 17], [9, 4, 20, 0, 17], backend, dtype,
               device=DEVICE if backend == "triton" else "cpu", seed=len(name))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_equals_attention_per_sequence(backend):
    device = DEVICE if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(7)
    lengths = [7, 1, 12]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(20, h, 16, generator=gen).to(device) for h in (4, 2, 2))
    o = onlineattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True, window_size=(3, 0), backend=backend)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        one = onlineattn.attention(q[None, rows], k[None, rows], v[None, rows], causal=True, window_size=(3, 0),
                                   backend=backend)
        torch.testing.assert_close(o[rows], one[0], rtol=1e-6, atol=1e-6)
        start += n


def test_varlen_beyond_the_grid_limit_launches_in_slices(monkeypatch):
    """CUDA allows 65535 program columns; with a small stand-in limit the sequences launch in slices, and dropout and
    ALiBi still count sequences from the call's first."""
    from onlineattn.ops import forward as F

    monkeypatch.setattr(F, "MAX_GRID_Y", 4)  # 2 kv heads -> 2 sequences per launch, 3 launches for 5
    run_varlen(Case(causal=True, alibi=(5, 4), dropout_p=0.2, d=16, dv=16), [5, 0, 9, 3, 7], [6, 4, 9, 0, 7],
               "triton", torch.float32, seed=12)


# ---- the window's block skipping ------------------------------------------------------------------------------


def test_torch_path_visits_only_the_band():
    """The torch path's tiles: every visited tile holds a visible key; every tile that holds one is visited; masks
    exactly where a tile crosses an edge. So the cost is O(N · window)."""
    from onlineattn import torch_impl

    sq, sk, chunk, block = 300, 260, 16, 32
    for band in ((40, 0), (7, 19), (0, 0)):
        visible = R.visible_mask(sq, sk, False, band)
        seen = set()
        for i0, i1, j0, j1, mask in torch_impl._tiles(sq, sk, band, chunk, block, False, "cpu"):
            tile = visible[i0:i1, j0:j1]
            assert tile.any()
            assert (mask is None) == tile.all()
            if mask is not None:
                assert np.array_equal(~mask.numpy(), tile)
            seen.add((i0, j0))
        wanted = {(i0, j0) for i0 in range(0, sq, chunk) for j0 in range(0, sk, block)
                  if visible[i0:i0 + chunk, j0:j0 + block].any()}
        assert seen == wanted


@triton.jit
def ranges_kernel(OUT, seqlen_q, seqlen_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP: tl.constexpr, KEYS: tl.constexpr):
    pid = tl.program_id(0)
    if KEYS:
        lo, full_lo, full_hi, hi = band_key_range(pid * BLOCK_M, seqlen_q, seqlen_k, left, right, BLOCK_M,
                                                  BLOCK_N, GROUP)
    else:
        lo, full_lo, full_hi, hi = band_row_range(pid * BLOCK_N, seqlen_q, seqlen_k, left, right, BLOCK_M,
                                                  BLOCK_N, GROUP)
    tl.store(OUT + pid * 4, lo)
    tl.store(OUT + pid * 4 + 1, full_lo)
    tl.store(OUT + pid * 4 + 2, full_hi)
    tl.store(OUT + pid * 4 + 3, hi)


def test_kernel_ranges_cover_the_band_and_skip_the_rest():
    """``band_key_range`` / ``band_row_range`` (the kernels' block ranges) against the mask, tile by tile: the
    visited blocks hold every visible key, the whole blocks are all visible, and no visited block is wholly hidden."""
    bm, bn, group = 16, 8, 2
    for sq, sk, left, right in ((40, 57, 9, 0), (57, 40, 2**30, 3), (33, 33, 5, 2**30), (20, 70, 0, 0)):
        window = tuple(-1 if side == 2**30 else side for side in (left, right))  # 2^30 is the kernels' unbounded
        visible = np.repeat(R.visible_mask(sq, sk, False, window), group, axis=0)  # packed rows: GROUP per query
        for keys, tiles, step_t, step_b in ((True, -(-sq * group // bm), bm, bn), (False, -(-sk // bn), bn, bm)):
            out = torch.empty(tiles * 4, dtype=torch.int32, device=DEVICE)
            ranges_kernel[(tiles,)](out, sq, sk, left, right, bm, bn, group, keys)
            grid = visible if keys else visible.T
            for t, (lo, full_lo, full_hi, hi) in enumerate(out.view(-1, 4).tolist()):
                tile = grid[t * step_t:(t + 1) * step_t]
                assert lo <= full_lo <= full_hi <= hi and lo % step_b == 0
                cols = np.nonzero(tile.any(axis=0))[0]
                if len(cols):
                    assert lo <= cols[0] and cols[-1] < hi
                for start in range(lo, hi, step_b):
                    block = tile[:, start:start + step_b]
                    assert block.any(), f"block {start} of tile {t} is visited but hidden from every row"
                    if full_lo <= start < full_hi:
                        assert block.all()


# ---- bad arguments and unsupported combinations -----------------------------------------------------------------


def _qkv(b=2, sq=5, sk=7, hq=4, hkv=2):
    return torch.randn(b, sq, hq, 8), torch.randn(b, sk, hkv, 8), torch.randn(b, sk, hkv, 8)


@pytest.mark.parametrize(
    "kw,exc,shown",
    [
        (dict(window_size=(2,)), TypeError, "window_size"),
        (dict(window_size=(-2, 0)), ValueError, "-2"),
        (dict(window_size=(1.5, 0)), TypeError, "float"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(dropout_p=1.0), ValueError, "dropout_p"),
        (dict(dropout_p="0.1"), TypeError, "dropout_p"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError, "alibi_slopes"),
        (dict(attn_bias=torch.zeros(2, 4, 5, 6)), ValueError, "(2, 4, 5, 7)"),
        (dict(attn_bias=torch.zeros(1, 2, 4, 5, 7)), ValueError, "attn_bias"),
        (dict(attn_bias=torch.zeros(5, 7, dtype=torch.bool)), TypeError, "attn_bias"),
        (dict(attn_bias=torch.zeros(5, 7, device="meta")), ValueError, "device"),
        (dict(sinks=torch.zeros(2)), ValueError, "sinks"),
        (dict(generator=3), TypeError, "generator"),
    ],
    ids=lambda x: repr(x)[:40] if isinstance(x, dict) else None,
)
def test_bad_variant_arguments(kw, exc, shown):
    with pytest.raises(exc, match=None) as info:
        onlineattn.attention(*_qkv(), backend="torch", **kw)
    assert shown in str(info.value), str(info.value)


def test_alibi_slopes_get_no_gradient():
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        onlineattn.attention(*_qkv(), alibi_slopes=torch.ones(4, requires_grad=True))


def _varlen(cu_q=None, cu_k=None, max_q=5, max_k=5, **kw):
    q, k, v = torch.randn(8, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32) if cu_q is None else cu_q
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32) if cu_k is None else cu_k
    return lambda: onlineattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


@pytest.mark.parametrize(
    "fn,exc,shown",
    [
        (_varlen(cu_q=torch.tensor([0, 3, 8])), TypeError, "cu_seqlens_q has dtype int64"),
        (_varlen(cu_q=torch.tensor([0, 9, 8], dtype=torch.int32)), ValueError, "non-decreasing"),
        (_varlen(cu_k=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k[-1] must equal"),
        (_varlen(cu_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "start at 0"),
        (_varlen(cu_k=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "one length"),
        (_varlen(cu_q=torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")), ValueError, "device"),
        (_varlen(max_q=4), ValueError, "max_seqlen_q = 4"),
        (_varlen(max_k=4.0), TypeError, "max_seqlen_k"),
        (_varlen(attn_bias=torch.zeros(1)), NotImplementedError, "attn_bias"),
        (lambda: onlineattn.attention_varlen(torch.randn(1, 8, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8),
                                             torch.tensor([0, 8], dtype=torch.int32),
                                             torch.tensor([0, 9], dtype=torch.int32), 8, 9), ValueError, "3 dims"),
    ],
)
def test_bad_varlen_arguments(fn, exc, shown):
    with pytest.raises(exc) as info:
        fn()
    assert shown in str(info.value), str(info.value)


# ---- custom ops and torch.compile ---------------------------------------------------------------------------


def _op_case(device, dtype):
    case = Case(b=1, sq=9, sk=11, hq=4, hkv=2, d=16, dv=16)
    q, k, v, do, _, _ = _inputs(case, dtype, device, seed=9)
    gen = torch.Generator().manual_seed(9)
    bias, sinks = torch.randn(1, 4, 1, 11, generator=gen), torch.randn(4, generator=gen)
    rng = draw_rng_state(torch.Generator().manual_seed(1)).to(device)
    mods = (3, 0, 2.0, torch.rand(4, generator=gen).to(device), bias.to(device, dtype), sinks.to(device, dtype), 0.2,
            rng)
    return [x.detach() for x in (q, k, v, do)], mods


@pytest.mark.parametrize("path", ["blockwise", "attention"])
def test_ops_with_variants_pass_opcheck(path):
    device, dtype = ("cpu", torch.float64) if path == "blockwise" else (DEVICE, torch.float32)
    fwd, bwd = getattr(torch.ops.onlineattn, f"{path}_fwd"), getattr(torch.ops.onlineattn, f"{path}_bwd")
    (q, k, v, do), mods = _op_case(device, dtype)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(fwd, (q, k, v, 0.25, True, *mods), test_utils=checks)
    o, lse = fwd(q, k, v, 0.25, True, *mods)
    torch.library.opcheck(bwd, (do, q, k, v, o, lse, None, 0.25, True, *mods, None, None, 0, 0, True),
                          test_utils=checks)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    packed = (q[0], k[0, :9], v[0, :9])
    varlen_mods = (-1, -1, 0.0, None, None, mods[5], 0.0, None, cu, cu, 5, 5)
    torch.library.opcheck(fwd, (*packed, 0.25, True, *varlen_mods), test_utils=checks)


def test_compiled_variants_on_the_torch_path_match_eager():
    """torch.compile traces the variant keywords into the custom op (no graph break with fullgraph=True)."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 37, 4, 16, generator=gen) for _ in range(3))
    sinks = torch.randn(4, generator=gen)

    def step(q, k, v, sinks):
        o = onlineattn.attention(q, k, v, causal=True, window_size=(8, 0), softcap=5.0, sinks=sinks, backend="torch")
        return (o * o).sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    torch.compile(step, fullgraph=True)(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    step(*eager).backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16 at scale. The exact values come from torch math attention in float64 on the GPU (the oracle's
# definitions, as reference.torch_math_attention), since NumPy would be too slow at these sizes.

GPU_CASES = {
    "window-causal": Case(causal=True, window=(255, 0)),
    "window-two-sided": Case(window=(100, 300)),
    "softcap": Case(softcap=30.0, causal=True, q_scale=8.0),
    "alibi": Case(alibi=(2, 8), causal=True),
    "bias-full": Case(bias=(2, 8, 1000, 1300)),
    "bias-broadcast": Case(bias=(2, 1, 1, 1300), causal=True),
    "sinks": Case(sinks=True, causal=True),
    "dropout": Case(dropout_p=0.15),
    "window-causal-gqa-softcap": Case(causal=True, window=(200, 0), softcap=20.0),
    "alibi-window-sinks": Case(window=(64, 64), alibi=(8,), sinks=True),
    "bias-softcap-causal": Case(bias=(1, 8, 1000, 1300), softcap=10.0, causal=True),
    "sinks-dropout-causal": Case(sinks=True, dropout_p=0.1, causal=True),
    "everything": Case(causal=True, window=(300, 0), softcap=15.0, alibi=(8,), bias=(1000, 1300), sinks=True,
                       dropout_p=0.1),
}


def run_case_gpu(case: Case, *, seed=0):
    q, k, v, do, kw, oracle = _inputs(case, torch.bfloat16, "cuda", seed)
    o, lse = onlineattn.attention(q, k, v, return_lse=True, **kw)
    dlse = torch.randn(lse.shape, device="cuda").masked_fill(torch.isinf(lse), 0.0)
    _loss(o, lse, do, dlse).backward()
    exact = _baseline_exact(q, k, v, do, dlse, oracle)
    base = _baseline(R.torch_math_attention, q, k, v, do, dlse, oracle)
    got = {"o": o, "lse": lse, **{n: x.grad for n, x in _leaves(q, k, v, kw).items() if x is not None}}
    _check_all("bfloat16", got, exact, base)


def _baseline_exact(q, k, v, do, dlse, oracle):
    """float64 autograd of torch math attention: exact to ~1e-15, against which bf16 errors are measured."""
    kw = {n: (x.detach().double().requires_grad_() if n in ("attn_bias", "sinks") else x) for n, x in oracle.items()}
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o, lse = R.torch_math_attention(*leaves, **kw)
    _loss(o, lse, do.double(), dlse.double()).backward()
    named = _leaves(*leaves, kw)
    return {"o": o.detach(), "lse": lse.detach(), **{n: x.grad for n, x in named.items() if x is not None}}


@gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_variant_bf16_gpu(name):
    case = dataclasses.replace(GPU_CASES[name], b=2, sq=1000, sk=1300, hq=8, hkv=2, d=128, dv=128)
    run_case_gpu(case, seed=len(name))


@gpu
@pytest.mark.parametrize("d", [64, 256])
def test_variant_head_dims_bf16_gpu(d):
    """The other padded head dims compile their own tiles with every flag on."""
    run_case_gpu(dataclasses.replace(GPU_CASES["everything"], b=1, sq=700, sk=900, hq=4, hkv=4, d=d, dv=d,
                                     alibi=(4,), bias=(700, 900)))


@gpu
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_bf16_gpu(name):
    lengths_q = [1500, 0, 1, 777, 2048, 300, 1023]
    lengths_k = [1500, 5, 0, 900, 2048, 129, 1100]
    case = dataclasses.replace(VARLEN_CASES[name], hq=8, hkv=2, d=128, dv=128,
                               alibi=(7, 8) if VARLEN_CASES[name].alibi else None)
    run_varlen(case, lengths_q, lengths_k, "triton", torch.bfloat16, device="cuda", seed=len(name))


@gpu
def test_long_sliding_window_rows_bf16_gpu():
    """N = 16384, window 1024: rows [a, c) of a causal window see keys [a - 1023, c), so slices are checked
    against float64 math over only those keys."""
    n, left = 16384, 1023
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    o, lse = onlineattn.attention(q, k, v, causal=True, window_size=(left, 0), return_lse=True)
    assert not torch.isnan(o).any()
    for a in (0, 5000, n - 300):
        rows, keys = slice(a, a + 300), slice(max(0, a - left), a + 300)
        sub = (q[:, rows], k[:, keys], v[:, keys])
        kw = dict(causal=True, window_size=(left, 0))
        exact = R.torch_math_attention(*(x.double() for x in sub), **kw)
        base = R.torch_math_attention(*sub, **kw)
        R.assert_within_rule("o", o[:, rows], exact[0], base[0], "bfloat16")
        R.assert_within_rule("lse", lse[:, :, rows], exact[1], base[1], "bfloat16")


@gpu
def test_variant_backward_is_bitwise_deterministic_gpu():
    case = dataclasses.replace(GPU_CASES["everything"], b=2, sq=700, sk=900, hq=8, hkv=2, d=128, dv=128,
                               bias=(1, 8, 700, 900))
    runs = []
    for _ in range(20):
        q, k, v, do, kw, _ = _inputs(case, torch.bfloat16, "cuda", seed=4)
        onlineattn.attention(q, k, v, **kw).backward(do)
        runs.append([x.grad for x in (q, k, v, kw["attn_bias"], kw["sinks"])])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


@gpu
def test_ops_with_variants_pass_opcheck_gpu():
    from onlineattn.ops import backward, forward  # noqa: F401  (the ops register on import; alone in a worker, no
    #                                                call has imported them yet)
    (q, k, v, do), mods = _op_case("cuda", torch.bfloat16)
    torch.library.opcheck(torch.ops.onlineattn.attention_fwd, (q, k, v, 0.25, True, *mods))
    o, lse = torch.ops.onlineattn.attention_fwd(q, k, v, 0.25, True, *mods)
    torch.library.opcheck(torch.ops.onlineattn.attention_bwd,
                          (do, q, k, v, o, lse, None, 0.25, True, *mods, None, None, 0, 0, True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_maxima_past_the_packed_length_give_the_same_answer(backend):
    """``max_seqlen_*`` may exceed every sequence (flash-attn accepts an upper bound); one past the packed length
    (2**31 here, which would size the grid) gives what the true maxima give, without launching empty programs."""
    torch.manual_seed(0)
    exact = _varlen(max_q=5, max_k=5, backend=backend)()
    torch.manual_seed(0)  # the same q, k and v
    assert torch.equal(_varlen(max_q=2**31, max_k=2**31, backend=backend)(), exact)
