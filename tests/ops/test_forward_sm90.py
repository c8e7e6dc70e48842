"""The warp-specialized Hopper forward (ops/forward_sm90.py): where the table routes it, that it compiles for sm_90
on any machine (Gluon has no interpreter), and on an sm_90 GPU that it meets the §3 rule on odd shapes, masked rows,
tiles with no visible key, GQA, strided inputs and both half dtypes."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.ops.test_forward import _check, _check_rows, _inputs, _run_poisoned

from onlineattn import reference as R
from onlineattn._mods import PLAIN, Mods
from onlineattn.ops import forward as F
from onlineattn.ops._configs import (
    _FWD_WS, _FWD_WS_SHORT, _FWD_WS_WIDE, LAZY_RESCALE_FROM, WS_CAUSAL_PERSISTENT_BELOW, WS_MIN_KEYS, WS_SHORT_KEYS,
    WS_WIDE_FROM, WS_WINDOW_MIN_SPAN, WS_WINDOW_PERSISTENT_BELOW, TAIL_MAX_PIECES, TAIL_MIN_GAIN,
    FWD_TAIL_MIN_KEYS, TAIL_MIN_PIECE_BLOCKS, fwd_config, tail_pieces,
)

ROOT = Path(__file__).resolve().parents[2]
sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="needs an sm_90 GPU")
gpu = pytest.mark.gpu


def test_table_routes_plain_half_d64_d128_d256():
    """d = 64, 128 and 256 in half precision from WS_MIN_KEYS rows and keys (per mask), causal launches persistent
    below WS_CAUSAL_PERSISTENT_BELOW and one program per tile from it, and with both lengths in WS_SHORT_KEYS the
    tile of _FWD_WS_SHORT where it has one; never without ws_ok, variants, for other head dims, unequal head dims,
    float32 or an unknown length. (Lazy rescaling and d = 64's 192-row tiles, a length's choices too, are left to
    the next tests.)"""
    pick = lambda d=128, dv=None, dtype=torch.bfloat16, causal=False, sk=4096, **kw: replace(fwd_config(  # noqa: E731
        d, dv or d, dtype, causal, "cuda", seqlen_q=sk, seqlen_k=sk, **{"ws_ok": True, **kw}), lazy_rescale=False)
    for d in (64, 128, 256):
        for causal in (False, True):
            least = max(WS_MIN_KEYS[d][causal], WS_SHORT_KEYS[1] if (d, causal) in _FWD_WS_SHORT else 0)
            persistent_below = WS_CAUSAL_PERSISTENT_BELOW[d] if causal else 1 << 40
            want = replace(_FWD_WS[causal][d], persistent=_FWD_WS[causal][d].persistent or least < persistent_below)
            assert pick(d, causal=causal, sk=least) == want
            assert pick(d, causal=causal, sk=least, dtype=torch.float16) == want
            top = max(least, persistent_below)  # d = 64: the 192-row tiles take over first (WS_WIDE_FROM)
            wide = top >= WS_WIDE_FROM.get((d, causal), 1 << 41)
            assert pick(d, causal=causal, sk=top) == (_FWD_WS_WIDE[causal] if wide else _FWD_WS[causal][d])
            below = pick(d, causal=causal, sk=least - 1)
            assert below == _FWD_WS_SHORT[d, causal] if (d, causal) in _FWD_WS_SHORT else not below.gluon
            assert not pick(d, causal=causal, sk=None).gluon
            short_q = fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=64, seqlen_k=65536, ws_ok=True)
            assert not short_q.gluon  # short queries keep the Triton tiles (they pack a GQA group's rows)
    assert not _FWD_WS[True][64].persistent and pick(64, causal=True, sk=2048).persistent  # a length's choice
    # Both lengths in WS_SHORT_KEYS: calls the kernel could run take _FWD_WS_SHORT's tile where it has one (causal
    # d = 64 and 128: the Gluon kernel at 64-key blocks, persistent).
    lo, hi = WS_SHORT_KEYS
    assert WS_SHORT_KEYS == (512, 1024) and set(_FWD_WS_SHORT) == {(64, True), (128, True)}
    for d in (64, 128):
        short = _FWD_WS_SHORT[d, True]
        assert short.gluon and short.persistent and short.block_n == 64
        assert pick(d, causal=True, sk=lo) == pick(d, causal=True, sk=hi - 1) == short
        unequal = fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=lo, seqlen_k=hi - 1, ws_ok=True)
        assert unequal == short == fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=hi - 1, seqlen_k=lo,
                                              ws_ok=True)
        assert pick(d, causal=True, sk=lo - 1) == pick(d, causal=True, sk=lo, ws_ok=False) == fwd_config(
            d, d, torch.bfloat16, True, "cuda")
        assert pick(d, causal=True, sk=lo, variants=True) != short and pick(d, sk=lo) != short
        chunk = fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=512, seqlen_k=32768, ws_ok=True)
        assert chunk != short  # a short chunk over a long cache: unmeasured
    assert pick(64, causal=True, sk=1024) == replace(_FWD_WS[True][64], persistent=True)
    assert not pick(sk=16384, ws_ok=False).gluon and not pick(sk=16384, variants=True).gluon
    for other in (pick(dv=64, sk=16384), pick(d=96, sk=16384), pick(d=32, sk=16384), pick(d=256, dv=128, sk=16384)):
        assert not other.gluon
    assert not fwd_config(128, 128, torch.float32, False, "cuda", seqlen_k=16384, ws_ok=True).gluon


def test_table_takes_three_warpgroups_at_d64_from_their_lengths():
    """d = 64 plain half-precision calls take _FWD_WS_WIDE's 192-row tiles (three consumer warpgroups over 128-key
    blocks) from WS_WIDE_FROM rows and keys (per mask), the 128-row tiles below, and never where the Gluon kernel
    does not run or at other head dims."""
    assert set(WS_WIDE_FROM) == {(64, False), (64, True)}
    for causal in (False, True):
        wide, least = _FWD_WS_WIDE[causal], WS_WIDE_FROM[64, causal]
        assert wide.block_m == 192 and wide.block_n == 128 and wide.early_p and wide.gluon
        for dtype in (torch.bfloat16, torch.float16):
            at = lambda sq, sk=None, **kw: fwd_config(64, 64, dtype, causal, "cuda", seqlen_q=sq,  # noqa: E731
                                                      seqlen_k=sk or sq, **{"ws_ok": True, **kw})
            assert at(least) == at(4 * least) == at(least, 8 * least) == wide
            below = at(least - 1)
            assert below.gluon and below.block_m == 128
            assert at(least, least - 1).block_m == 128  # both lengths from WS_WIDE_FROM
            assert not at(least, ws_ok=False).gluon and not at(least, variants=True).gluon
        assert fwd_config(128, 128, torch.bfloat16, causal, "cuda", seqlen_q=16384, seqlen_k=16384,
                          ws_ok=True).block_m == 128
    assert not _FWD_WS_WIDE[True].persistent and _FWD_WS_WIDE[False].persistent  # as measured


def test_table_rescales_lazily_from_its_lengths():
    """The Gluon tile keeps stale row maxima (lazy_rescale) from LAZY_RESCALE_FROM's keys for its (d, mask), and
    never for the others or off the Gluon kernel."""
    assert LAZY_RESCALE_FROM == {(128, True): 4096, (256, False): 1024, (256, True): 4096}
    for d in (64, 128, 256):
        for causal in (False, True):
            start = LAZY_RESCALE_FROM.get((d, causal))
            for n in (512, 1023, 1024, 4095, 4096, 16384, 65536):
                cfg = fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=n, seqlen_k=n, ws_ok=True)
                assert cfg.lazy_rescale == (cfg.gluon and start is not None and n >= start), (d, causal, n)
                assert not fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=n, seqlen_k=n).lazy_rescale
    # Keyed by the keys a row may see: a short chunk over a long cache rescales lazily, long queries over few keys
    # do not.
    assert fwd_config(256, 256, torch.bfloat16, True, "cuda", seqlen_q=512, seqlen_k=8192, ws_ok=True).lazy_rescale
    assert not fwd_config(256, 256, torch.bfloat16, True, "cuda", seqlen_q=8192, seqlen_k=512, ws_ok=True).lazy_rescale


def test_gluon_tile_is_refused_where_it_cannot_run():
    """A gluon tile passed as ``config`` still needs a call the kernel can run (CPU tensors here: not sm_90), and
    the launcher refuses tiles other than 128 rows over two 4-warp warpgroups (or 192 over three at d = 64 only:
    their consumers have 160 registers a thread), and tiles whose Q, K/V stages and O
    staging buffers exceed an SM's shared memory (three 128-key stages at d = 128, two Q buffers at d = 256), Q
    buffer counts other than 1 and 2, key blocks other than 64 and 128, a single K/V stage (warpgroup 0's skip
    waits for a block while its previous block is unreleased: it would wait on itself, ``_skip``) and an O of
    another dtype than q's."""
    from onlineattn.ops import forward_sm90

    q, k, v = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    assert not F.ws_ok(q, k, v, 0.1, PLAIN)
    with pytest.raises(ValueError, match="config"):
        F.forward(q, k, v, 0.1, False, config=_FWD_WS[False][128])
    for bad in (replace(_FWD_WS[False][128], block_m=64), replace(_FWD_WS[False][128], num_warps=8),
                replace(_FWD_WS[False][128], num_stages=3), replace(_FWD_WS[False][128], q_stages=0),
                replace(_FWD_WS[False][128], q_stages=3), replace(_FWD_WS[True][128], num_stages=1),
                replace(_FWD_WS_SHORT[64, True], num_stages=1), replace(_FWD_WS_SHORT[64, True], block_n=32),
                replace(_FWD_WS_SHORT[64, True], block_n=32, num_stages=4), replace(_FWD_WS[False][128], block_m=192),
                replace(_FWD_WS[False][128], block_m=256)):
        with pytest.raises(ValueError, match="config"):
            forward_sm90.launch(q, k, v, torch.empty_like(q), torch.empty(1, 2, 8), 0.1, False, bad)
    with pytest.raises(ValueError, match="in q's dtype"):  # O leaves by TMA stores of q's dtype
        forward_sm90.launch(q, k, v, torch.empty(q.shape), torch.empty(1, 2, 8), 0.1, False, _FWD_WS[False][128])
    q256 = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        forward_sm90.launch(q256, q256, q256, torch.empty_like(q256), torch.empty(1, 2, 8), 0.1, False,
                            replace(_FWD_WS[False][256], q_stages=2))
    assert forward_sm90.shared_bytes(128, replace(_FWD_WS[False][128], num_stages=3)) > forward_sm90.SHARED_BYTES
    for d in (64, 128, 256):
        for causal in (False, True):
            assert forward_sm90.shared_bytes(d, _FWD_WS[causal][d]) <= forward_sm90.SHARED_BYTES
    for d, causal in _FWD_WS_SHORT:
        assert forward_sm90.shared_bytes(d, _FWD_WS_SHORT[d, causal]) <= forward_sm90.SHARED_BYTES
    q64 = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    for causal in (False, True):
        assert forward_sm90.shared_bytes(64, _FWD_WS_WIDE[causal]) <= forward_sm90.SHARED_BYTES
        with pytest.raises(ValueError, match="192-row tiles"):  # 64-key blocks: warpgroup 0 could skip two blocks
            forward_sm90.launch(q64, q64, q64, torch.empty_like(q64), torch.empty(1, 2, 8), 0.1, causal,
                                replace(_FWD_WS_WIDE[causal], block_n=64))


def test_out_must_be_tma_aligned_for_the_gluon_tile(monkeypatch):
    """O leaves by TMA stores: an ``out`` whose base is not 16-byte aligned is routed to the Triton kernel by the
    table and refused with an explicit gluon tile (CPU tensors, ``ws_ok`` forced: the routing alone); the repeat
    key holds o's alignment."""
    monkeypatch.setattr(F, "ws_ok", lambda *args: True)
    q, k, v = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # base 2 bytes past an aligned one
    lse = torch.empty(1, 2, 8)
    with pytest.raises(ValueError, match="out"):
        F.forward(q, k, v, 0.1, False, out=odd, lse_out=lse, config=_FWD_WS[False][128])
    assert not F.tma_aligned(odd) and F.tma_aligned(torch.empty_like(q))
    key = lambda o: F._step_key(q, k, v, o, lse, 0.1, False, None)  # noqa: E731
    assert key(odd) != key(torch.empty_like(q))
    gluon = []
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, **kw: gluon.append(1))
    o, _ = F.forward(q, k, v, 0.1, False, out=odd, lse_out=lse)  # the table: the Triton kernel (interpreted here)
    assert o is odd and not gluon and torch.isfinite(o).all()


def test_out_of_another_dtype_takes_the_triton_kernel(monkeypatch):
    """O leaves the Gluon kernel by TMA stores of q's dtype: an ``out`` of another dtype (ring attention's float32
    blocks) is routed to the Triton kernel by the table and refused with an explicit gluon tile, never compiled into
    the Gluon kernel (which failed to compile: "source dtype fp32 and destination dtype bf16 must match"). CPU
    tensors, ``ws_ok`` forced: the routing alone."""
    monkeypatch.setattr(F, "ws_ok", lambda *args: True)
    q, k, v = (torch.randn(1, 8, 2, 128, dtype=torch.float16) for _ in range(3))  # the interpreter has no bfloat16
    wide, lse = torch.empty(q.shape, dtype=torch.float32), torch.empty(1, 2, 8)
    with pytest.raises(ValueError, match="out of q's dtype"):
        F.forward(q, k, v, 0.1, False, out=wide, lse_out=lse, config=_FWD_WS[False][128])
    asked, gluon = [], []
    pick = F.fwd_config
    monkeypatch.setattr(F, "fwd_config", lambda *a, **kw: asked.append(kw["ws_ok"]) or pick(*a, **kw))
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, **kw: gluon.append(1))
    o, _ = F.forward(q, k, v, 0.1, False, out=wide, lse_out=lse)  # the table: the Triton kernel (interpreted here)
    assert o is wide and not gluon and asked == [False]  # the table is told the Gluon kernel cannot take it
    F.forward(q, k, v, 0.1, False, out=torch.empty_like(q), lse_out=lse)
    assert asked == [False, True]  # an out of q's dtype can
    torch.testing.assert_close(o, F.forward(q.float(), k.float(), v.float(), 0.1, False)[0], atol=2e-2, rtol=0)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
def test_float32_out_at_gluon_lengths_matches_oracle(d):
    """A half-precision call into a float32 ``out`` (what ring attention's blocks pass) at a length where the table
    runs the Gluon kernel for q's dtype: the Triton kernel takes it, against the oracle."""
    q, k, v = _inputs(2, 1000, 1000, 4, 2, d, d, torch.bfloat16, seed=d, device="cuda")
    for causal in (False, True):
        assert fwd_config(d, d, q.dtype, causal, "cuda", seqlen_q=1000, seqlen_k=1000, ws_ok=True).gluon
        wide = torch.full(q.shape, float("nan"), device="cuda")
        lse = torch.full((2, 4, 1000), float("nan"), device="cuda")
        o, lse = F.forward(q, k, v, d ** -0.5, causal, out=wide, lse_out=lse)
        assert o is wide
        _check(q, k, v, causal, o.to(q.dtype), lse)


_COMPILE = """
import re, sys, torch, triton
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from onlineattn.ops import forward_sm90
from dataclasses import replace
from onlineattn.ops._configs import _FWD_WS, _FWD_WS_SHORT, _FWD_WS_WIDE
bf16 = torch.bfloat16
for d, causal, dtype, q_stages, sk, kind, lazy in (  # kind: the table's tile, the short one, the wide one
        (128, False, bf16, 1, 300, 0, 0), (128, True, torch.float16, 1, 300, 0, 0), (64, True, bf16, 1, 300, 0, 0),
        (256, False, bf16, 1, 300, 0, 0), (128, True, bf16, 2, 300, 0, 0), (128, True, bf16, 1, 301, 0, 0),
        (64, True, bf16, 1, 301, 0, 0), (64, False, bf16, 2, 300, 0, 0), (128, True, bf16, 1, 300, 1, 0),
        (64, True, bf16, 1, 301, 1, 0), (128, True, torch.float16, 1, 300, 0, 1), (256, False, bf16, 1, 300, 0, 1),
        (64, False, bf16, 2, 300, 2, 0), (64, True, torch.float16, 1, 300, 2, 0)):
    cfg = {{0: replace(_FWD_WS[causal][d], q_stages=q_stages), 1: _FWD_WS_SHORT.get((d, causal)),
           2: _FWD_WS_WIDE[causal]}}[kind]
    cfg = replace(cfg, lazy_rescale=bool(lazy))
    q = torch.randn(2, 300, 8, d, dtype=dtype)
    k = torch.randn(2, sk, 2, d, dtype=dtype)
    o, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    compiled = []
    run = forward_sm90.attention_fwd_sm90_kernel.run
    forward_sm90.attention_fwd_sm90_kernel.run = lambda *a, **kw: compiled.append(run(*a, **{{**kw, "warmup": True}}))
    forward_sm90.launch(q, k, k, o, lse, 0.1, causal, cfg)
    forward_sm90.attention_fwd_sm90_kernel.run = run
    ptx = compiled[0].asm["ptx"]
    print(d, causal, sk, ptx.count("wgmma.mma_async"), ptx.count("setmaxnreg"), compiled[0].metadata.shared,
          cfg.num_stages, cfg.block_n, cfg.q_stages, ptx.count("bar.sync"), cfg.block_m,
          len(re.findall(r"setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+160;", ptx)))
"""


def test_kernel_compiles_for_sm90():
    """The whole pipeline (Gluon -> PTX -> cubin) for sm_90 on this machine: two consumer warpgroups, each issuing
    the first QKᵀ (the program's first tile, and the hand-over's), QKᵀ and P·V in the key loop (tiles with a
    successor, and the last one) and the last P·V (the hand-over's, and the last tile's): 8 sites, so k = 16 per
    instruction gives 8 x (8 + 8) wgmma at d = 128 with 128-key blocks, 8 x (4 + 8) at d = 64, 8 x (16 + 4) at
    d = 256 with 64-key blocks, 8 x (8 + 4) and 8 x (4 + 4) for _FWD_WS_SHORT's 64-key tiles at d = 128 and 64
    (warpgroup 0's skip adds none). Causal with Sq = Sk at 128-key blocks (HALF_DIAG), warpgroup 0's two tile ends
    each add the half-width step (a QKᵀ of the head dim's k-steps over 64 keys and a whole P·V, ``_half_block``)
    and take their last P·V over 64 keys (4 k-steps, not 8): 24 more wgmma at d = 128 (152) and 16 at d = 64
    (112); with Sk = Sq + 1 (the diagonal off a block boundary) causal compiles without it. The last two cases
    rescale lazily (``lazy_rescale``): the same matmuls as the second and fourth, and more barriers (the
    warpgroup-wide test of the rows' maxima, a reduction across warps). Next, d = 64's 192-row tiles (_FWD_WS_WIDE,
    both masks): three consumer warpgroups, 12 sites, so 12 x (4 + 8) wgmma, without HALF_DIAG. Also the
    partitions' register split, and Q (one buffer, or two: the fifth case, the short tiles), the table's K/V
    stages and an O staging buffer per warpgroup (64 rows by up to 128 columns each) within shared memory; the
    wide tiles' consumers get 160 registers (``setmaxnreg`` in the PTX, beside the default partition's 168)."""
    out = _compiled(_COMPILE)
    lines = out.stdout.split()
    cases = ((128, "False", 300), (128, "True", 300), (64, "True", 300), (256, "False", 300), (128, "True", 300),
             (128, "True", 301), (64, "True", 301), (64, "False", 300), (128, "True", 300), (64, "True", 301),
             (128, "True", 300), (256, "False", 300), (64, "False", 300), (64, "True", 300))
    assert len(lines) == len(cases) * 12, out.stdout
    bars = lines[9::12]
    assert int(bars[10]) > int(bars[1]) and int(bars[11]) > int(bars[3])  # lazy: the warpgroup-wide test per block
    for i, (d, causal, keys) in enumerate(cases):
        head, flag, sk, wgmma, setmaxnreg, shared, stages, block_n, q_stages, _, block_m, at_160 = lines[12 * i:
                                                                                                      12 * i + 12]
        assert int(sk) == keys and int(block_m) == (192 if i >= 12 else 128)
        consumers = int(block_m) // 64
        half = {128: 24, 64: 16}[d] if causal == "True" and keys == 300 and block_n == block_m else 0  # HALF_DIAG
        sites = 4 * consumers
        assert (int(head), flag) == (d, causal) and int(wgmma) == sites * (d // 16 + int(block_n) // 16) + half
        assert int(setmaxnreg) >= 2 and (int(at_160) == 2) == (consumers == 3)  # the two worker consumers'
        o_staging = consumers * 64 * min(d, 128) * 2
        q_bytes = int(q_stages) * int(block_m) * d * 2
        assert q_bytes + int(stages) * 2 * int(block_n) * d * 2 + o_staging <= int(shared) <= 227 * 1024


def _compiled(script: str) -> subprocess.CompletedProcess:
    """Run a compile-only script (``{bench}``: the benchmarks folder) without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    out = subprocess.run([sys.executable, "-c", script.format(bench=str(ROOT / "benchmarks"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_COMPILE_WINDOW = """
import sys, torch, triton
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from onlineattn.ops import forward_sm90
from onlineattn.ops._configs import _FWD_WS, _FWD_WS_WIDE
for d, causal, band, sinks, cfg in ((128, True, (37, 0), None, _FWD_WS[True][128]),
                                    (128, False, (300, 77), None, _FWD_WS[True][128]),
                                    (64, False, (64, 2**30), None, _FWD_WS_WIDE[True]),
                                    (128, True, None, torch.zeros(8), _FWD_WS[True][128]),
                                    (256, False, (37, 0), torch.zeros(8), _FWD_WS[True][256]),
                                    (64, True, (1023, 0), torch.zeros(8), _FWD_WS_WIDE[True])):
    q = torch.randn(2, 300, 8, d, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, d, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    compiled = []
    run = forward_sm90.attention_fwd_sm90_kernel.run
    forward_sm90.attention_fwd_sm90_kernel.run = lambda *a, **kw: compiled.append(run(*a, **{{**kw, "warmup": True}}))
    forward_sm90.launch(q, k, k, o, lse, 0.1, causal, cfg, band=band, sinks=sinks)
    forward_sm90.attention_fwd_sm90_kernel.run = run
    print(d, compiled[0].asm["ptx"].count("wgmma.mma_async"))
"""


def test_window_kernel_compiles_for_sm90():
    """A window compiles for sm_90 as a causal launch: the same matmul sites as ``test_kernel_compiles_for_sm90``'s
    causal cases (8 x (8 + 8) at d = 128, plus warpgroup 0's half-width diagonal (24) where a causal window's
    diagonal falls on a block boundary, none where a window's right side moves it; d = 64's 192-row tile 12 x
    (4 + 8)); sinks, alone (causal, d = 128) or with a window (d = 256, 64-key blocks: 8 x (16 + 4); d = 64's 192-row
    tile), add none."""
    assert _compiled(_COMPILE_WINDOW).stdout.split() == ["128", "152", "128", "128", "64", "144", "128", "152", "256",
                                                         "160", "64", "144"]


_COMPILE_SPLIT = """
import sys, torch, triton
import triton.runtime.jit as jit
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from onlineattn.ops import forward_sm90
from onlineattn.ops._configs import _FWD_WS, _FWD_WS_WIDE, FWD_TAIL_MIN_KEYS
run, compiled = jit.JITFunction.run, []
warm = lambda self, *a, **kw: compiled.append((self.fn.__name__, run(self, *a, **{{**kw, "warmup": True}})))
jit.JITFunction.run = warm
for d, cfg in ((128, _FWD_WS[False][128]), (256, _FWD_WS[False][256]), (64, _FWD_WS_WIDE[False])):
    compiled.clear()
    q = torch.randn(1, cfg.block_m * 133, 1, d, dtype=torch.bfloat16)  # 133 tiles over 132 programs
    k = torch.randn(1, FWD_TAIL_MIN_KEYS[d], 1, d, dtype=torch.bfloat16)
    forward_sm90.launch(q, k, k, torch.empty_like(q), torch.empty(1, 1, q.shape[1]), 0.1, False, cfg)
    print(d, *[(name, c.asm["ptx"].count("wgmma.mma_async")) for name, c in compiled])
"""


def test_split_tail_compiles_for_sm90():
    """A launch whose last lap is cut into pieces (133 tiles over 132 programs, FWD_TAIL_MIN_KEYS keys; NOTES
    v44) compiles for sm_90 with the SPLIT kernel, the same matmul sites as the plain non-causal cases of
    ``test_kernel_compiles_for_sm90`` (a piece runs a tile's code over fewer blocks), and then the merge kernel."""
    lines = _compiled(_COMPILE_SPLIT).stdout.splitlines()
    assert lines == [f"{d} ('attention_fwd_sm90_kernel', {wgmma}) ('merge_pieces_kernel', 0)"
                     for d, wgmma in ((128, 128), (256, 160), (64, 144))], lines


# ---------------------------------------------------------------------------------------------------------------
# sm_90 GPU: the kernel itself, launched through forward() with its tile.

SHAPES = [  # b, sq, sk, hq, hkv
    (2, 1, 1, 2, 2),
    (1, 65, 100, 8, 1),  # MQA 8:1
    (2, 129, 17, 4, 4),  # Sq > Sk: under causal the first 112 rows see no key
    (2, 300, 40, 4, 2),  # causal: the first two 128-row tiles see no key at all (no block launched)
    (1, 1000, 1000, 4, 4),  # 8 key blocks: the ring's stages wrap around
    (2, 513, 700, 6, 2),  # Sk > Sq, group of 3
    (2, 300, 428, 4, 2),  # Sk - Sq = 128: causal takes HALF_DIAG at 128-key blocks; the last row tile has 44 rows
    (1, 384, 128, 2, 2),  # Sq - Sk = 256: two row tiles see no key, the third only the diagonal block (HALF_DIAG)
]


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(shape, persistent, causal, dtype, d):
    """Either schedule under either mask (the table picks one per mask; an explicit config may pick the other)."""
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, dtype, seed=sum(shape) + causal + d, device="cuda")
    o, lse = _run_poisoned(q, k, v, causal, config=replace(_FWD_WS[causal][d], persistent=persistent))
    _check(q, k, v, causal, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("lazy", [False, True], ids=["rescale", "lazy"])
@pytest.mark.parametrize("sk,dtype", [(1000, torch.bfloat16), (1024, torch.float16)], ids=["1000-bf16", "1024-fp16"])
def test_rows_whose_max_jumps_keep_or_move_it(sk, dtype, lazy, persistent, causal, d):
    """Scores that climb or fall along the keys, 32 keys at a time, by -6, 1, 4 or 12 (base-2 units) times a slope
    per row (0.2 ... 1.5). With ``lazy_rescale`` a row keeps its running max until a score passes it by 2^8
    (``_softmax``), so rows take new maxima and keep stale ones in the same block, P reaches up to 2^8, and
    warpgroups rescale O in some blocks and not others. Either way the result meets the §3 rule against the
    float64 oracle. Causal with 1024 keys (Sk - Sq = 5 · 128) puts the diagonal on a block boundary, where
    warpgroup 0 takes the diagonal block at half width (``_half_block``) at d = 64 and 128."""
    b, sq, hq, hkv = 2, 384, 4, 2
    g = torch.Generator().manual_seed(d + causal)
    steps = torch.tensor([-6.0, 1.0, 4.0, 12.0])[torch.randint(0, 4, (sk // 32 + 1,), generator=g)]
    level = torch.cumsum(steps, 0).repeat_interleave(32)[:sk]  # a row of slope 1 scores about this (base 2)
    slope = torch.linspace(0.2, 1.5, sq)
    unit = 1.0 / (1.4426950408889634 * d ** 0.5)  # q·k · d^-0.5 · log2(e) = slope · level for q = slope · unit
    q = (slope[:, None, None] + 0.05 * torch.randn(b, sq, hq, d, generator=g)) * unit
    k = level[:, None, None] + 0.05 * torch.randn(b, sk, hkv, d, generator=g)
    v = torch.randn(b, sk, hkv, d, generator=g)
    q, k, v = (x.to(device="cuda", dtype=dtype) for x in (q, k, v))
    config = replace(_FWD_WS[causal][d], persistent=persistent, lazy_rescale=lazy)
    o, lse = _run_poisoned(q, k, v, causal, config=config)
    _check(q, k, v, causal, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_stages", [1, 2])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_programs_hand_over_many_tiles(shape, q_stages, causal, d, monkeypatch):
    """A persistent grid of 3 programs, so each runs many tiles and hands each over to the next (its first QKᵀ under
    the last P·V and the epilogue): tiles of different heads, batch entries and lengths in a row, tiles with no
    visible key between others (Sq > Sk), one or two Q buffers (d = 256 has room for one)."""
    if d == 256 and q_stages == 2:
        pytest.skip("d = 256: Q, two K/V stages and the O buffers leave no room for a second Q buffer (shared_bytes)")
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + causal + d + q_stages, device="cuda")
    cfg = replace(_FWD_WS[causal][d], persistent=True, q_stages=q_stages)
    o, lse = _run_poisoned(q, k, v, causal, config=cfg)
    _check(q, k, v, causal, o, lse)


TAIL_SHAPES = [  # b, sq, sk, hq, hkv, SMs: tiles with a partial last lap at that many programs (every tile below)
    (1, 900, 2100, 2, 1, 3),  # 16 tiles (10 of 192 rows) over 3 programs, 3 pieces; last tile 4 rows, last block 52
    (3, 300, 2085, 3, 1, 5),  # batch entries and heads among the pieces, GQA 3:1
    (1, 1100, 8300, 2, 2, 7),  # past FWD_TAIL_MIN_KEYS itself (65 blocks of 128 keys, 130 of 64): 4 to 7 pieces
]


@gpu
@sm90
@pytest.mark.parametrize("lazy", [False, True], ids=["rescale", "lazy"])
@pytest.mark.parametrize("tile", ["d64", "d64-wide", "d128", "d256"])
@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_tail_matches_oracle(shape, tile, lazy, monkeypatch):
    """Non-causal persistent launches whose last lap is cut into pieces (``tail_pieces``; the SMs set so that
    every tile here has a partial last lap): each piece's float32 state, merged after the kernel
    (``merge_pieces``), meets the §3 rule for o and lse, with scores large enough (q scaled by 3) that the pieces'
    maxima differ; a second launch gives the same bits (the pieces merge in a fixed order). The key minimum is
    lowered to 2048 so that the shorter shapes split too (nothing else reads it)."""
    from onlineattn.ops import forward_sm90_schedule

    b, sq, sk, hq, hkv, sms = shape
    d = int(tile[1:].split("-")[0])
    cfg = replace(_FWD_WS_WIDE[False] if tile.endswith("wide") else _FWD_WS[False][d], persistent=True,
                  lazy_rescale=lazy)
    monkeypatch.setattr(F.forward_sm90, "FWD_TAIL_MIN_KEYS", {64: 2048, 128: 2048, 256: 2048})
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: sms)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    merged, merge = [], F.forward_sm90.merge_pieces
    monkeypatch.setattr(F.forward_sm90, "merge_pieces", lambda *args: merged.append(args[-1]) or merge(*args))
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + d + lazy, q_scale=3.0,
                      device="cuda")
    o, lse = _run_poisoned(q, k, v, False, config=cfg)
    tiles = -(-sq // cfg.block_m) * b * hq
    programs = forward_sm90_schedule.programs(tiles, sq, sk, False, cfg.block_m, cfg.block_n, sms)
    assert merged == [tail_pieces(tiles, programs, -(-sk // cfg.block_n))] and merged[0] > 1
    _check(q, k, v, False, o, lse)
    again = _run_poisoned(q, k, v, False, config=cfg)
    assert torch.equal(o, again[0]) and torch.equal(lse, again[1])


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("stages,q_stages", [(2, 1), (3, 2), (4, 2)])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_warpgroup_0_skips_blocks_its_rows_do_not_see(shape, persistent, stages, q_stages, d, monkeypatch):
    """Causal, 64-key blocks at d = 64 and 128 (d = 256's own blocks run in the tests above): a tile's last block
    lies past every row of warpgroup 0 wherever the diagonal crosses the tile's second half, and warpgroup 0 does
    not compute it. Persistent over 3 programs (many tiles each, the ring's stages wrapping across tiles) it
    releases that block at the hand-over (``_skip``; ``test_skip_shapes_hand_over_skipped_blocks`` pins which
    shapes do); one program per tile leaves it unreleased at the program's end. Two Q buffers with three or four
    stages: the short causal tiles of ``_FWD_WS_SHORT``."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + d + stages, device="cuda")
    cfg = replace(_FWD_WS[True][d], block_n=64, num_stages=stages, persistent=persistent, q_stages=q_stages,
                  early_p=_FWD_WS_SHORT[d, True].early_p)
    o, lse = _run_poisoned(q, k, v, True, config=cfg)
    _check(q, k, v, True, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_p_converted_early_or_late_matches_oracle(shape, causal, d, monkeypatch):
    """``early_p`` the other way from the table (d = 64 on, d = 128 and 256 off): P becomes wgmma's A operand right
    after its softmax, or just before its P·V. Each tile's first block, the key loop, warpgroup 0's half-width
    diagonal block (HALF_DIAG shapes), the hand-over to the next tile (3 persistent programs) and the last P·V take
    either form."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + causal + d + 7, device="cuda")
    cfg = _FWD_WS[causal][d]
    assert cfg.early_p == (d != 64)
    o, lse = _run_poisoned(q, k, v, causal, config=replace(cfg, early_p=not cfg.early_p, persistent=True))
    _check(q, k, v, causal, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stages,q_stages", [(2, 1), (3, 2), (4, 2)])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("lazy,dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16)],
                         ids=["rescale", "lazy", "rescale-fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_three_warpgroups_match_oracle(shape, lazy, dtype, persistent, stages, q_stages, causal, monkeypatch):
    """d = 64 on 192-row tiles: three consumer warpgroups, Q in three 64-row boxes a tile. Tiles whose last
    warpgroups' rows lie past Sq (every shape here but one row tile's), causal tiles where warpgroups 0 and 1 skip
    the last block (``_own_blocks``), rows that see no key, and persistent grids of 3 programs handing tiles over."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, 64, 64, dtype, seed=sum(shape) + causal + stages, device="cuda")
    cfg = replace(_FWD_WS[causal][64], block_m=192, block_n=128, num_stages=stages, q_stages=q_stages,
                  persistent=persistent, lazy_rescale=lazy, early_p=True)
    o, lse = _run_poisoned(q, k, v, causal, config=cfg)
    _check(q, k, v, causal, o, lse)


def test_skip_shapes_hand_over_skipped_blocks():
    """Where ``test_warpgroup_0_skips_blocks_its_rows_do_not_see`` releases skipped blocks at hand-overs, by a walk of
    the tile order over its 3 persistent programs at 64-key blocks: a tile that is not its program's last and whose
    warpgroup 0 sees one block fewer than the tile (never more: the ring needs the skipped blocks fewer than its
    stages, ``_skip``). Equal lengths, Sk > Sq off the block boundaries and Sq > Sk among them."""
    from onlineattn.ops.forward_sm90_schedule import programs
    counts = {}
    for shape in SHAPES[1:]:
        b, sq, sk, hq, hkv = shape
        num_tiles = -(-sq // 128) * b * hq
        count = programs(num_tiles, sq, sk, True, 128, 64, 3)
        walk = lambda t, rows=None: _tile_blocks(t, count, num_tiles, sq, sk, True, 128, 64, rows)  # noqa: E731
        assert all(walk(t) - walk(t, 64) in (0, 1) for t in range(num_tiles))
        counts[shape] = sum(walk(t) > walk(t, 64) for t in range(num_tiles - count))  # each program's last tiles
    assert {shape for shape, n in counts.items() if n} == {
        (1, 1000, 1000, 4, 4), (2, 513, 700, 6, 2), (2, 300, 428, 4, 2), (1, 384, 128, 2, 2)}, counts
    # 192-row tiles over 128-key blocks (_FWD_WS_WIDE[True]): warpgroups 0 and 1 skip one block at most, and some do.
    skipped = set()
    for sq in range(1, 1200, 7):
        for sk in range(1, 1400, 11):
            num_tiles = -(-sq // 192)
            for t in range(num_tiles):
                whole = _tile_blocks(t, num_tiles, num_tiles, sq, sk, True, 192, 128)
                for rows in (64, 128):
                    skipped.add(whole - _tile_blocks(t, num_tiles, num_tiles, sq, sk, True, 192, 128, rows))
    assert skipped == {0, 1}


def test_half_diagonal_holds_where_warpgroup_0_sees_half_the_diagonal_block():
    """``half_diagonal``: causal, 128-key blocks over 128-row tiles, Sk - Sq a multiple of 128. Checked against a
    Python walk of the kernel's tiles (as ``_tile_coords`` takes them): there, every row of warpgroup 0 (a tile's
    first 64 rows) sees no key past the first 64 of its tile's last key block, which it takes at half width."""
    from onlineattn.ops.forward_sm90_schedule import half_diagonal
    cfg = _FWD_WS[True][128]
    assert half_diagonal(512, 512, True, cfg) and half_diagonal(300, 428, True, cfg)
    assert half_diagonal(384, 128, True, cfg)
    assert not half_diagonal(512, 512, False, cfg) and not half_diagonal(500, 600, True, cfg)
    assert not half_diagonal(512, 512, True, _FWD_WS[True][256])  # 64-key blocks: a block is one warpgroup's rows
    for sq in range(1, 700, 7):
        for sk in (sk for sk in range(1, 900) if half_diagonal(sq, sk, True, cfg)):
            for m0 in range(0, sq, 128):
                hi = min(sk, m0 + 128 + sk - sq)
                last = (max(-(-hi // 128), 1) - 1) * 128  # the tile's last key block's first key
                seen = min(sk - 1, min(m0 + 63, sq - 1) + sk - sq)  # the last key any row of warpgroup 0 sees
                assert seen < last + 64, (sq, sk, m0)


def test_programs_balance_the_causal_laps():
    """The persistent program count: all tiles when they fit; under causal at the bench shape (d = 128, N = 512,
    B = 32, H = 16: 2048 tiles of 1 to 4 key blocks) 128 programs, whose snake laps pair up exactly, not 132 (an odd
    last lap); non-causal tiles are equal, so the count stays at the SMs; past 64 laps it is the SMs."""
    from onlineattn.ops.forward_sm90_schedule import programs
    assert programs(100, 512, 512, True, 128, 128, 132) == 100
    assert programs(2048, 512, 512, True, 128, 128, 132) == 128
    assert programs(2048, 512, 512, False, 128, 128, 132) == 132
    assert programs(64 * 132 + 1, 512, 512, True, 128, 128, 132) == 132
    assert programs(2048, 512, 512, True, 128, 128, 64) == 64  # 32 laps, paired
    for case in ((777, 333, 1000, True, 128, 64, 132), (300, 1024, 1024, True, 128, 128, 132),
                 (500, 700, 300, True, 128, 128, 60), (1000, 4096, 4096, False, 128, 128, 132)):
        assert programs(*case) == _busiest_least(*case), case
    # windows (launched causal): the tiles past the first window's rows all cost the same
    for case in ((777, 333, 1000, True, 128, 64, 132, (100, 0)), (300, 1024, 1024, True, 128, 128, 132, (200, 0)),
                 (500, 700, 300, True, 128, 128, 60, (37, 2**30)), (1000, 4096, 4096, True, 128, 128, 132, (1023, 0))):
        assert programs(*case) == _busiest_least(*case), case


def test_tail_pieces_cut_the_last_lap_where_it_saves():
    """``tail_pieces``: no split without a partial last lap after a whole one; else the piece count of least
    modelled cost (blocks + the overhead a piece or tile: 1 forward, 2 backward), found by a plain search here, whose
    pieces keep TAIL_MIN_PIECE_BLOCKS blocks, and only where it saves TAIL_MIN_GAIN of the launch. At the grid's
    d = 128 N = 16384 (2048 tiles of 128 blocks over 132 programs) 7 pieces: 15 laps and 68 tiles as 476 pieces of
    up to 19 blocks, at most 4 to a program (80 against a whole tile's 129)."""
    assert tail_pieces(2048, 132, 128) == 7
    assert tail_pieces(264, 132, 128) == tail_pieces(100, 132, 128) == 1
    seen = set()
    for overhead in (1, 2):
        for tiles in range(5, 3000, 37):
            for programs in (3, 7, 132):
                for blocks in (1, 4, 8, 16, 17, 32, 64, 65, 128, 256):
                    pieces = tail_pieces(tiles, programs, blocks, overhead)
                    seen.add(pieces)
                    laps, rest = divmod(tiles, programs)
                    cost = lambda s: -(-rest * s // programs) * (-(-blocks // s) + overhead)  # noqa: E731
                    options = [s for s in range(2, TAIL_MAX_PIECES + 1) if s * TAIL_MIN_PIECE_BLOCKS <= blocks]
                    best = min(options, key=lambda s: (cost(s), s), default=1)
                    whole = (laps + 1) * (blocks + overhead)
                    saves = laps and rest and laps * (blocks + overhead) + cost(best) <= (1 - TAIL_MIN_GAIN) * whole
                    assert pieces == (best if saves else 1), (tiles, programs, blocks, overhead)
    assert len(seen) > 4


def test_launch_splits_the_tail_from_its_keys(monkeypatch):
    """``forward_sm90.launch`` asks ``tail_pieces`` only for plain non-causal persistent launches (no window, no
    sinks) with at least FWD_TAIL_MIN_KEYS keys for the head dim (where the A/B gained or tied), hands the kernel the
    item count, the first piece item, the piece count and SPLIT (1s without), merges when it splits, and then keeps
    no launch for relaunch (a repeat would skip the merge), whatever ``keep`` asked."""
    from onlineattn.ops import forward_sm90, pieces
    asked, merged, kept, launched = [], [], [], []
    monkeypatch.setattr(pieces, "tail_pieces", lambda *a: asked.append(a) or 3)
    monkeypatch.setattr(forward_sm90, "start", lambda keep, *a, **kw: kept.append(keep) or launched.append((a, kw))
                        or ("kept" if keep else None))
    monkeypatch.setattr(forward_sm90, "merge_pieces", lambda *a: merged.append(a[-2:]))
    monkeypatch.setattr(forward_sm90, "_sm_count", lambda device: 5)
    monkeypatch.setattr(forward_sm90, "descriptors", lambda *a: (None,) * 4)
    for d in (64, 128, 256):
        least = FWD_TAIL_MIN_KEYS[d]
        for sk, causal, persistent, band, sinks in ((least, False, True, None, None),
                                                    (least - 1, False, True, None, None),
                                                    (least, True, True, None, None),
                                                    (least, False, False, None, None),
                                                    (least, False, True, (least, least), None),
                                                    (least, False, True, None, torch.zeros(2))):
            asked.clear(), merged.clear(), kept.clear(), launched.clear()
            cfg = replace(_FWD_WS[False][d], persistent=persistent)
            q = torch.empty(1, 700, 2, d, dtype=torch.bfloat16)
            k = torch.empty(1, sk, 2, d, dtype=torch.bfloat16)
            grid, relaunch = forward_sm90.launch(q, k, k, torch.empty_like(q), torch.empty(1, 2, 700), 0.1, causal,
                                                 cfg, keep=True, band=band, sinks=sinks)
            split = sk >= least and not causal and persistent and band is None and sinks is None
            tiles = 2 * -(-700 // cfg.block_m)
            case = (d, sk, causal, persistent, band, sinks)
            assert grid == ((5,) if persistent else (tiles,)), case
            assert asked == ([(tiles, 5, -(-sk // cfg.block_n), 1)] if split else []), case
            assert merged == ([(tiles - tiles % 5, 3)] if split else []), case
            assert kept == [not split] and (relaunch is None) == split, case
            args, kw = launched[0]
            full = tiles - tiles % 5 if split else 1
            items = tiles + (tiles - full) * 2 if split else tiles  # 3 pieces a split tile
            assert (args[-8], args[-2], args[-1], kw["SPLIT"]) == (items, full, 3 if split else 1, split), case


def _tile_blocks(t, count, num_tiles, seqlen_q, seqlen_k, causal, block_m, block_n, rows=None, band=None):
    """A plain walk of the kernel's tile order (``_tile_coords``, ``count`` programs): tile ``t``'s key blocks, or
    with ``rows`` (a warpgroup's, from the tile's first row) those they see (``_own_blocks``). ``band``: a window's
    (left, right), launched causal: the blocks start at the tile's first row's left edge (``_key0``)."""
    lap = t // count
    if lap % 2 == 1 and (lap + 1) * count <= num_tiles:
        t = lap * count + count - 1 - t % count
    num_m = -(-seqlen_q // block_m)
    pid_m = num_m - 1 - t % num_m if causal else t % num_m
    left, right = band or (0, 0)
    seen = lambda end: max(-(-min(seqlen_k, end + seqlen_k - seqlen_q + right) // block_n) if causal else  # noqa
                           -(-seqlen_k // block_n), 1)
    first = max(pid_m * block_m + seqlen_k - seqlen_q - left, 0) // block_n if band else 0
    whole = seen(pid_m * block_m + block_m) - first
    return whole if rows is None else min(seen(pid_m * block_m + rows) - first, whole)


def _busiest_least(num_tiles, seqlen_q, seqlen_k, causal, block_m, block_n, sms, band=None):
    """``programs`` by a plain walk of the kernel's tile order: each program's tiles, lap by lap."""
    blocks = lambda t, count: _tile_blocks(t, count, num_tiles, seqlen_q, seqlen_k, causal, block_m, block_n,  # noqa
                                           band=band)
    best = None
    for count in range(sms, 3 * sms // 4 - 1, -1):
        busiest = max(sum(blocks(t, count) + 1 for t in range(p, num_tiles, count)) for p in range(count))
        if best is None or busiest < best[0]:
            best = (busiest, count)
    return best[1]


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_short_causal_takes_its_short_tile(dtype, d, monkeypatch):
    """Causal with both lengths in WS_SHORT_KEYS runs _FWD_WS_SHORT's tile through the table (the launch records
    it): 700 rows over 700 and 828 keys, GQA 4:2 (the last 128-row tile partial; at 828 keys the diagonal off the
    64-key blocks), against the oracle."""
    tiles = []
    launch = F.forward_sm90.launch
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, **kw: tiles.append(a[7]) or launch(*a, **kw))
    monkeypatch.setattr(F, "_STEPS", {})
    for sk in (700, 828):
        q, k, v = _inputs(2, 700, sk, 4, 2, d, d, dtype, seed=sk + d, device="cuda")
        assert F.ws_ok(q, k, v, d ** -0.5, PLAIN)
        o, lse = _run_poisoned(q, k, v, True)
        assert tiles.pop() == _FWD_WS_SHORT[d, True]
        _check(q, k, v, True, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_d64_long_calls_take_the_wide_tile(causal, monkeypatch):
    """d = 64 from WS_WIDE_FROM's lengths runs _FWD_WS_WIDE's 192-row tile through the table (the launch records
    it): 4099 rows non-causal (persistent; the last row tile's third warpgroup past Sq), 8195 causal (one program
    per tile), from [B, H, S, D] storage viewed as [B, S, H, D], GQA 6:2, rows checked against the oracle."""
    tiles = []
    launch = F.forward_sm90.launch
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, **kw: tiles.append(a[7]) or launch(*a, **kw))
    monkeypatch.setattr(F, "_STEPS", {})
    n = 8195 if causal else 4099
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in _inputs(1, n, n, 6, 2, 64, 64, torch.bfloat16, seed=n, device="cuda"))
    o, lse = _run_poisoned(q, k, v, causal, scale=0.07)
    assert tiles == [_FWD_WS_WIDE[causal]]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten elements"
    for rows in (slice(0, 192), slice(2000, 2200), slice(n - 200, n)):
        _check_rows(q, k, v, causal, o, lse, rows, scale=0.07)


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table", [True, False], ids=["table", "other-schedule"])
@pytest.mark.parametrize("d", [128, 256])
def test_long_and_strided_bf16(d, causal, table):
    """4099 keys (33 key blocks at d = 128, 65 at d = 256; the last one partial) from [B, H, S, D] storage viewed as
    [B, S, H, D], an explicit scale; the default table (which routes here), or the schedule the table does not pick
    for this mask. 2 · 6 · 33 = 396 row tiles: a persistent grid of 132 programs runs a reversed full lap (its snake
    order) and a partial one."""
    b, n, hq, hkv = 2, 4099, 6, 2
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in _inputs(b, n, n, hq, hkv, d, d, torch.bfloat16, seed=n, device="cuda"))
    assert F.ws_ok(q, k, v, 0.07, PLAIN)
    cfg = fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=n, seqlen_k=n, ws_ok=True)
    same = lambda c: replace(c, persistent=False, lazy_rescale=False)  # noqa: E731 - schedule and rescale: by length
    assert same(cfg) == same(_FWD_WS[causal][d])
    config = None if table else replace(cfg, persistent=not cfg.persistent)
    o, lse = _run_poisoned(q, k, v, causal, scale=0.07, config=config)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten elements"
    for rows in (slice(0, 256), slice(2000, 2256), slice(n - 256, n)):
        _check_rows(q, k, v, causal, o, lse, rows, scale=0.07)


def test_descriptors_are_kept_by_address_and_geometry(monkeypatch):
    """A descriptor over the same memory, shape, strides, dtype, box and swizzle as one built before is that one; any of
    them different gives another. A kept descriptor holds its tensor's address, not the tensor. With the launch cache
    off (``ONLINEATTN_LAUNCH_CACHE=0``) every call builds its own, around the tensor."""
    import gc
    import weakref

    from onlineattn.ops import forward_sm90

    box = (1, 64, 1, 128)
    memory = torch.randn(2 * 128 * 4 * 128 * 2, dtype=torch.bfloat16)
    x = memory[: 2 * 128 * 4 * 128].view(2, 128, 4, 128)
    kept = forward_sm90.descriptor(x, box)
    assert forward_sm90.descriptor(memory[: x.numel()].view(x.shape), box) is kept  # another tensor, same memory
    assert kept.base.data_ptr() == x.data_ptr() and tuple(kept.shape) == x.shape and tuple(kept.strides) == x.stride()
    wider = memory.as_strided(x.shape, (2 * x.stride(0), *x.stride()[1:]))  # same address and shape, other strides
    others = [memory[: x.numel()].clone().view(x.shape), x[:, :64], wider, x.half(), x.view(torch.float16)]
    built = [forward_sm90.descriptor(y, box) for y in others] + [forward_sm90.descriptor(x, (1, 128, 1, 128)),
                                                                 forward_sm90.descriptor(x, box, swizzled=False)]
    assert all(d is not kept for d in built) and len({id(d) for d in built}) == len(built)
    for y, d in zip(others, built):
        assert d.base.data_ptr() == y.data_ptr() and tuple(d.strides) == y.stride() and d.base.dtype == y.dtype
    alone = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    gone = weakref.ref(alone)
    forward_sm90.descriptor(alone, box)
    del alone
    gc.collect()
    assert gone() is None, "a kept descriptor keeps its tensor alive"
    monkeypatch.setattr(forward_sm90.launch_cache, "enabled", False)
    fresh = forward_sm90.descriptor(x, box)
    assert fresh is not kept and fresh.base is x


def test_repeats_launch_a_kept_gluon_step(monkeypatch):
    """A plain whole-batch call routed here is kept (its launch as a Relaunch): later calls with the same metadata
    relaunch it with their own tensors (descriptors around q, k, v and o), without the routing checks (``ws_ok``);
    another shape, or a Relaunch that is not ready, takes the full path."""
    checks, starts, relaunches = [], [], []
    ready = [True]

    class FakeRelaunch:
        def __call__(self, grid, arrays):
            relaunches.append((grid, arrays))
            return ready[0]

    def fake_start(keep, kernel, grid, n_arrays, *args, **kwargs):
        starts.append((keep, grid, args[:n_arrays]))
        return FakeRelaunch() if keep else None

    monkeypatch.setattr(F, "_STEPS", {})
    monkeypatch.setattr(F, "ws_ok", lambda *args: checks.append(1) or True)
    monkeypatch.setattr(F.forward_sm90, "start", fake_start)
    for n, expect_start in ((8, True), (8, False), (8, False), (9, True)):
        q, k, v = (torch.randn(1, n, 2, 128, dtype=torch.bfloat16) for _ in range(3))
        o, lse = F.forward(q, k, v, 0.1, False, config=_FWD_WS[False][128])
        keep, grid, arrays = starts[-1] if expect_start else (True, *relaunches[-1])
        assert keep and grid == (2,)  # one 128-row tile per head
        assert [(a.base.data_ptr(), tuple(a.shape), tuple(a.strides)) for a in arrays[:4]] == [
            (x.data_ptr(), tuple(x.shape), x.stride()) for x in (q, k, v, o)] and arrays[4] is lse
    assert len(starts) == 2 and len(relaunches) == 2 and len(checks) == 2  # the first call of each shape
    ready[0] = False  # e.g. a new alignment: the Relaunch refuses, the call takes the full path (and keeps anew)
    F.forward(q, k, v, 0.1, False, config=_FWD_WS[False][128])
    assert len(relaunches) == 3 and len(starts) == 3 and len(checks) == 3


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("d", [128, 64], ids=["d128", "d64-wide"])
def test_repeat_relaunches_bitwise(d, causal, persistent, monkeypatch):
    """A plain call seen before relaunches the kept Gluon launch around fresh descriptors of new tensors, and gives
    bitwise what the full path gave (d = 64: the 192-row tile, whose Q comes in three boxes)."""
    monkeypatch.setattr(F, "_STEPS", {})
    starts = []
    start = F.forward_sm90.start
    monkeypatch.setattr(F.forward_sm90, "start", lambda *a, **kw: starts.append(1) or start(*a, **kw))
    q, k, v = _inputs(2, 300, 300, 4, 2, d, d, torch.bfloat16, seed=3, device="cuda")
    cfg = replace(_FWD_WS[causal][128] if d == 128 else _FWD_WS_WIDE[causal], persistent=persistent)
    first = F.forward(q, k, v, 0.1, causal, config=cfg)
    again = F.forward(q.clone(), k.clone(), v.clone(), 0.1, causal, config=cfg)
    assert len(starts) == 1 and len(F._STEPS) == 1  # the second call was a repeat
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_out_view_is_written_within_its_rows(causal, d):
    """``out`` a row slice of a larger NaN buffer, with [B, H, S, D] strides: the TMA stores of O write every row of
    the view (odd length: the last tile is partial, its rows past the end dropped by the copy engine) and nothing
    past it; a misaligned ``out`` takes the Triton kernel and still meets the rule."""
    b, n, hq, hkv = 2, 333, 4, 2
    q, k, v = _inputs(b, n, n, hq, hkv, d, d, torch.bfloat16, seed=d + causal, device="cuda")
    big = torch.full((b, hq, n + 64, d), float("nan"), dtype=q.dtype, device="cuda")
    out = big.transpose(1, 2)[:, :n]
    lse = torch.empty(b, hq, n, device="cuda")
    cfg = replace(_FWD_WS[causal][d], persistent=True)
    o, lse = F.forward(q, k, v, d**-0.5, causal, out=out, lse_out=lse, config=cfg)
    assert o is out and torch.isnan(big.transpose(1, 2)[:, n:]).all()
    _check(q, k, v, causal, o, lse)
    odd = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")[1:1 + q.numel()].view(q.shape)
    o, lse = F.forward(q, k, v, d**-0.5, causal, out=odd, lse_out=lse)
    _check(q, k, v, causal, o, lse)


@gpu
@sm90
@pytest.mark.parametrize("d", [32, 96])
def test_other_head_dims_are_refused(d):
    """The Hopper forward is built for d = 64, 128 and 256: a gluon config at another head dim raises, never
    launches."""
    q, k, v = _inputs(1, 600, 600, 2, 2, d, d, torch.bfloat16, seed=d, device="cuda")
    assert not F.ws_ok(q, k, v, 0.1, PLAIN)
    with pytest.raises(ValueError, match="config"):
        F.forward(q, k, v, 0.1, False, config=_FWD_WS[False][128])


# ---------------------------------------------------------------------------------------------------------------
# Sliding windows: the kernel runs a window (its only variant) as a causal launch whose diagonal moves right by the
# window's right side, from the key block of each tile's first row's left edge.

WINDOWS = [  # (left, right); a causal call folds right to 0 (Mods.band)
    (0, 0),  # causal: the diagonal key alone
    (37, 0),
    (128, 0),  # a left edge on a block boundary where Sq = Sk
    (300, 77),
    (64, -1),  # left side only
    (-1, 45),  # right side only
]


def test_table_routes_a_window_as_causal():
    """A window as the only variant takes the causal call's Hopper tile where it spans ``WS_WINDOW_MIN_SPAN`` keys
    or more (d = 128 and 256: any; d = 64: 1024, its 128-row tile) and fewer than Sk, persistent below
    ``WS_WINDOW_PERSISTENT_BELOW`` and lazy as a causal call of the window's span; other windows (shorter at d = 64,
    or reaching every key on a side: ``_window_span`` gives Sk), calls with other variants, and calls ``ws_ok``
    refuses take the Triton tiles as before (``Mods.window_sinks_only``: the calls whose variants are a window and/or
    sinks alone). Sinks alone take the plain call's tile."""
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (700, 4096, 16384):
                at = lambda **kw: fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=n, seqlen_k=n,  # noqa
                                             variants=True, **kw)
                plain = fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=n, seqlen_k=n, ws_ok=True)
                for span in (128, 1024, 4096):
                    if span < WS_WINDOW_MIN_SPAN[d] or span >= n or not plain.gluon:
                        assert at(ws_ok=True, hopper=True, window=span) == at() and not at().gluon
                        continue
                    tile = plain if plain.block_m == 128 else _FWD_WS[True][d]
                    assert at(ws_ok=True, hopper=True, window=span) == replace(
                        tile, persistent=span < WS_WINDOW_PERSISTENT_BELOW,
                        lazy_rescale=span >= LAZY_RESCALE_FROM[d, True] if (d, True) in LAZY_RESCALE_FROM else False)
                assert at(ws_ok=True) == at() == at(window=1024) == at(ws_ok=True, window=1024) and not at().gluon
                assert at(ws_ok=True, hopper=True) == fwd_config(d, d, torch.bfloat16, causal, "cuda", seqlen_q=n,
                                                                 seqlen_k=n, ws_ok=True)  # sinks alone
    at = lambda d, span: fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=16384,  # noqa: E731
                                    seqlen_k=16384, variants=True, ws_ok=True, hopper=True, window=span)
    assert (at(128, 1024).persistent, at(128, 1024).lazy_rescale, at(128, 4096).lazy_rescale) == (True, False, True)
    assert not at(256, 4096).persistent and at(64, 1024).block_m == 128 and not at(64, 128).gluon
    sinks = torch.zeros(4)
    assert Mods(window_left=5).window_sinks_only and Mods(window_right=0, sinks=sinks).window_sinks_only
    assert PLAIN.window_sinks_only and Mods(sinks=sinks).window_sinks_only
    assert not Mods(window_left=5, softcap=2.0).window_sinks_only and not Mods(alibi_slopes=sinks).window_sinks_only
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert not Mods(window_left=5, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3).window_sinks_only


def test_window_span_is_what_a_row_sees_at_most():
    """``forward._window_span``: left + right + 1 keys with causal's right side 0, at most Sk (so a window with an
    unbounded side spans Sk, and the table keeps it on the Triton kernel), 0 without a window (``fwd_config``'s
    ``hopper`` keeps windows with other variants off the Hopper kernel)."""
    span = F._window_span
    assert span(Mods(window_left=100, window_right=7), True, 5000) == 101
    assert span(Mods(window_left=100, window_right=7), False, 5000) == 108
    assert span(Mods(window_left=100), False, 5000) == span(Mods(window_right=3), True, 5000) == 5000
    assert span(PLAIN, True, 5000) == span(Mods(softcap=1.0), True, 5000) == 0


def test_window_tiles_compute_every_visible_key():
    """By a walk of the kernel's tile arithmetic (``_tile_blocks``, as ``_tile_coords``, ``_key0`` and
    ``_own_blocks`` compute it) over windows and lengths: each warpgroup's blocks hold every key its rows see, at
    least one block, and at most one block fewer than its tile (``_skip``'s bound); and every block lies in the
    keys (the producer loads nothing past Sk or before 0)."""
    for block_m, block_n in ((128, 128), (128, 64), (192, 128)):
        for sq in (1, 63, 64, 129, 300, 700):
            for sk in (1, 40, 128, 300, 701):
                for window in WINDOWS + [(5, 3), (2000, 0), (0, 2000)]:
                    for causal in (False, True):
                        band = Mods(window_left=window[0], window_right=window[1]).band(causal)
                        visible = R.visible_mask(sq, sk, causal, band_window(band))
                        num_m = -(-sq // block_m)
                        for t in range(num_m):
                            m0 = (num_m - 1 - t) * block_m
                            first = max(m0 + sk - sq - band[0], 0) // block_n
                            whole = _tile_blocks(t, num_m, num_m, sq, sk, True, block_m, block_n, band=band)
                            assert 1 <= whole and first + whole <= max(-(-sk // block_n), 1)
                            for wg in range(block_m // 64):
                                own = _tile_blocks(t, num_m, num_m, sq, sk, True, block_m, block_n, 64 * wg + 64,
                                                   band)
                                assert 1 <= own <= whole <= own + 1
                                rows = visible[m0 + 64 * wg: m0 + 64 * wg + 64]
                                keys = np.flatnonzero(rows.any(axis=0))
                                assert not len(keys) or (first * block_n <= keys.min()
                                                         and keys.max() < (first + own) * block_n)


def band_window(band):
    """``Mods.band``'s (left, right) as ``window_size`` (2^30: unbounded, -1)."""
    return tuple(-1 if side >= 2**30 else side for side in band)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_window_matches_oracle(shape, persistent, window, causal, d, monkeypatch):
    """The causal table tile under a window, one program per tile or 3 persistent programs handing many tiles over:
    key blocks from each tile's first row's left edge, the left edge masked where a block crosses it, rows that see
    no key (Sq > Sk), warpgroups whose first block holds no key they see, HALF_DIAG shapes (causal)."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})  # no kept launch of another grid
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + causal + d + sum(window),
                      device="cuda")
    o, lse = _run_poisoned(q, k, v, causal, config=replace(_FWD_WS[True][d], persistent=persistent), window=window)
    _check(q, k, v, causal, o, lse, window=window)


def _causal_tile_kind(kind):
    """(d, tile) of the table's other causal tiles: the short tile (64-key blocks, four stages, two Q buffers, d =
    128), d = 64's 192-row tile (three warpgroups), lazy rescaling (d = 128), ``early_p`` the other way (d = 256)."""
    return {"short": (128, _FWD_WS_SHORT[128, True]), "wide": (64, _FWD_WS_WIDE[True]),
            "lazy": (128, replace(_FWD_WS[True][128], lazy_rescale=True)),
            "early-p-flipped": (256, replace(_FWD_WS[True][256], early_p=False))}[kind]


@gpu
@sm90
@pytest.mark.parametrize("kind", ["short", "wide", "lazy", "early-p-flipped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window,causal", [((37, 0), True), ((128, 0), True), ((300, 77), True), ((300, 77), False)],
                         ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_window_tile_kinds_match_oracle(shape, window, causal, dtype, kind, monkeypatch):
    """The table's other causal tiles under a window, over 3 persistent programs: the short tile (64-key blocks,
    four stages, two Q buffers, d = 128), d = 64's 192-row tile (three warpgroups), lazy rescaling (d = 128) and
    ``early_p`` the other way (d = 256); a non-causal window moves the diagonal right in each."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})
    d, cfg = _causal_tile_kind(kind)
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, dtype, seed=sum(shape) + d + sum(window), device="cuda")
    o, lse = _run_poisoned(q, k, v, causal, config=replace(cfg, persistent=True), window=window)
    _check(q, k, v, causal, o, lse, window=window)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(255, 40), (1100, 0)], ids=str)
def test_window_calls_take_the_hopper_kernel_at_its_head_dims(window, causal, d, monkeypatch):
    """Through the table: a window as the only variant launches the Hopper kernel with its band at d = 128 and 256,
    and at d = 64 where it spans 1024 keys or more (``WS_WINDOW_MIN_SPAN``; shorter ones take the Triton kernel);
    either meets the rule, and the backward (the Triton kernels: the Hopper dK/dV kernel has no window) too."""
    import onlineattn
    bands = []
    launch = F.forward_sm90.launch
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, band=None, **kw: bands.append(band) or launch(
        *a, band=band, **kw))
    monkeypatch.setattr(F, "_STEPS", {})
    q, k, v = _inputs(2, 1100, 1300, 4, 2, d, d, torch.bfloat16, seed=d + causal + window[0], device="cuda")
    o, lse = _run_poisoned(q, k, v, causal, window=window)
    _check(q, k, v, causal, o, lse, window=window)
    band = (window[0], 0 if causal else window[1])
    assert bands == ([band] if d != 64 or sum(band) + 1 >= WS_WINDOW_MIN_SPAN[64] else [])
    do = torch.randn_like(q)
    ours, base = ((x.detach().clone().requires_grad_() for x in (q, k, v)) for _ in range(2))
    ours, base = tuple(ours), tuple(base)
    onlineattn.attention(*ours, causal=causal, window_size=window).backward(do)
    R.torch_math_attention(*base, causal=causal, window_size=window)[0].backward(do)
    exact = R.naive_attention_grads(q, k, v, do, causal=causal, window_size=window)
    for name, x, b in zip(("dq", "dk", "dv"), ours, base):
        R.assert_within_rule(name, x.grad, exact[name], b.grad, "bfloat16")


# ---------------------------------------------------------------------------------------------------------------
# Sinks: a logit per head that starts each row's running max and sum (m = sink, l = 1), with no value.

def _sinks(hq, seed):
    """Sinks around the scores' range, the first far above every score (o near 0, lse the sink) and, with two heads
    or more, the last far below (as if absent)."""
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0
    sinks[0] = 30.0
    if hq > 1:
        sinks[-1] = -30.0
    return sinks.cuda()


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (37, 0), (300, 77)], ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sinks_match_oracle(shape, persistent, window, causal, d, monkeypatch):
    """Sinks alone or with a window, one program per tile or 3 persistent programs handing tiles of different heads
    over (each tile starts from its own head's sink): rows that see no key get o = 0 and lse = the sink."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + causal + d + sum(window),
                      device="cuda")
    sinks = _sinks(hq, sum(shape) + d)
    cfg = replace(_FWD_WS[causal or window != (-1, -1)][d], persistent=persistent)
    o, lse = _run_poisoned(q, k, v, causal, config=cfg, window=window, sinks=sinks)
    _check(q, k, v, causal, o, lse, window=window, sinks=sinks)


@gpu
@sm90
@pytest.mark.parametrize("kind", ["short", "wide", "lazy", "early-p-flipped"])
@pytest.mark.parametrize("window", [(-1, -1), (128, 0)], ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_sink_tile_kinds_match_oracle(shape, window, kind, monkeypatch):
    """The table's other causal tiles with sinks, over 3 persistent programs: with lazy rescaling a row keeps the
    sink as its max until a score passes it by 2^8 (q scaled 4x, so rows do pass it); bf16 sinks on the wide tile
    (the kernel reads them as float32 from the host's copy)."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})
    d, cfg = _causal_tile_kind(kind)
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + d + sum(window), device="cuda",
                      q_scale=4.0 if kind == "lazy" else 1.0)  # lazy: rows take new maxima past the sink by 2^8
    sinks = _sinks(hq, sum(shape)).to(torch.bfloat16 if kind == "wide" else torch.float32)
    o, lse = _run_poisoned(q, k, v, True, config=replace(cfg, persistent=True), window=window, sinks=sinks)
    _check(q, k, v, True, o, lse, window=window, sinks=sinks)


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (255, 0)], ids=str)
def test_sink_calls_take_the_hopper_kernel(window, causal, d, monkeypatch):
    """Through the table: sinks, alone or with a window, launch the Hopper kernel with them where the call without
    them would (every head dim alone, the plain call's tile; a 256-key window at d = 128 and 256), and the backward
    (the Hopper dK/dV kernel too where the window's right side is 0: sinks reach it only through lse) gives dq, dk,
    dv and dsinks within the rule, deterministic and not."""
    import onlineattn
    seen = []
    launch = F.forward_sm90.launch
    monkeypatch.setattr(F.forward_sm90, "launch", lambda *a, sinks=None, **kw: seen.append(sinks) or launch(
        *a, sinks=sinks, **kw))
    monkeypatch.setattr(F, "_STEPS", {})
    q, k, v = _inputs(2, 1100, 1300, 4, 2, d, d, torch.bfloat16, seed=d + causal + window[0], device="cuda")
    sinks = _sinks(4, d)
    o, lse = _run_poisoned(q, k, v, causal, window=window, sinks=sinks)
    _check(q, k, v, causal, o, lse, window=window, sinks=sinks)
    hopper = window == (-1, -1) or d != 64  # a 256-key window at d = 64 keeps the Triton kernel (WS_WINDOW_MIN_SPAN)
    assert len(seen) == hopper and all(torch.equal(x, sinks) for x in seen)
    do = torch.randn_like(q)
    ours, base = ((x.detach().clone().requires_grad_() for x in (q, k, v, sinks)) for _ in range(2))
    ours, base = tuple(ours), tuple(base)
    R.torch_math_attention(*base[:3], causal=causal, window_size=window, sinks=base[3])[0].backward(do)
    exact = R.naive_attention_grads(q, k, v, do, causal=causal, window_size=window, sinks=sinks)
    for deterministic in (True, False):
        for x in ours:
            x.grad = None
        onlineattn.attention(*ours[:3], causal=causal, window_size=window, sinks=ours[3],
                             deterministic=deterministic).backward(do)
        for name, x, b in zip(("dq", "dk", "dv", "dsinks"), ours, base):
            R.assert_within_rule(name, x.grad, exact[name], b.grad, "bfloat16")


@gpu
@sm90
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sink_of_minus_inf_is_no_sink(shape, causal, d, monkeypatch):
    """A sink of -inf joins as nothing: o and lse bitwise those of the plain kernel (the first block's alpha is 0
    against l = 1, as against l = 0), rows that see no key included (lse = -inf, o = 0)."""
    monkeypatch.setattr(F.forward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(F, "_STEPS", {})
    b, sq, sk, hq, hkv = shape
    q, k, v = _inputs(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sum(shape) + causal + d, device="cuda")
    cfg = replace(_FWD_WS[causal][d], persistent=True)
    plain = _run_poisoned(q, k, v, causal, config=cfg)
    sunk = _run_poisoned(q, k, v, causal, config=cfg, sinks=torch.full((hq,), float("-inf"), device="cuda"))
    assert torch.equal(sunk[0], plain[0]) and torch.equal(sunk[1], plain[1])
