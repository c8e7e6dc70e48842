"""The split tail's second launch (ops/pieces.py) and the dK/dV kernel's pieces (ops/backward_sm90.py, SPLIT):
``sum_pieces`` and ``merge_pieces`` through Triton's interpreter, where ``launch_dkdv`` splits, and that the SPLIT
kernel compiles for sm_90, on any machine; on an sm_90 GPU, that split launches meet the §3 rule. (The forward's
pieces and their launches on the GPU are tested in test_forward_sm90.py.)"""

from dataclasses import replace

import pytest
import torch

from onlineattn import reference as R
from onlineattn.ops import backward as B
from onlineattn.ops import backward_sm90, backward_sm90_schedule
from onlineattn.ops import forward as F
from onlineattn.ops._configs import _BWD_WS_DKDV, BWD_TAIL_MIN_KEYS, bwd_config, fused_dq_tile, tail_pieces
from onlineattn.ops.pieces import merge_pieces, sum_pieces
from tests.ops.test_backward import _baseline_grads
from tests.ops.test_backward_sm90 import gpu_inputs
from tests.ops.test_forward_sm90 import _compiled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="needs an sm_90 GPU")
gpu = pytest.mark.gpu


def _block_of(t, num_n, columns, head_group):
    """A plain walk of ``tile_of`` as ``_key_block`` reads it without LAST_BLOCK_FIRST (a column's key block 0
    first): key block ``t`` -> (batch · kv head column, key block)."""
    per_group = head_group * num_n
    first = t // per_group * head_group
    heads = min(columns - first, head_group)
    r = t % per_group
    return first + r % heads, r // heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("b,sk,hkv,d,head_group,first,pieces", [(1, 300, 2, 32, 1, 2, 3), (2, 260, 3, 64, 2, 5, 2),
                                                                 (3, 128, 1, 16, 3, 0, 4)])
def test_sum_pieces_adds_each_blocks_pieces_in_order(b, sk, hkv, d, head_group, first, pieces, dtype):
    """Key blocks ``first ...`` of a launch numbered as the dK/dV kernel numbers them: each block's ``pieces``
    slots added in order (float32, bitwise those sums) into its keys of dk and dv (strided views; keys past Sk
    dropped); every other key keeps its NaN."""
    g = torch.Generator().manual_seed(b + sk + d + pieces)
    num_n, columns = -(-sk // 128), b * hkv
    split = num_n * columns - first
    parts = [torch.randn(split * pieces, 128, d, generator=g).to(DEVICE) for _ in range(2)]
    outs = [torch.full((b, sk, hkv + 1, d), float("nan"), dtype=dtype, device=DEVICE)[:, :, :hkv] for _ in range(2)]
    sum_pieces(*parts, *outs, first, pieces, columns, head_group)
    want = [torch.full((b, sk, hkv, d), float("nan"), dtype=dtype) for _ in range(2)]
    for i in range(split):
        column, block = _block_of(first + i, num_n, columns, head_group)
        keys = slice(block * 128, min(block * 128 + 128, sk))
        for part, w in zip(parts, want):
            total = part[i * pieces].clone()
            for j in range(1, pieces):
                total += part[i * pieces + j]
            w[column // hkv, keys, column % hkv] = total[: keys.stop - keys.start].to(dtype).cpu()
    for got, w in zip(outs, want):
        assert torch.equal(got.cpu().nan_to_num(), w.nan_to_num()) and torch.equal(got.isnan().cpu(), w.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("b,sq,hq,d,first,pieces", [(1, 300, 2, 32, 3, 3), (2, 128, 3, 64, 1, 2)])
def test_merge_pieces_merges_each_tiles_pieces(b, sq, hq, d, first, pieces, dtype):
    """The forward's tiles ``first ...`` (128 rows of one head, numbered as ``forward_sm90_schedule._tile_coords``
    numbers them without causal masking): each tile's ``pieces`` float32 states merged into its rows of o and lse as
    the oracle's ``merge_states_list`` merges them (rows whose pieces are all empty: o = 0, lse = -inf); rows past Sq
    dropped, and every other row keeps its NaN."""
    g = torch.Generator().manual_seed(sq + d + pieces)
    num_m = -(-sq // 128)
    split = num_m * b * hq - first
    o_part = torch.randn(split * pieces, 128, d, generator=g)
    lse_part = torch.randn(split * pieces, 128, generator=g) * 4
    lse_part[torch.rand(lse_part.shape, generator=g) < 0.3] = float("-inf")
    lse_part[:, 5] = float("-inf")  # a row no piece saw
    o = torch.full((b, sq, hq + 1, d), float("nan"), dtype=dtype, device=DEVICE)[:, :, :hq]
    lse = torch.full((b, hq, sq), float("nan"), device=DEVICE)
    merge_pieces(o_part.to(DEVICE), lse_part.to(DEVICE), o, lse, first, pieces)
    want_o = torch.full((b, sq, hq, d), float("nan"), dtype=torch.float64)
    want_lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float64)
    for i in range(split):
        t = first + i
        rows = slice((t % num_m) * 128, min((t % num_m) * 128 + 128, sq))
        parts = slice(i * pieces, (i + 1) * pieces)
        m_o, m_lse = R.merge_states_list(o_part[parts, None, :, None], lse_part[parts, None, None])
        n = rows.stop - rows.start
        want_o[t // num_m // hq, rows, t // num_m % hq] = torch.from_numpy(m_o[0, :n, 0])
        want_lse[t // num_m // hq, t // num_m % hq, rows] = torch.from_numpy(m_lse[0, 0, :n])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(o.cpu().double(), want_o.to(dtype).double(), equal_nan=True, **tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_launch_dkdv_splits_the_tail_from_its_keys(monkeypatch):
    """``launch_dkdv`` asks ``tail_pieces`` (row tiles of the GQA group a block, the backward's overhead 2) only for
    persistent non-causal launches with at least BWD_TAIL_MIN_KEYS keys for the head dim (d = 128 only: where the
    A/B gained), hands the kernel the item count, the first piece item, the piece count, float32 workspaces of a
    slot a piece and SPLIT (None workspaces and 1s without), sums when it splits, and then keeps no launch for
    relaunch (a repeat would skip the sum)."""
    asked, summed, kept, launched = [], [], [], []
    monkeypatch.setattr("onlineattn.ops.pieces.tail_pieces", lambda *a: asked.append(a) or 3)
    monkeypatch.setattr(backward_sm90, "start", lambda keep, *a, **kw: kept.append(keep) or launched.append((a, kw))
                        or ("kept" if keep else None))
    monkeypatch.setattr(backward_sm90, "sum_pieces", lambda *a: summed.append(a[-4:]))
    monkeypatch.setattr(backward_sm90, "_sm_count", lambda device: 5)
    for d in (64, 128, 256):
        least = BWD_TAIL_MIN_KEYS.get(d, 1024)
        for sk, causal, persistent, fused in ((least, False, True, True), (least - 1, False, True, True),
                                              (least, True, True, True), (least, False, False, True),
                                              (least, False, True, False)):
            if d == 256 and fused:
                continue
            asked.clear(), summed.clear(), kept.clear(), launched.clear()
            tile = replace(fused_dq_tile(d, causal=causal) if fused else _BWD_WS_DKDV[d], persistent=persistent)
            q = torch.empty(1, 700, 6, d, dtype=torch.bfloat16)
            k = torch.empty(1, sk, 3, d, dtype=torch.bfloat16)  # d = 128: 48 blocks over 5 programs, 3 in the last lap
            rows = -(-700 // tile.block_m) * tile.block_m
            dq_acc = torch.zeros(1, rows, 6, d) if fused else None
            grid, relaunch = backward_sm90.launch_dkdv(q, k, k, q, torch.empty(1, 6, 700), torch.empty(1, 6, 700),
                                                       torch.empty_like(k), torch.empty_like(k), 0.1, causal, tile,
                                                       keep=True, dq_acc=dq_acc)
            split = sk >= least and d in BWD_TAIL_MIN_KEYS and not causal and persistent
            tiles = 3 * -(-sk // tile.block_n)
            case = (d, sk, causal, persistent, fused)
            assert asked == ([(tiles, grid[0], -(-700 // tile.block_m) * 2, 2)] if split else []), case
            assert summed == ([(tiles - tiles % grid[0], 3, 3, 1)] if split else []), case
            assert not split or tiles % grid[0], case
            assert kept == [not split] and (relaunch is None) == split, case
            args, kw = launched[0]
            full = tiles - tiles % grid[0] if split else 1
            items = tiles + (tiles - full) * 2 if split else tiles  # 3 pieces a split block
            parts = [None if x is None else tuple(x.shape) for x in args[-4:-2]]
            assert (args[-6], args[-2], args[-1], kw["SPLIT"]) == (items, full, 3 if split else 1, split), case
            assert parts == ([((tiles - full) * 3, 128, d)] * 2 if split else [None, None]), case


_COMPILE_SPLIT = """
import sys, torch, triton
import triton.runtime.jit as jit
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from dataclasses import replace
from onlineattn.ops import backward_sm90
from onlineattn.ops._configs import _BWD_WS_DKDV, fused_dq_tile
backward_sm90.BWD_TAIL_MIN_KEYS = {{64: 2048, 128: 2048}}
run, compiled = jit.JITFunction.run, []
warm = lambda self, *a, **kw: compiled.append((self.fn.__name__, run(self, *a, **{{**kw, "warmup": True}})))
jit.JITFunction.run = warm
for d, fused in ((128, True), (128, False), (64, False)):
    compiled.clear()
    tile = replace(fused_dq_tile(d, causal=False) if fused else _BWD_WS_DKDV[d], persistent=True)
    q = torch.randn(1, 2048, 9, d, dtype=torch.bfloat16)
    k = torch.randn(1, 2048, 9, d, dtype=torch.bfloat16)  # 144 key blocks over 132 programs
    lse = torch.randn(1, 9, 2048)
    backward_sm90.launch_dkdv(q, k, k, q, lse, lse, torch.empty_like(k), torch.empty_like(k), 0.1, False, tile,
                              dq_acc=torch.zeros(1, 2048, 9, d) if fused else None)
    print(d, fused, *[(name, c.asm["ptx"].count("wgmma.mma_async"), c.asm["ptx"].count("st.global.v2.b32") > 0)
                      for name, c in compiled])
"""


def test_split_tail_compiles_for_sm90():
    """A dK/dV launch whose last lap is cut into pieces (144 key blocks over 132 programs) compiles for sm_90 with
    the SPLIT kernel, the matmul sites of its unsplit tile (``test_kernel_compiles_for_sm90``: a piece runs a block's
    code over fewer row tiles) and stores of a piece's float32 dK and dV from registers (pairs of 32-bit values; the
    unsplit tiles store by TMA), and then the sum kernel."""
    lines = _compiled(_COMPILE_SPLIT).stdout.splitlines()
    assert lines == [f"{d} {fused} ('attention_bwd_dkdv_sm90_kernel', {wgmma}, True) ('sum_pieces_kernel', 0, False)"
                     for d, fused, wgmma in ((128, True, 80), (128, False, 48), (64, False, 32))], lines


_COMPILE_KEEP = """
import sys, torch, triton
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from dataclasses import replace
from onlineattn.ops import backward_sm90
from onlineattn.ops._configs import _BWD_WS_DKDV, fused_dq_tile
for d, fused, sk in ((128, True, 2048), (128, True, 1024), (64, False, 300), (256, False, 300)):
    tile = replace(fused_dq_tile(d, causal=False) if fused else _BWD_WS_DKDV[d], persistent=d < 256)
    q = torch.randn(1, 2048, 9, d, dtype=torch.bfloat16)
    k = torch.randn(1, sk, 9, d, dtype=torch.bfloat16)
    lse = torch.randn(1, 9, 2048)
    grid, kept = backward_sm90.launch_dkdv(q, k, k, q, lse, lse, torch.empty_like(k), torch.empty_like(k), 0.1, False,
                                           tile, keep=True, dq_acc=torch.zeros(1, 2048, 9, d) if fused else None)
    print(d, fused, sk, kept is not None)
"""


def test_launches_are_kept_unless_split():
    """Through the launch cache (an sm_90 driver that launches nothing): an unsplit dK/dV launch asked to keep
    itself returns its Relaunch (its arrays lead its arguments: the pieces' are None constexprs there, which 523430b's
    placeholder tensors broke), a split one (144 key blocks over 132 programs at 2048 keys) returns None."""
    lines = _compiled(_COMPILE_KEEP).stdout.splitlines()
    assert lines == ["128 True 2048 False", "128 True 1024 True", "64 False 300 True", "256 False 300 True"], lines


SPLIT_SHAPES = [  # b, sq, sk, hq, hkv, SMs: each launch's last lap split (the test asserts it)
    (1, 700, 1000, 4, 2, 5),  # GQA 2: a piece may start within a head's row tiles
    (2, 1000, 900, 4, 4, 9),  # Sk not a whole number of key blocks
    (1, 2000, 1200, 3, 1, 4),  # MQA 3:1
    (2, 333, 1500, 8, 2, 11),  # the last row tile of 333 rows partial
    (1, 1024, 512, 4, 2, 3),  # 6 pieces over 3 programs: a piece after a piece, the second lap of pieces reversed
    (2, 900, 500, 3, 1, 3),  # the same with MQA 3:1 and a partial last key block
]


@gpu
@sm90
@pytest.mark.parametrize("tile", ["128-fused-dq", "128", "64", "64-fused-dq", "128-fused-dq-float32-out"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_tail_matches_oracle(shape, tile, monkeypatch):
    """Non-causal persistent dK/dV launches whose last lap is cut into pieces of row tiles (the SMs set so that it
    is; the key minimum lowered so that these lengths split): dK and dV, each piece's float32 partial sums added after
    the kernel (``sum_pieces``), and dQ meet the §3 rule; dK and dV are those of the unsplit launch up to float32's
    summation order, and a second split launch gives their bits again (dQ too where the dQ kernel computes it)."""
    b, sq, sk, hq, hkv, sms = shape
    d, fused, wide = int(tile[:tile.find("-")] if "-" in tile else tile), "fused" in tile, "float32" in tile
    monkeypatch.setattr(backward_sm90, "_sm_count", lambda device: sms)
    monkeypatch.setattr(B.launch_cache, "enabled", False)
    summed, add = [], backward_sm90.sum_pieces
    monkeypatch.setattr(backward_sm90, "sum_pieces", lambda *a: summed.append(a[-3]) or add(*a))
    dtype = torch.bfloat16
    q, k, v, do = gpu_inputs(shape, d, dtype, seed=sum(shape) + d + fused)
    o, lse = F.forward(q, k, v, d**-0.5, False)
    base = fused_dq_tile(d, causal=False) if fused else _BWD_WS_DKDV[d]
    cfg = replace(bwd_config(d, d, dtype, "cuda", causal=False), dkdv=replace(base, persistent=True))
    outs = lambda: (torch.empty_like(q), *(torch.empty_like(x, dtype=torch.float32 if wide else dtype)  # noqa: E731
                                           for x in (k, v)))
    run = lambda: B.backward(do, q, k, v, o, lse, d**-0.5, False, config=cfg, deterministic=not fused,  # noqa: E731
                             out=outs())
    whole = run()  # BWD_TAIL_MIN_KEYS has no d = 64 and needs more keys at 128: no split
    monkeypatch.setattr(backward_sm90, "BWD_TAIL_MIN_KEYS", {64: 0, 128: 0})
    got, again = run(), run()
    tiles = -(-sk // 128) * b * hkv
    programs = backward_sm90_schedule.programs(sq, sk, b * hkv, hq // hkv, False, base.block_m, 128, 1, sms)
    pieces = tail_pieces(tiles, programs, -(-sq // base.block_m) * (hq // hkv), overhead=2)
    assert summed == [pieces] * 2 and pieces > 1, (summed, pieces)
    for x, y in zip(got[1:], whole[1:]):
        torch.testing.assert_close(x.float(), y.float(), rtol=2**-7, atol=1e-5)
    assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])
    if not fused:
        assert torch.equal(got[0], again[0])
    exact = R.naive_attention_backward(q, k, v, do, causal=False)
    ref = _baseline_grads(q, k, v, do, False)
    for name, x, want, r in zip(("dq", "dk", "dv"), got, exact, ref):
        R.assert_within_rule(name, x.to(dtype), want, r, "bfloat16")
