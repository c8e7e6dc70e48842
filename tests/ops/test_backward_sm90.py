"""The warp-specialized Hopper dK/dV kernel (ops/backward_sm90.py, with backward_sm90_schedule.py and
backward_sm90_dq.py): where the table routes it, that it compiles for sm_90 on any machine, and on an sm_90 GPU
that dK and dV meet the §3 rule, and dQ where the kernel adds it (fused, in any order or in a fixed one); elsewhere
dQ comes from the Triton kernel."""

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from onlineattn import reference as R
from onlineattn._mods import PLAIN, Mods
from onlineattn.ops import backward as B
from onlineattn.ops import forward as F
from onlineattn.ops._configs import (
    _BWD_WS_DKDV, _BWD_WS_DQ, BWD_FUSED_DQ_MIN_KEYS, BWD_FUSED_DQ_ROWS, BWD_ORDERED_DQ_MIN_KEYS, BWD_ORDERED_LAST_BLOCK_FIRST,
    BWD_EARLY_DV, BWD_PERSISTENT, BWD_WS_MIN_KEYS, bwd_config, fused_dq_tile,
)
from tests.ops.test_backward import _baseline_grads, _nan_scratch
from tests.ops.test_forward_sm90 import _compiled

sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="needs an sm_90 GPU")
gpu = pytest.mark.gpu


def test_table_routes_plain_half_d64_d128_d256():
    """d = 64, 128 and 256 in half precision from BWD_WS_MIN_KEYS rows and keys (per mask), beside the table's dQ tile
    (at d = 256 its own, _BWD_WS_DQ); never without ws_ok, below those lengths, with an unknown length, for other
    head dims or float32."""
    pick = lambda d=128, dv=None, dtype=torch.bfloat16, causal=False, n=16384, m=None, **kw: bwd_config(  # noqa: E731
        d, dv or d, dtype, "cuda", causal=causal, seqlen_q=n if m is None else m, seqlen_k=n, **{"ws_ok": True, **kw})
    for d in (64, 128, 256):
        for causal in (False, True):
            least = BWD_WS_MIN_KEYS[d][causal]
            cfg = pick(d, causal=causal, n=least)
            table_dq = bwd_config(d, d, torch.bfloat16, "cuda", causal=causal).dq
            plain = replace(_BWD_WS_DKDV[d], persistent=BWD_PERSISTENT.get(d, (False, False))[0])
            assert cfg.dkdv == plain and cfg.dq == _BWD_WS_DQ.get(d, table_dq)
            for other in (pick(d, causal=causal, n=least - 1), pick(d, causal=causal, n=least, m=least - 1),
                          pick(d, causal=causal, n=None), pick(d, causal=causal, n=least, ws_ok=False)):
                assert not other.dkdv.gluon and other.dq == table_dq  # the other routes keep the table's dQ tile
    assert not pick(ws_ok=False).dkdv.gluon
    for d, dv in ((256, 128), (128, 64), (96, 96)):
        assert not pick(d, dv).dkdv.gluon
    assert not pick(dtype=torch.float32).dkdv.gluon
    assert pick(256, dv=128).dq == bwd_config(256, 128, torch.bfloat16, "cuda").dq != _BWD_WS_DQ[256]


def test_table_fuses_dq_only_where_allowed(monkeypatch):
    """dQ fused into the Gluon kernel from BWD_FUSED_DQ_MIN_KEYS rows and keys (per head dim and mask; below
    BWD_WS_MIN_KEYS too), only when the call allows any summation order (``deterministic=False``); never below those
    lengths, without ws_ok, or with deterministic=True (the default)."""
    pick = lambda d=128, causal=False, n=16384, m=None, **kw: bwd_config(  # noqa: E731
        d, d, torch.bfloat16, "cuda", causal=causal, seqlen_q=n if m is None else m, seqlen_k=n, **{"ws_ok": True, **kw})
    assert set(BWD_FUSED_DQ_MIN_KEYS) == {64, 128}
    for d, lengths in BWD_FUSED_DQ_MIN_KEYS.items():
        for causal in (False, True):
            least = lengths[causal]
            fused = pick(d, causal=causal, n=least, deterministic=False)
            assert fused.dkdv == replace(fused_dq_tile(d, causal=causal), persistent=BWD_PERSISTENT[d][1])
            assert fused_dq_tile(d, causal=causal) == replace(
                _BWD_WS_DKDV[d], block_m=BWD_FUSED_DQ_ROWS[d], fused_dq=True, early_dv=BWD_EARLY_DV[d][causal])
            assert fused.dq == bwd_config(d, d, torch.bfloat16, "cuda", causal=causal).dq  # unused: no dQ kernel
            for kept in (pick(d, causal=causal, n=least), pick(d, causal=causal, n=least, deterministic=True),
                         pick(d, causal=causal, n=least - 1, deterministic=False),
                         pick(d, causal=causal, n=least, m=least - 1, deterministic=False)):
                assert not kept.dkdv.fused_dq
    monkeypatch.setitem(BWD_WS_MIN_KEYS, 128, (4096, 4096))  # fused where the Triton tile would run otherwise
    assert pick(n=1024, deterministic=False).dkdv == replace(fused_dq_tile(128, causal=False),
                                                             persistent=BWD_PERSISTENT[128][1])
    assert not pick(n=1024).dkdv.gluon
    assert not pick(ws_ok=False, deterministic=False).dkdv.gluon


def test_table_orders_the_fused_dq_for_deterministic_calls(monkeypatch):
    """Deterministic calls take the fused kernel with its adds ordered (``dq_ordered``) from
    BWD_ORDERED_DQ_MIN_KEYS rows and keys, where the device runs all of a (batch, kv head)'s key blocks at once
    (``ordered_blocks``); not below those lengths, with more key blocks, or when the device is unknown (0)."""
    pick = lambda d=128, causal=False, n=16384, m=None, **kw: bwd_config(  # noqa: E731
        d, d, torch.bfloat16, "cuda", causal=causal, seqlen_q=n if m is None else m, seqlen_k=n,
        **{"ws_ok": True, "ordered_blocks": 132, **kw})
    assert set(BWD_ORDERED_DQ_MIN_KEYS) == set(BWD_ORDERED_LAST_BLOCK_FIRST) == set(BWD_FUSED_DQ_ROWS) == set(
        BWD_EARLY_DV) == {64, 128}
    for d, lengths in BWD_ORDERED_DQ_MIN_KEYS.items():
        for causal in (False, True):
            least = lengths[causal]
            assert pick(d, causal=causal, n=least).dkdv == fused_dq_tile(d, ordered=True, causal=causal) == replace(
                _BWD_WS_DKDV[d], block_m=BWD_FUSED_DQ_ROWS[d], fused_dq=True, dq_ordered=True,
                last_block_first=BWD_ORDERED_LAST_BLOCK_FIRST[d], early_dv=BWD_EARLY_DV[d][causal])
            assert pick(d, causal=causal, n=least, deterministic=False).dkdv == replace(
                fused_dq_tile(d, causal=causal), persistent=BWD_PERSISTENT[d][1])
            assert not pick(d, causal=causal, n=least).dkdv.persistent  # ordered: never
            for kept in (pick(d, causal=causal, n=least - 1), pick(d, causal=causal, n=least, m=least - 1),
                         pick(d, causal=causal, n=least, ordered_blocks=0),
                         pick(d, causal=causal, n=max(least, 128 * 133), ordered_blocks=132)):
                assert not kept.dkdv.fused_dq
    monkeypatch.setitem(BWD_ORDERED_DQ_MIN_KEYS, 64, (None, None))  # None: deterministic calls keep the dQ kernel
    assert not pick(64, n=16384).dkdv.fused_dq and not pick(64, causal=True, n=16384).dkdv.fused_dq


def test_fused_dq_tile_needs_deterministic_false():
    """An explicit fused_dq tile without dq_ordered is refused (ValueError naming config) when the call must be
    deterministic: by default, or under torch.use_deterministic_algorithms(True) even with deterministic=False."""
    q, k, v, do = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    o, lse = F.forward(q, k, v, 0.1, False)
    cfg = replace(bwd_config(128, 128, torch.bfloat16, "cuda"), dkdv=replace(_BWD_WS_DKDV[128], fused_dq=True))
    with pytest.raises(ValueError, match="config: a fused_dq tile"):
        B.backward(do, q, k, v, o, lse, 0.1, False, config=cfg)
    triton_tile = replace(cfg, dkdv=replace(bwd_config(128, 128, torch.bfloat16, "cuda").dkdv, fused_dq=True))
    with pytest.raises(ValueError, match="config: fused_dq needs a gluon"):  # no kernel there would add dQ
        B.backward(do, q, k, v, o, lse, 0.1, False, config=triton_tile, deterministic=False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="config: a fused_dq tile"):
            B.backward(do, q, k, v, o, lse, 0.1, False, config=cfg, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)


def test_gluon_tile_is_refused_where_it_cannot_run():
    from onlineattn.ops import backward_sm90

    q, k, v, do = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    o, lse = F.forward(q, k, v, 0.1, False)
    cfg = replace(bwd_config(128, 128, torch.bfloat16, "cuda"), dkdv=_BWD_WS_DKDV[128])
    with pytest.raises(ValueError, match="config"):
        B.backward(do, q, k, v, o, lse, 0.1, False, config=cfg)
    with pytest.raises(ValueError, match="config"):
        backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, False, replace(_BWD_WS_DKDV[128], block_m=128))
    q256, k256 = (torch.randn(1, 8, 2, 256, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="config: the Hopper dK/dV kernel runs 64 keys"):  # d = 256 takes 64 keys
        backward_sm90.launch_dkdv(q256, k256, k256, q256, lse, lse, k256, k256, 0.1, False, _BWD_WS_DKDV[128])
    with pytest.raises(ValueError, match="config: fused_dq runs at d = 64 and 128"):
        backward_sm90.launch_dkdv(q256, k256, k256, q256, lse, lse, k256, k256, 0.1, False,
                                  replace(_BWD_WS_DKDV[256], fused_dq=True), dq_acc=torch.zeros(1, 64, 2, 256))
    triton_tile = bwd_config(128, 128, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="config: early_dv orders the Hopper"):  # a Triton tile has no such order
        B.backward(do, q, k, v, o, lse, 0.1, False, config=replace(triton_tile, dkdv=replace(triton_tile.dkdv,
                                                                                            early_dv=True)))
    with pytest.raises(ValueError, match="config: early_dv orders the d = 64 and 128"):
        backward_sm90.launch_dkdv(q256, k256, k256, q256, lse, lse, k256, k256, 0.1, False,
                                  replace(_BWD_WS_DKDV[256], early_dv=True))
    delta = torch.randn(1, 8, 2).transpose(1, 2)  # lse's shape, other strides: the kernel reads both with lse's
    with pytest.raises(ValueError, match="delta"):
        backward_sm90.launch_dkdv(q, k, v, do, lse, delta, k, v, 0.1, False, _BWD_WS_DKDV[128])
    strided = torch.randn(1, 8, 2, 256, dtype=k.dtype)[..., ::2]  # dk's shape with a last-dim stride of 2
    with pytest.raises(ValueError, match="dk: the kernel writes rows"):
        backward_sm90.launch_dkdv(q, k, v, do, lse, lse, strided, v.clone(), 0.1, False, _BWD_WS_DKDV[128])


def test_dk_dv_leave_by_tma_where_they_can():
    """dK and dV leave by TMA stores (staged in the warpgroups' K and V rows) from 64-row tiles at d = 64 and 128
    into aligned outputs of q's dtype, whatever the stages; otherwise (another dtype, as ring attention's float32
    sums; off 16-byte alignment; 128-row tiles, as d = 64's fused dQ; d = 256, whose warpgroups share their keys)
    from registers."""
    from onlineattn.ops.backward_sm90 import stores_by_tma

    q, k = (torch.randn(1, 8, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    odd = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)
    tile = _BWD_WS_DKDV[128]
    assert stores_by_tma(q, k, k.clone(), tile) and stores_by_tma(q, k, k, replace(tile, num_stages=1))
    assert not stores_by_tma(q, k.float(), k.float(), tile) and not stores_by_tma(q, k, k.half(), tile)
    assert not stores_by_tma(q, k, odd, tile)
    q256 = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16)
    assert not stores_by_tma(q256, q256, q256, _BWD_WS_DKDV[256])
    q64 = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    assert stores_by_tma(q64, q64, q64.clone(), _BWD_WS_DKDV[64])
    assert fused_dq_tile(64, causal=False).block_m == 128 and not stores_by_tma(q64, q64, q64.clone(),
                                                                          fused_dq_tile(64, causal=False))


def test_persistent_tiles_are_refused_where_they_cannot_run(monkeypatch):
    """A persistent launch takes at most min(key blocks · batch · kv heads, SMs) programs (with 4 SMs, 3: the
    causal blocks' laps balance better); persistent is refused (a ValueError naming the config) on a Triton dK/dV
    tile, on the dQ tile, and on an ordered tile (its programs wait on other key blocks' programs)."""
    from onlineattn.ops import backward_sm90

    grids = []
    monkeypatch.setattr(backward_sm90, "start", lambda keep, kernel, grid, *a, **kw: grids.append(grid) or (grid, None))
    q, k, v, do = (torch.randn(1, 300, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(1, 2, 300)
    for sms in (132, 4):
        monkeypatch.setattr(backward_sm90, "_sm_count", lambda device: sms)
        backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, True, replace(_BWD_WS_DKDV[128], persistent=True))
    backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, True, _BWD_WS_DKDV[128])
    assert grids == [(6,), (3,), (6,)]  # 3 key blocks x 2 kv heads
    triton_tile = bwd_config(128, 128, torch.bfloat16, "cuda")
    for cfg in (replace(triton_tile, dkdv=replace(triton_tile.dkdv, persistent=True)),
                replace(triton_tile, dkdv=_BWD_WS_DKDV[128], dq=replace(triton_tile.dq, persistent=True))):
        with pytest.raises(ValueError, match="config: persistent runs the Hopper dK/dV kernel's programs"):
            B.backward(do, q, k, v, torch.randn_like(q), lse, 0.1, True, config=cfg)
    with pytest.raises(ValueError, match="config: dq_ordered tiles wait on other key blocks' programs"):
        backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, False,
                                  replace(fused_dq_tile(128, ordered=True, causal=False), persistent=True),
                                  dq_acc=torch.zeros(1, 320, 2, 128), dq_sem=torch.zeros(1, 2, 5, dtype=torch.int32))


def test_persistent_programs_balance_the_causal_laps():
    """The persistent dK/dV launch's program count is that of the busiest program's least work, found by a plain
    walk of the kernel's order (``_key_block``: columns in head groups, each group's key blocks from block 0 across
    its heads; laps of programs, odd full laps reversed), a key block costing its row tiles (of the GQA group) + 2;
    the SMs for equal non-causal blocks and where the blocks fit."""
    from onlineattn.ops.backward_sm90_schedule import programs

    assert programs(1024, 1024, 256, 1, False, 64, 128, 1, 132) == 132
    assert programs(300, 300, 2, 1, True, 64, 128, 1, 132) == 6
    assert programs(2048, 2048, 128, 1, True, 64, 128, 8, 132) == 128  # 16 blocks of 1-32 row tiles, groups of 8
    with warnings.catch_warnings():  # one SM: one program, and no count of 0 tried (numpy warns dividing by it)
        warnings.simplefilter("error")
        assert programs(2048, 2048, 4, 1, True, 64, 128, 1, 1) == 1
    for case in ((1000, 1000, 37, 3, True, 64, 128, 5, 132), (513, 700, 64, 1, True, 128, 128, 8, 100),
                 (2048, 1024, 40, 2, True, 64, 64, 8, 60), (700, 900, 300, 1, False, 64, 128, 1, 132)):
        assert programs(*case) == _busiest_least(*case), case
    for case in ((1000, 1000, 37, 3, True, 64, 128, 5, 132, 200), (4096, 4096, 16, 1, True, 64, 128, 8, 132, 1023),
                 (513, 700, 64, 1, True, 128, 128, 8, 100, 0)):  # causal windows: the blocks' rows end early
        assert programs(*case) == _busiest_least(*case), case


def _busiest_least(seqlen_q, seqlen_k, columns, group, causal, block_m, block_n, head_group, sms, window_left=None):
    num_n = -(-seqlen_k // block_n)
    num_tiles = num_n * columns

    def cost(t, count):  # tile t of a launch of count programs: its key block's row tiles + 2
        lap = t // count
        if lap % 2 == 1 and (lap + 1) * count <= num_tiles:
            t = lap * count + count - 1 - t % count
        first = t // (head_group * num_n) * head_group
        pid_n = t % (head_group * num_n) // min(columns - first, head_group)
        lo = max(pid_n * block_n - (seqlen_k - seqlen_q), 0) // block_m * block_m if causal else 0
        end = seqlen_q if window_left is None else min(seqlen_q, _rows_end(pid_n, seqlen_q, seqlen_k, block_n,
                                                                           window_left))
        return max(-(-(end - lo) // block_m), 0) * group + 2

    best = None
    for count in range(sms, 3 * sms // 4 - 1, -1):
        busiest = max(sum(cost(t, count) for t in range(p, num_tiles, count)) for p in range(min(count, num_tiles)))
        if best is None or busiest < best[0]:
            best = (busiest, count)
    return min(best[1], num_tiles) if num_tiles > sms else num_tiles


def test_ordered_tile_is_refused_where_it_cannot_run(monkeypatch):
    """dq_ordered needs fused_dq and the int32 counters (and only it takes them, of the right shape), and no more
    key blocks per (batch, kv head) than the device runs at once; last_block_first needs dq_ordered (ValueError
    naming the argument)."""
    from onlineattn.ops import backward_sm90

    q, k, v, do = (torch.randn(1, 300, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(1, 2, 300)
    ordered = replace(_BWD_WS_DKDV[128], fused_dq=True, dq_ordered=True)
    acc, sem = torch.zeros(1, 320, 2, 128), torch.zeros(1, 2, 5, dtype=torch.int32)
    launch = lambda tile, **kw: backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, False, tile,  # noqa: E731
                                                          **kw)
    with pytest.raises(ValueError, match="config: dq_ordered orders a fused_dq"):
        launch(replace(_BWD_WS_DKDV[128], dq_ordered=True), dq_sem=sem)
    with pytest.raises(ValueError, match="config: last_block_first orders a dq_ordered"):
        launch(replace(_BWD_WS_DKDV[128], fused_dq=True, last_block_first=True), dq_acc=acc)
    with pytest.raises(ValueError, match="dq_sem"):
        launch(ordered, dq_acc=acc)
    with pytest.raises(ValueError, match="dq_sem"):
        launch(replace(ordered, dq_ordered=False), dq_acc=acc, dq_sem=sem)
    with pytest.raises(ValueError, match="dq_sem"):
        launch(ordered, dq_acc=acc, dq_sem=torch.zeros(1, 2, 4, dtype=torch.int32))
    monkeypatch.setattr(backward_sm90, "ordered_blocks", lambda device: 2)  # 300 keys: 3 blocks of 128
    with pytest.raises(ValueError, match="config: dq_ordered needs all 3 key blocks"):
        launch(ordered, dq_acc=acc, dq_sem=sem)
    loose = replace(bwd_config(128, 128, torch.bfloat16, "cuda"),
                    dkdv=replace(bwd_config(128, 128, torch.bfloat16, "cuda").dkdv, dq_ordered=True))
    with pytest.raises(ValueError, match="config: dq_ordered orders a fused_dq"):  # a Triton tile: refused too
        B.backward(do, q, k, v, torch.randn_like(q), lse, 0.1, False, config=loose)
    unordered = replace(loose, dkdv=replace(loose.dkdv, dq_ordered=False, last_block_first=True))
    with pytest.raises(ValueError, match="config: last_block_first orders a dq_ordered"):
        B.backward(do, q, k, v, torch.randn_like(q), lse, 0.1, False, config=unordered)
    cfg = replace(bwd_config(128, 128, torch.bfloat16, "cuda"), dkdv=ordered)  # deterministic calls may take it; on
    with pytest.raises(ValueError, match="config: a gluon dK/dV tile runs only"):  # the CPU no gluon tile runs
        B.backward(do, q, k, v, torch.randn_like(q), lse, 0.1, False, config=cfg)


def test_last_block_first_reaches_the_kernel_under_causal_only(monkeypatch):
    """launch_dkdv hands the launch order to the kernel (LAST_BLOCK_FIRST) for causal launches only: non-causal
    programs start their row tiles spread apart, and the flag means nothing there."""
    from onlineattn.ops import backward_sm90

    seen = []
    monkeypatch.setattr(backward_sm90, "start", lambda *a, **kw: seen.append(kw["LAST_BLOCK_FIRST"]) or (a[2], None))
    q, k, v, do = (torch.randn(1, 300, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(1, 2, 300)
    for causal in (False, True):
        for first in (False, True):
            tile = replace(fused_dq_tile(128, ordered=True, causal=True), last_block_first=first)
            backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, causal, tile,
                                      dq_acc=torch.zeros(1, 320, 2, 128), dq_sem=torch.zeros(1, 2, 5, dtype=torch.int32))
    assert seen == [False, False, False, True]


def test_ordered_launches_go_head_after_head(monkeypatch):
    """launch_dkdv hands its head group (``bwd_head_group``) to the kernel, except for ordered tiles: their adds wait
    on each other, so a (batch, kv head)'s programs must launch together (group 1)."""
    from onlineattn.ops import backward_sm90

    seen = []
    monkeypatch.setattr(backward_sm90, "start", lambda *a, **kw: seen.append(a[-7]) or (a[2], None))  # head_group
    q, k, v, do = (torch.randn(1, 300, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(1, 2, 300)
    acc = dict(dq_acc=torch.zeros(1, 320, 2, 128))
    for tile, extra in ((fused_dq_tile(128, ordered=True, causal=True), dict(acc, dq_sem=torch.zeros(
            1, 2, 5, dtype=torch.int32))), (fused_dq_tile(128, causal=True), acc), (_BWD_WS_DKDV[128], {})):
        backward_sm90.launch_dkdv(q, k, v, do, lse, lse, k, v, 0.1, True, tile, head_group=5, **extra)
    assert seen == [1, 5, 5]


def test_dq_descriptor_boxes_are_a_warpgroups_part():
    """The fused dQ's TMA box is one warpgroup's part of a row tile in register order, unswizzled ([64 · C / 128, 1
    head, 128] for a part of 64 rows by C columns: half the rows of a 128-row tile over all d columns, d = 64's table
    tile, else all rows over half the columns), both parts where the ordered writer warp copies them; without a fused dQ
    a placeholder of 8 rows that only sizes the kernel's unused staging."""
    from onlineattn.ops import backward_sm90_dq

    acc = lambda d: torch.zeros(1, 256, 2, d)  # noqa: E731
    desc = lambda tile, d: backward_sm90_dq.dq_descriptor(acc(d), tile, d, "cpu")  # noqa: E731
    assert desc(fused_dq_tile(64, causal=False), 64).block_shape == [32, 1, 128]
    assert desc(fused_dq_tile(64, ordered=True, causal=True), 64).block_shape == [64, 1, 128]  # both parts
    assert desc(replace(fused_dq_tile(64, causal=False), block_m=64), 64).block_shape == [16, 1, 128]
    assert desc(fused_dq_tile(128, causal=False), 128).block_shape == [32, 1, 128]
    assert desc(fused_dq_tile(128, causal=False), 128).layout.swizzle_byte_width == 0
    for d in (64, 128):
        assert backward_sm90_dq.dq_descriptor(None, _BWD_WS_DKDV[d], d, "cpu").block_shape == [8, d // 2]


_COMPILE = """
import sys, torch, triton
sys.path.insert(0, {bench!r})
from probe_launch import Sm90NoLaunch
triton.runtime.driver.set_active(Sm90NoLaunch())
from dataclasses import replace
from onlineattn.ops import backward_sm90
from onlineattn.ops._configs import _BWD_WS_DKDV, fused_dq_tile
for case in ((128, False, False, False, False, 0), (64, True, False, False, False, 0),
             (128, True, True, False, False, 0), (64, False, True, False, False, 0),
             (256, True, False, False, False, 0), (256, False, False, False, False, 0),
             (128, False, True, True, False, 0), (64, True, True, True, False, 0),
             (128, True, True, True, True, 0), (64, True, False, False, False, 128),
             (128, True, True, True, False, -1), (128, False, True, False, False, 0),
             (128, True, True, False, False, 1), (64, False, False, False, True, 1),
             (256, True, False, False, False, 1), (64, False, True, False, False, 64),
             (128, True, True, True, False, 0, 37), (64, True, True, False, False, 0, 300),
             (256, True, False, False, False, 0, 128), (64, True, False, False, False, 1, 300)):  # windows
    d, causal, fused, ordered, wide, rows, *left = case
    tile = fused_dq_tile(d, ordered, causal=causal) if fused else _BWD_WS_DKDV[d]
    if rows == 1:  # persistent
        tile, rows = replace(tile, persistent=True), 0
    if rows > 0:  # another row tile than the table's
        tile = replace(tile, block_m=rows)
    if rows < 0:  # the other causal launch order
        tile = replace(tile, last_block_first=not tile.last_block_first)
    padded = -(-300 // tile.block_m) * tile.block_m
    q = torch.randn(2, 300, 8, d, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 2, d, dtype=torch.bfloat16)
    lse = torch.randn(2, 8, 300)
    compiled = []
    run = backward_sm90.attention_bwd_dkdv_sm90_kernel.run
    backward_sm90.attention_bwd_dkdv_sm90_kernel.run = lambda *a, **kw: compiled.append(
        run(*a, **{{**kw, "warmup": True}}))
    dk, dv = (torch.empty_like(k, dtype=torch.float32 if wide else k.dtype) for _ in range(2))
    backward_sm90.launch_dkdv(q, k, k, q, lse, lse, dk, dv, 0.1, causal, tile,
                              dq_acc=torch.zeros(2, padded, 8, d) if fused else None,
                              dq_sem=torch.zeros(2, 8, padded // tile.block_m, dtype=torch.int32) if ordered else None,
                              window_left=left[0] if left else None)
    backward_sm90.attention_bwd_dkdv_sm90_kernel.run = run
    ptx = compiled[0].asm["ptx"]
    print(d, ptx.count("wgmma.mma_async"), int("cp.reduce.async.bulk.tensor" in ptx),
          int("ld.acquire.gpu" in ptx and "red.release.gpu" in ptx),
          int("cp.async.bulk.tensor.4d.global.shared" in ptx), int("cp.async.bulk.tensor.3d.global.shared" in ptx),
          int("wgmma.wait_group.sync.aligned 1;" in ptx))
# one query row of one head: lse's batch stride is 1, an int Triton makes a constexpr (partition arguments must not be)
q, k, lse = torch.randn(2, 1, 1, 64, dtype=torch.bfloat16), torch.randn(2, 3, 1, 64, dtype=torch.bfloat16), torch.randn(2, 1, 1)
assert lse.stride(0) == 1
backward_sm90.launch_dkdv(q, k, k, q, lse, lse, torch.empty_like(k), torch.empty_like(k), 0.1, True, _BWD_WS_DKDV[64])
print("tiny")
"""


def test_kernel_compiles_for_sm90():
    """Gluon -> PTX -> cubin for sm_90: per warpgroup and row tile Sᵀ and dPᵀ (d / 16 wgmma each) and dV and dK (the
    tile's rows / 16 each: 128 for the fused dQ at d = 64 and in a plain 128-row case, 64 otherwise), nothing
    duplicated; fused_dq adds the warpgroup's part of dQ (128 keys / 16 wgmma, its 64 rows of a 128-row tile or half the
    columns of a 64-row one, in the loop and once after it for the last tile) and its float32 TMA reduce-adds;
    dq_ordered the writer warp's acquiring counter loads and releasing adds, and the 3-D TMA store of a row tile's first
    turn (rows of one head) (and the same matmuls, in either causal launch order); dK and dV by TMA stores from 64-row
    tiles at d = 64 and 128 into outputs of q's dtype, from registers at d = 256, from 128-row tiles and into float32
    outputs; the fused tiles of d = 128 non-causal (``early_dv``, BWD_EARLY_DV) wait for Sᵀ with dPᵀ still in flight, no
    other tile does; persistent tiles (cases 14-16) the same matmuls and stores; causal windows (the last four: the
    ordered fused dQ at d = 128, the unordered one at d = 64, d = 256's split tile, d = 64's persistent plain tile)
    those of their causal tiles."""
    out = _compiled(_COMPILE)
    rows = ["128 48 0 0 1 0 0", "64 32 0 0 1 0 0", "128 80 1 0 1 0 0", "64 80 1 0 0 0 0", "256 80 0 0 0 0 0",
            "256 80 0 0 0 0 0", "128 80 1 1 1 1 1", "64 80 1 1 0 1 0", "128 80 1 1 0 1 0", "64 48 0 0 0 0 0",
            "128 80 1 1 1 1 0", "128 80 1 0 1 0 1", "128 80 1 0 1 0 0", "64 32 0 0 0 0 0", "256 80 0 0 0 0 0",
            "64 64 1 0 1 0 0", "128 80 1 1 1 1 0", "64 80 1 0 0 0 0", "256 80 0 0 0 0 0", "64 32 0 0 1 0 0",
            "tiny"]
    assert out.stdout.split() == " ".join(rows).split(), out.stdout


SHAPES = [  # b, sq, sk, hq, hkv
    (2, 1, 1, 2, 2),
    (1, 65, 100, 8, 1),  # MQA 8:1: the group's sum in registers
    (2, 129, 17, 4, 4),  # Sq > Sk: under causal the first rows see no key (lse = -inf)
    (1, 300, 40, 4, 2),
    (1, 1000, 1000, 4, 4),  # 16 row tiles: the stages wrap around
    (2, 513, 700, 6, 2),  # Sk > Sq, group of 3
    (2, 1, 3, 1, 1),  # one query row of one head: lse's batch stride is 1 (an int Triton makes a constexpr)
]


def gpu_inputs(shape, d: int, dtype, seed: int) -> tuple:
    """q, k, v and do of ``shape`` (b, sq, sk, hq, hkv, ...) on the GPU: standard normal, drawn on the CPU."""
    b, sq, sk, hq, hkv = shape[:5]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=g).to("cuda", dtype)
                 for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))


@gpu
@sm90
@pytest.mark.parametrize("d,fused,ordered,rows", [(64, False, False, 0), (64, True, False, 0), (64, True, True, 0),
                                                  (64, True, False, 64), (64, True, True, 64), (128, False, False, 0),
                                                  (128, True, False, 0), (128, True, True, 0), (256, False, False, 0)],
                         ids=["64", "64-fused-dq", "64-ordered-dq", "64-fused-dq-64-rows", "64-ordered-dq-64-rows",
                              "128", "128-fused-dq", "128-ordered-dq", "256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(shape, causal, dtype, d, fused, ordered, rows):
    """dK, dV (and dQ) of each dQ path at d = 64 and 128 (the dQ kernel, fused in any order, fused in a fixed
    order; on the table's row tiles, and on 64-row ones at d = 64 too), and of the split-head-dim kernel at
    d = 256, against the oracle under the §3 rule."""
    b, sq, sk, hq, hkv = shape
    g = torch.Generator().manual_seed(sum(shape) + d + causal)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", dtype)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    tile = fused_dq_tile(d, ordered, causal=causal) if fused else _BWD_WS_DKDV[d]
    cfg = replace(bwd_config(d, d, dtype, "cuda", causal=causal), dkdv=replace(tile, block_m=rows or tile.block_m))
    dq, dk, dv = B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=cfg, deterministic=ordered or not fused)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    base = _baseline_grads(q, k, v, do, causal)
    for name, got, want, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, base):
        R.assert_within_rule(name, got, want, ref, str(dtype).replace("torch.", ""))


@gpu
@sm90
@pytest.mark.parametrize("d,fused,wide", [(64, False, False), (64, True, False), (128, False, False),
                                          (128, True, False), (128, True, True), (256, False, False)],
                         ids=["64", "64-fused-dq", "128", "128-fused-dq", "128-fused-dq-float32-out", "256"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[1:] + [(3, 300, 700, 6, 3)], ids=lambda s: "x".join(map(str, s)))
def test_persistent_programs_take_many_key_blocks(shape, causal, d, fused, wide, monkeypatch):
    """A persistent grid of at most 3 programs, so each runs several key blocks in turn where there are more than
    3 (K and V reloaded under the last block's epilogue, the Q/dO ring and the dSᵀ buffers wrapping across blocks;
    blocks of other heads and batch entries, with row tiles of one head or of a GQA group; the last shape's 9
    (batch, kv head) columns go in causal head groups, bwd_head_group): dK and dV are bitwise those of one program
    per block (the same sums in the same order), dQ too where the dQ kernel computes it (else to float32's
    summation order), and all meet the §3 rule. Stores by TMA (staged in K and V, or with the fused dQ in the
    dSᵀ/dQ buffers) and, into float32 outputs and at d = 256, from registers."""
    from onlineattn.ops import backward_sm90

    monkeypatch.setattr(backward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(B.launch_cache, "enabled", False)  # no kept launch of another grid
    dtype = torch.bfloat16
    q, k, v, do = gpu_inputs(shape, d, dtype, seed=sum(shape) + d + causal)
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    tile = fused_dq_tile(d, causal=causal) if fused else _BWD_WS_DKDV[d]
    base = replace(bwd_config(d, d, dtype, "cuda", causal=causal), dkdv=tile)
    outs = lambda: (torch.empty_like(q), *(torch.empty_like(x, dtype=torch.float32 if wide else dtype)  # noqa: E731
                                           for x in (k, v)))
    per_block = B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=base, deterministic=not fused, out=outs())
    cfg = replace(base, dkdv=replace(tile, persistent=True))
    got = B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=cfg, deterministic=not fused, out=outs())
    assert torch.equal(got[1], per_block[1]) and torch.equal(got[2], per_block[2])
    if fused:
        torch.testing.assert_close(got[0].float(), per_block[0].float(), rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(got[0], per_block[0])
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    ref = _baseline_grads(q, k, v, do, causal)
    for name, x, want, r in zip(("dq", "dk", "dv"), got, exact, ref):
        R.assert_within_rule(name, x.to(dtype), want, r, "bfloat16")


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,fused,ordered", [(128, False, False), (128, True, False), (128, True, True), (256, False, False)],
                         ids=["128", "128-fused-dq", "128-ordered-dq", "256"])
def test_repeat_relaunches_bitwise(causal, d, fused, ordered, monkeypatch):
    """A plain call seen before relaunches its kept launches (the Gluon dK/dV one among them, around fresh
    descriptors and counters) with new tensors, and gives bitwise what the full path gave (dQ of the unordered
    fused tile: to within its float32 summation order)."""
    from onlineattn.ops import backward_sm90

    monkeypatch.setattr(B, "_STEPS", {})
    starts = []
    start = backward_sm90.start
    monkeypatch.setattr(backward_sm90, "start", lambda *a, **kw: starts.append(1) or start(*a, **kw))
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(2, n, h, d, generator=g).to("cuda", torch.bfloat16)
                   for n, h in ((300, 4), (300, 2), (300, 2), (300, 4)))
    o, lse = F.forward(q, k, v, 0.1, causal)
    cfg = replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=causal),
                  dkdv=fused_dq_tile(d, ordered, causal=causal) if fused else _BWD_WS_DKDV[d])
    exact = ordered or not fused
    first = B.backward(do, q, k, v, o, lse, 0.1, causal, config=cfg, deterministic=exact)
    again = B.backward(*(x.clone() for x in (do, q, k, v, o, lse)), 0.1, causal, config=cfg, deterministic=exact)
    assert len(starts) == 1 and len(B._STEPS) == 1  # the second call was a repeat
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
    if not exact:  # float32 reduce-adds in any order: equal up to the last bits of float32 before the rounding to bf16
        torch.testing.assert_close(first[0].float(), again[0].float(), rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(first[0], again[0])


@gpu
@sm90
@pytest.mark.parametrize("d,left,hopper", [(64, 127, False), (64, 255, True), (128, 127, True), (256, 127, True)])
def test_table_routes_windows_by_span(d, left, hopper, monkeypatch):
    """The table takes the Hopper dK/dV kernel for a causal window where it measured faster than the Triton backward
    (BWD_WS_WINDOW_MIN_SPAN: at d = 64 from a 256-key span, NOTES v35); either way the gradients keep to the rule."""
    from onlineattn.ops import backward_sm90

    monkeypatch.setattr(B, "_STEPS", {})  # a kept step would launch nothing through launch_dkdv
    launched, launch = [], backward_sm90.launch_dkdv
    monkeypatch.setattr(backward_sm90, "launch_dkdv", lambda *a, **kw: launched.append(1) or launch(*a, **kw))
    g = torch.Generator().manual_seed(d + left)
    q, k, v, do = (torch.randn(1, 1024, 2, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    mods = Mods(window_left=left, window_right=0)
    o, lse = F.forward(q, k, v, d**-0.5, True, mods=mods)
    got = B.gradients(do, q, k, v, o, lse, d**-0.5, True, mods=mods)[:3]
    assert bool(launched) == hopper
    exact = R.naive_attention_backward(q, k, v, do, causal=True, window_size=(left, 0))
    base = _baseline_grads(q, k, v, do, True, window=(left, 0))
    for name, x, want, ref in zip(("dq", "dk", "dv"), got, exact, base):
        R.assert_within_rule(name, x, want, ref, "bfloat16")


@gpu
@sm90
@pytest.mark.parametrize("route", ["hopper", "triton"])
def test_kept_steps_are_keyed_by_the_window(route, monkeypatch):
    """Plain, then windows (127, 0) and (255, 0), then (127, 0) again over the same tensors: each new window takes
    the full path (the band is in the step's key), the last one repeats, and each matches the oracle."""
    monkeypatch.setattr(B, "_STEPS", {})
    if route == "triton":
        monkeypatch.setattr(B, "ws_ok", lambda *a, **kw: False)
    launched, full_launch = [], B._launch
    monkeypatch.setattr(B, "_launch", lambda *a, **kw: launched.append(1) or full_launch(*a, **kw))
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 1024, 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    for i, window in enumerate(((-1, -1), (127, 0), (255, 0), (127, 0))):
        mods = Mods(window_left=window[0], window_right=window[1]).canonical()
        o, lse = F.forward(q, k, v, 0.1, True, mods=mods)
        got = B.gradients(do, q, k, v, o, lse, 0.1, True, mods=mods)[:3]
        assert len(launched) == min(i + 1, 3)
        exact = R.naive_attention_backward(q, k, v, do, softmax_scale=0.1, causal=True, window_size=window)
        base = _baseline_grads(q, k, v, do, True, window=window, scale=0.1)
        for name, x, want, ref in zip(("dq", "dk", "dv"), got, exact, base):
            R.assert_within_rule(name, x, want, ref, "bfloat16")


@gpu
@sm90
@pytest.mark.parametrize("route", ["hopper", "triton"])
@pytest.mark.parametrize("case", ["causal-window-sinks", "window-sq-over-sk", "causal-sinks"])
def test_window_and_sink_calls_repeat_bitwise(case, route, monkeypatch):
    """A whole-batch call whose only variants are a window and sinks keeps its launches as a plain one does, keyed
    by the window's band (the kernels never read the sinks, which reach them through lse): a repeat with new
    tensors, new sinks among them, launches nothing new and gives bitwise what the full path gives, dsinks (from
    the sinks' kernel) too. A (300, 0) window without causal and Sq 600 rows over Sk runs the Hopper kernel's
    causal launch: the repeat zeroes the ordered dQ's unseen row tiles as that launch does (scratch NaN-filled)."""
    from onlineattn.ops import _launch as launch_cache

    b, sq, sk, causal, window, with_sinks = {
        "causal-window-sinks": (2, 700, 700, True, (200, 0), True),
        "window-sq-over-sk": (1, 1300, 700, False, (300, 0), False),
        "causal-sinks": (2, 500, 500, True, (-1, -1), True),
    }[case]
    d, hq, hkv = 128, 4, 2
    g = torch.Generator().manual_seed(11)

    def inputs():
        q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
                       for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
        sinks = torch.randn(hq, generator=g).to("cuda") if with_sinks else None
        mods = Mods(window_left=window[0], window_right=window[1], sinks=sinks).canonical()
        o, lse = F.forward(q, k, v, 0.1, causal, mods=mods)
        return (do, q, k, v, o, lse), mods

    monkeypatch.setattr(B, "_STEPS", {})
    if route == "triton":
        monkeypatch.setattr(B, "ws_ok", lambda *a, **kw: False)
    cfg = None if route == "triton" else replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=True),
                                                 dkdv=fused_dq_tile(d, ordered=True, causal=True))
    made, launched = B._dq_accumulator, []
    monkeypatch.setattr(B, "_dq_accumulator", lambda *a: _nan_scratch(made, *a))
    full_launch = B._launch
    monkeypatch.setattr(B, "_launch", lambda *a, **kw: launched.append(1) or full_launch(*a, **kw))
    tensors, mods = inputs()
    B.gradients(*tensors, 0.1, causal, config=cfg, mods=mods)
    tensors, mods = inputs()
    kept = B.gradients(*tensors, 0.1, causal, config=cfg, mods=mods)
    assert len(launched) == 1 and len(B._STEPS) == 1  # the second call was a repeat
    monkeypatch.setattr(launch_cache, "enabled", False)
    full = B.gradients(*tensors, 0.1, causal, config=cfg, mods=mods)
    assert len(launched) == 2
    for x, y in zip(kept, full):
        assert (x is None and y is None) or torch.equal(x, y)
    assert (kept[4] is not None) == with_sinks and torch.isfinite(kept[0]).all()
    if not with_sinks:
        assert not kept[0][:, : sq - sk].any()  # rows that see no key


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 700, 1300, 4, 2, 128), (2, 1300, 700, 4, 2, 128), (1, 1000, 1000, 4, 2, 64),
                                   (2, 129, 17, 2, 2, 128), (1, 100, 60, 2, 2, 128), (1, 64, 1000, 2, 2, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_ordered_dq_needs_no_zeroed_accumulator(shape, causal, monkeypatch):
    """The ordered tile's first add to each row tile stores, so its float32 accumulator is not zeroed: filled with
    NaN here (it comes from NaN-filled memory, and those row tiles must come back zeroed) past the row tiles no
    key block sees (causal, whole tiles above every key's diagonal), dQ comes out the same bits, through the full
    path and a repeat. Its counters come from the allocation unzeroed (poisoned
    here with a count past every turn, under which the adds would go in no order): the preprocess kernel zeroes
    them, and each ends at its row tile's adds, as in a clean call. Shapes: Sk > Sq, Sq > Sk by more and by less
    than a row tile, square, and one row tile under 8 key blocks (non-causal blocks then all start at it)."""
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator().manual_seed(sum(shape) + causal)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    o, lse = F.forward(q, k, v, 0.1, causal)
    cfg = replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=causal),
                  dkdv=fused_dq_tile(d, ordered=True, causal=causal))
    made, counters = B._dq_accumulator, []

    def clean(dq, tile, causal, seqlen_k):
        acc, sem, zero = made(dq, tile, causal, seqlen_k)
        counters.append(sem)
        return acc, sem, zero

    monkeypatch.setattr(B, "_dq_accumulator", clean)
    want = B.backward(do, q, k, v, o, lse, 0.1, causal, config=cfg)
    adds = counters[-1].clone()

    def poisoned(dq, tile, causal, seqlen_k):
        acc, sem, zero = _nan_scratch(made, dq, tile, causal, seqlen_k)
        unseen = max(sq - sk, 0) // tile.block_m * tile.block_m if causal else 0
        assert not acc[:, :unseen].any()
        acc[:, unseen:] = float("nan")
        sem.fill_(1 << 20)
        counters.append(sem)
        return acc, sem, zero

    monkeypatch.setattr(B, "_dq_accumulator", poisoned)
    monkeypatch.setattr(B, "_STEPS", {})
    for _ in range(2):  # the full path, then a repeat of its kept launches
        got = B.backward(do, q, k, v, o, lse, 0.1, causal, config=cfg)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        assert torch.equal(counters[-1], adds)
    assert len(B._STEPS) == 1
    if causal and sq > sk:
        assert not want[0][:, : sq - sk].any()


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 700, 1300, 4, 2, 128), (2, 1300, 700, 4, 2, 128), (1, 1000, 1000, 4, 2, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_unordered_dq_accumulator_is_zeroed_by_the_delta_pass(shape, causal, monkeypatch):
    """The fused tile that adds dQ in any order needs its float32 accumulator zeroed: it comes from the allocation
    filled with NaN here (padding rows too), and the preprocess kernel zeroes all its rows (the padding rows' memory
    holds other heads' values in the kernel's order) before the dK/dV kernel adds into them. dQ matches a clean call's
    up to float32 summation order (dK and dV, summed in registers, bit for bit), through the full path and a repeat.
    Shapes: Sk > Sq, Sq > Sk by more than a row tile (rows no key block sees), d = 64's 128-row tiles."""
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator().manual_seed(sum(shape) + causal)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    o, lse = F.forward(q, k, v, 0.1, causal)
    cfg = replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=causal), dkdv=fused_dq_tile(d, causal=causal))
    want = B.backward(do, q, k, v, o, lse, 0.1, causal, config=cfg, deterministic=False)
    made = B._dq_accumulator

    def poisoned(dq, tile, causal, seqlen_k):
        acc, sem, zero = made(dq, tile, causal, seqlen_k)
        acc.fill_(float("nan"))
        return acc, sem, zero

    monkeypatch.setattr(B, "_dq_accumulator", poisoned)
    monkeypatch.setattr(B, "_STEPS", {})
    for _ in range(2):  # the full path, then a repeat of its kept launches
        got = B.backward(do, q, k, v, o, lse, 0.1, causal, config=cfg, deterministic=False)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-7, atol=1e-6)
    assert len(B._STEPS) == 1


@gpu
@sm90
def test_table_fused_dq_follows_the_call(monkeypatch):
    """Through the table at d = 128 and N = the larger of BWD_FUSED_DQ_MIN_KEYS and BWD_ORDERED_DQ_MIN_KEYS: deterministic=False
    launches the fused kernel with its adds in any order, deterministic=True and torch's deterministic mode the
    fused kernel with its adds ordered (bitwise reproducible); each choice is kept as its own repeatable step, so a
    later call never reuses the other's launches."""
    from onlineattn.ops import backward_sm90

    monkeypatch.setattr(B, "_STEPS", {})
    fused = []
    start = backward_sm90.start
    monkeypatch.setattr(backward_sm90, "start",
                        lambda *a, **kw: fused.append((kw["FUSED_DQ"], kw["ORDERED"])) or start(*a, **kw))
    n = max(BWD_FUSED_DQ_MIN_KEYS[128][False], BWD_ORDERED_DQ_MIN_KEYS[128][False])
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, n, 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    o, lse = F.forward(q, k, v, 0.1, False)
    loose = B.backward(do, q, k, v, o, lse, 0.1, False, deterministic=False)
    exact = B.backward(do, q, k, v, o, lse, 0.1, False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        forced = B.backward(do, q, k, v, o, lse, 0.1, False, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert fused == [(True, False), (True, True)] and len(B._STEPS) == 2  # the forced call repeated the second
    assert all(torch.equal(a, b) for a, b in zip(exact, forced))
    for a, b in zip(loose, exact):  # ordered non-causal key blocks take their row tiles rotated: dK, dV sum apart
        torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-10)


@gpu
@sm90
def test_attention_deterministic_false_takes_the_fused_dq(monkeypatch):
    """End to end: ``onlineattn.attention(..., deterministic=False)`` with autograd launches the fused kernel at
    d = 128 from BWD_FUSED_DQ_MIN_KEYS with its adds in any order; the default call from BWD_ORDERED_DQ_MIN_KEYS the
    same kernel with its adds in a fixed order (dK and dV bitwise equal, dQ within the summation order;
    test_matches_oracle holds every path to the §3 rule)."""
    import onlineattn
    from onlineattn.ops import backward_sm90

    fused = []
    start = backward_sm90.start
    monkeypatch.setattr(backward_sm90, "start",
                        lambda *a, **kw: fused.append((kw["FUSED_DQ"], kw["ORDERED"])) or start(*a, **kw))
    n = max(BWD_FUSED_DQ_MIN_KEYS[128][True], BWD_ORDERED_DQ_MIN_KEYS[128][True])
    g = torch.Generator().manual_seed(13)
    base = [torch.randn(1, n, 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4)]
    grads = {}
    for deterministic in (False, True):
        q, k, v = (x.clone().requires_grad_() for x in base[:3])
        onlineattn.attention(q, k, v, causal=True, deterministic=deterministic).backward(base[3])
        grads[deterministic] = (q.grad, k.grad, v.grad)
    assert fused == [(True, False), (True, True)]
    assert torch.equal(grads[False][1], grads[True][1]) and torch.equal(grads[False][2], grads[True][2])
    torch.testing.assert_close(grads[False][0], grads[True][0], rtol=2**-6, atol=2**-10)


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 2048, 2048, 8, 2, 128), (1, 1000, 1000, 4, 2, 64), (2, 700, 1300, 6, 2, 128),
                                   (1, 128, 256, 2, 2, 128), (1, 1024, 2048, 2, 2, 128), (1, 64, 1000, 2, 2, 128),
                                   (1, 1024, 4096, 4, 2, 128), (1, 2100, 2100, 2, 2, 128), (1, 1300, 700, 4, 2, 128),
                                   (1, 700, 1300, 4, 2, 64), (1, 1300, 700, 2, 1, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_ordered_dq_is_bitwise_reproducible(shape, causal):
    """The ordered fused dQ gives the same bits on every run (four here, the last three repeats of a kept launch),
    and ends (no cycle of waits: non-causal key blocks start 0 (under one row tile per key block: together), 1, 2,
    3, 7 or 8 row tiles apart here), over GQA groups, odd lengths, 64- and 128-row tiles and Sq != Sk
    (causal: several key blocks then see the first row tile, their adds ordered among themselves; non-causal: key
    blocks start a non-power-of-two number of tiles apart), and stays within the summation order of the dQ kernel's
    result; causal dK and dV are that kernel's bitwise (the same sums in the same order), non-causal ones within
    their summation order (each key block's row tiles in rotated order). Causal programs launched last key block
    first (``last_block_first``) give the same bits as launched block 0 first: the launch order moves no add; nor
    does the order of a warpgroup's matmuls (``early_dv`` on and off)."""
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator().manual_seed(sq + sk + causal)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    base = bwd_config(d, d, torch.bfloat16, "cuda", causal=causal)
    ordered = replace(base, dkdv=fused_dq_tile(d, ordered=True, causal=causal))
    runs = [B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=ordered) for _ in range(4)]
    if causal:
        flipped = replace(ordered.dkdv, last_block_first=not ordered.dkdv.last_block_first)
        runs.append(B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=replace(ordered, dkdv=flipped)))
    reordered = replace(ordered.dkdv, early_dv=not ordered.dkdv.early_dv)
    runs.append(B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=replace(ordered, dkdv=reordered)))
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))
    kernel = B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=replace(base, dkdv=_BWD_WS_DKDV[d]))
    for i, (a, b) in enumerate(zip(runs[0], kernel)):
        if causal and i > 0:
            assert torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-10)


@gpu
@sm90
@pytest.mark.parametrize("d", [128, 256])
def test_other_dk_dv_are_stored_from_registers(d, monkeypatch):
    """Out buffers the TMA stores cannot take, off 16-byte alignment or float32 (ring attention's sums), still run the
    Gluon dK/dV kernel, which stores them from registers, and get bitwise the dK and dV of aligned buffers (the
    float32 ones before rounding)."""
    from onlineattn.ops import backward_sm90

    monkeypatch.setattr(B, "_STEPS", {})
    g = torch.Generator().manual_seed(d)
    q, k, v, do = (torch.randn(1, 1024, 2, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    o, lse = F.forward(q, k, v, d**-0.5, False)
    aligned = B.backward(do, q, k, v, o, lse, d**-0.5, False)
    launches = []
    start = backward_sm90.start
    monkeypatch.setattr(backward_sm90, "start", lambda *a, **kw: launches.append(1) or start(*a, **kw))
    odd = [torch.empty(x.numel() + 8, dtype=x.dtype, device="cuda")[1:1 + x.numel()].view(x.shape) for x in (k, v)]
    got = B.backward(do, q, k, v, o, lse, d**-0.5, False, out=(torch.empty_like(q), *odd))
    assert len(launches) == 1 and got[1] is odd[0] and got[2] is odd[1]
    assert torch.equal(got[1], aligned[1]) and torch.equal(got[2], aligned[2])
    wide = B.backward(do, q, k, v, o, lse, d**-0.5, False,
                      out=(torch.empty_like(q), *(torch.empty_like(x, dtype=torch.float32) for x in (k, v))))
    assert len(launches) == 2 and wide[1].dtype == torch.float32
    assert torch.equal(wide[1].to(q.dtype), aligned[1]) and torch.equal(wide[2].to(q.dtype), aligned[2])


@gpu
@sm90
def test_table_takes_the_split_kernel_at_d256(monkeypatch):
    """Through the table at d = 256 from BWD_WS_MIN_KEYS: ws_ok holds, the Gluon dK/dV kernel launches over 64-key
    blocks (grid: key blocks x batch·kv heads), and its gradients equal those of the Triton dK/dV tile it replaces
    (dK and dV bitwise: the same sums in the same order; dQ bitwise too, though its tile differs, _BWD_WS_DQ: each
    row's key loop adds the same 16-key products in the same order)."""
    from onlineattn.ops import backward_sm90

    grids = []
    start = backward_sm90.start
    monkeypatch.setattr(B, "_STEPS", {})
    monkeypatch.setattr(backward_sm90, "start", lambda keep, kernel, grid, *a, **kw: grids.append(grid)
                        or start(keep, kernel, grid, *a, **kw))
    n = BWD_WS_MIN_KEYS[256][True]
    g = torch.Generator().manual_seed(17)
    q, k, v, do = (torch.randn(2, n, 4, 256, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    assert B.ws_ok(do, q, k, v, PLAIN)
    o, lse = F.forward(q, k, v, 0.0625, True)
    table = B.backward(do, q, k, v, o, lse, 0.0625, True)
    assert grids == [(n // 64 * 2 * 4,)]
    triton = B.backward(do, q, k, v, o, lse, 0.0625, True, config=bwd_config(256, 256, torch.bfloat16, "cuda",
                                                                              causal=True))
    assert all(torch.equal(a, b) for a, b in zip(table, triton))


# ---------------------------------------------------------------------------------------------------------------
# Causal windows (right side 0): a key block's row tiles end where its last key leaves the rows' windows.

def _rows_end(pid_n, seqlen_q, seqlen_k, block_n, window_left):
    """The first row past key block ``pid_n``'s window: query i sees keys from i + Sk - Sq - window_left."""
    return (pid_n + 1) * block_n - (seqlen_k - seqlen_q) + window_left


def test_causal_window_blocks_visit_every_row_that_sees_them():
    """By a walk of ``_key_block``'s arithmetic over lengths, windows and tile shapes: each key block's row tiles (from
    ``lo`` to its window's end) hold every row that sees one of its keys, and each row tile is visited by exactly
    the key blocks ``_turn`` counts (those from its first row's left edge to the last on its diagonal, turns 0, 1,
    ... with none missing, so no ordered add waits on a turn that never comes)."""
    for block_m, block_n in ((64, 128), (128, 128), (64, 64)):
        for sq in (1, 64, 129, 300, 700):
            for sk in (1, 40, 128, 300, 701):
                for left in (0, 37, 128, 300, 2000):
                    visible = R.visible_mask(sq, sk, True, (left, 0))
                    diag = sk - sq
                    num_n, num_m = -(-sk // block_n), -(-sq // block_m)
                    visits = {mt: [] for mt in range(num_m)}
                    for j in range(num_n):
                        lo = max(j * block_n - diag, 0) // block_m * block_m
                        end = min(sq, _rows_end(j, sq, sk, block_n, left))
                        tiles = range(lo // block_m, lo // block_m + max(-(-(end - lo) // block_m), 0))
                        rows = np.flatnonzero(visible[:, j * block_n: (j + 1) * block_n].any(axis=1))
                        assert all(r // block_m in tiles for r in rows), (block_m, block_n, sq, sk, left, j)
                        for mt in tiles:
                            visits[mt].append(j)
                    for mt, blocks in visits.items():
                        if not blocks:  # unvisited: no row sees a key (an ordered launch zeroes such rows alone)
                            assert not visible[mt * block_m: (mt + 1) * block_m].any()
                            assert (mt + 1) * block_m <= (sq - sk) // block_m * block_m
                        last = (block_m * (mt + 1) + diag + block_n - 1) // block_n - 1  # _turn's
                        turns = sorted(min(last, num_n - 1) - j for j in blocks)
                        assert turns == list(range(len(turns))), (block_m, block_n, sq, sk, left, mt, blocks)


def test_backward_takes_causal_windows_and_sinks_not_others(monkeypatch):
    """``backward.ws_ok``: the Hopper dK/dV kernel runs plain calls, sinks (they reach it only through lse) and
    windows whose right side is 0 (causal, or right = 0: its ``window_left``), alone or together; not two-sided
    windows or other variants. Checked with the forward's conditions held true."""
    monkeypatch.setattr(B, "_forward_ws_ok", lambda *a: True)
    monkeypatch.setattr(B, "tma_aligned", lambda *a: True)
    x = torch.zeros(1, 8, 2, 128)
    sinks = torch.zeros(2)
    assert B.ws_ok(x, x, x, x, PLAIN) and B.ws_ok(x, x, x, x, Mods(window_left=4), True)
    assert B.ws_ok(x, x, x, x, Mods(window_left=4, window_right=0)) and B.ws_ok(x, x, x, x, Mods(window_right=7), True)
    assert B.ws_ok(x, x, x, x, Mods(sinks=sinks)) and B.ws_ok(x, x, x, x, Mods(window_left=4, sinks=sinks), True)
    for mods in (Mods(window_left=4), Mods(window_left=4, window_right=2), Mods(window_left=4, softcap=2.0),
                 Mods(softcap=2.0, sinks=sinks)):
        assert not B.ws_ok(x, x, x, x, mods)


def test_window_left_needs_a_causal_launch():
    """``launch_dkdv`` takes ``window_left`` (>= 0) with causal only (ValueError before any launch)."""
    from onlineattn.ops import backward_sm90
    q = torch.zeros(1, 64, 2, 128)
    for causal, left in ((False, 5), (True, -1)):
        with pytest.raises(ValueError, match="window_left"):
            backward_sm90.launch_dkdv(q, q, q, q, q[..., 0], q[..., 0], q, q, 0.1, causal, _BWD_WS_DKDV[128],
                                      window_left=left)


@gpu
@sm90
@pytest.mark.parametrize("d,fused,ordered", [(64, False, False), (64, True, False), (64, True, True),
                                             (128, False, False), (128, True, False), (128, True, True),
                                             (256, False, False)],
                         ids=["64", "64-fused-dq", "64-ordered-dq", "128", "128-fused-dq", "128-ordered-dq", "256"])
@pytest.mark.parametrize("window", [(0, 0), (37, 0), (128, 0), (300, 0)], ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-block", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_windows_match_oracle(shape, persistent, window, d, fused, ordered, monkeypatch):
    """dK, dV and dQ of each dQ path under a causal window (the Hopper forward's o and lse, or the Triton
    forward's where it does not run the window), one program per key block or 3 persistent programs (not the
    ordered tiles: their programs wait on one another, so all of a head's must be resident: the device's SMs),
    against the oracle under the §3 rule: row tiles past a block's window skipped, those crossing its edge masked,
    the ordered adds' turns from each row tile's first block."""
    from onlineattn.ops import backward_sm90

    if persistent and ordered:
        pytest.skip("dq_ordered tiles take one key block a program")
    if not ordered:
        monkeypatch.setattr(backward_sm90, "_sm_count", lambda device: 3)
    monkeypatch.setattr(B.launch_cache, "enabled", False)
    b, sq, sk, hq, hkv = shape
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(sum(shape) + d + sum(window))
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", dtype)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    mods = Mods(window_left=window[0], window_right=window[1])
    o, lse = F.forward(q, k, v, d**-0.5, True, mods=mods)
    tile = fused_dq_tile(d, ordered, causal=True) if fused else _BWD_WS_DKDV[d]
    cfg = replace(bwd_config(d, d, dtype, "cuda", causal=True), dkdv=replace(tile, persistent=persistent))
    dq, dk, dv = B.gradients(do, q, k, v, o, lse, d**-0.5, True, config=cfg, mods=mods,
                             deterministic=ordered or not fused)[:3]
    exact = R.naive_attention_backward(q, k, v, do, causal=True, window_size=window)
    base = _baseline_grads(q, k, v, do, True, window=window)
    for name, got, want, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, base):
        R.assert_within_rule(name, got, want, ref, "bfloat16")


@gpu
@sm90
@pytest.mark.parametrize("d,fused,ordered", [(64, True, True), (128, True, True), (128, True, False),
                                             (256, False, False)],
                         ids=["64-ordered-dq", "128-ordered-dq", "128-fused-dq", "256"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("shape", [(2, 300, 40, 4, 2), (2, 129, 17, 4, 4), (1, 700, 300, 6, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_non_causal_window_with_right_side_0_zeroes_unseen_rows(shape, sinks, d, fused, ordered, monkeypatch):
    """A non-causal call whose window's right side is 0 runs the causal launch: with Sq > Sk its rows above every
    key's diagonal see no key, and the ordered accumulator's row tiles there must be zeroed as under causal
    (``_dq_accumulator`` gets the launch's causal flag; its memory here is NaN-filled); with sinks too (through lse
    alone: lse = the sink on those rows)."""
    monkeypatch.setattr(B, "_STEPS", {})  # the full path: a step kept by the case without sinks would repeat
    b, sq, sk, hq, hkv = shape
    g = torch.Generator().manual_seed(sum(shape) + d + sinks)
    q, k, v, do = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
                   for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    sink = torch.randn(hq, generator=g).cuda() if sinks else None
    mods = Mods(window_left=37, window_right=0, sinks=sink)
    o, lse = F.forward(q, k, v, d**-0.5, False, mods=mods)
    tile = fused_dq_tile(d, ordered, causal=True) if fused else _BWD_WS_DKDV[d]
    cfg = replace(bwd_config(d, d, torch.bfloat16, "cuda", causal=True), dkdv=tile)
    made = B._dq_accumulator
    monkeypatch.setattr(B, "_dq_accumulator", lambda *a: _nan_scratch(made, *a))
    dq, dk, dv = B.gradients(do, q, k, v, o, lse, d**-0.5, False, config=cfg, mods=mods,
                             deterministic=ordered or not fused)[:3]
    kw = dict(causal=False, window_size=(37, 0), sinks=sink)
    exact = R.naive_attention_grads(q, k, v, do, **kw)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    R.torch_math_attention(*leaves, **kw)[0].backward(do)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        R.assert_within_rule(name, got, exact[name], ref.grad, "bfloat16")
