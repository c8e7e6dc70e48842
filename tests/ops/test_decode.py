"""Decoding against KV caches (``attention_with_kvcache``): the split-KV Triton kernel, the append kernel and the torch
path, against the oracle. Without CUDA the kernels run through Triton's interpreter on CPU tensors (fp32 and fp16;
the interpreter's bf16 dot is wrong); with CUDA they run on the GPU, plus bf16 and large shapes.

The central claim (issue #5): decoding a random sequence token by token after a prefill of any length reproduces
causal attention over the whole sequence, for contiguous and paged caches (random page tables, page sizes 16 and 256).
"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn.ops import _decode_configs as C
from onlineattn.ops import decode as D
from onlineattn.ops.forward import descriptor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
LAYOUTS = ["contiguous", "head-major", "paged16", "paged256"]  # head-major: [B, Hkv, L, D] memory as [B, L, Hkv, D]


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _sequence(b, n, hq, hkv, d, dv, dtype, *, seed, q_scale=1.0, device=DEVICE):
    """Random ``q [B, N, Hq, D]``, ``k [B, N, Hkv, D]``, ``v [B, N, Hkv, Dv]``: the whole sequence to decode."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g)
    q = (make(b, n, hq, d) * q_scale).to(device=device, dtype=dtype)
    return q, make(b, n, hkv, d).to(device, dtype), make(b, n, hkv, dv).to(device, dtype)


def _cache(layout, b, capacity, hkv, d, dv, dtype, *, seed, device=DEVICE):
    """Empty caches for ``b`` sequences of up to ``capacity`` tokens, filled with NaN so that reading a slot that was
    never written poisons the result. Head-major caches are strided views. Paged layouts draw a random block table
    over a pool with spare pages; two extra columns hold -1, which is fine because no sequence reaches them."""
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=device)
    if layout == "contiguous":
        return nan(b, capacity, hkv, d), nan(b, capacity, hkv, dv), None
    if layout == "head-major":  # SDPA's layout as views: each head's keys adjacent (the TMA rule's other case)
        return nan(b, hkv, capacity, d).transpose(1, 2), nan(b, hkv, capacity, dv).transpose(1, 2), None
    page = int(layout.removeprefix("paged"))
    per_seq = -(-capacity // page)
    pool = b * per_seq + 3
    g = torch.Generator().manual_seed(seed)
    table = torch.full((b, per_seq + 2), -1, dtype=torch.int32)
    table[:, :per_seq] = torch.randperm(pool, generator=g)[: b * per_seq].reshape(b, per_seq).int()
    return nan(pool, page, hkv, d), nan(pool, page, hkv, dv), table.to(device)


def _check(o, lse, exact_o, exact_lse, base_o, base_lse, dtype):
    R.assert_within_rule("o", o, exact_o, base_o, _name(dtype))
    R.assert_within_rule("lse", lse, exact_lse, base_lse, _name(dtype))


def _decode(q, k, v, caches, prefill: int, steps, **kw):
    """Prefill ``prefill`` tokens in one call, then one call per entry of ``steps`` (its number of tokens: 1 for
    decoding, more for speculative verification). Returns ``(o [B, N, Hq, Dv], lse [B, Hq, N])`` over all calls."""
    k_cache, v_cache, table = caches
    outs, start = [], 0
    for size in [prefill, *steps]:
        stop = start + size
        # alternate the two forms of cache_seqlens: an int, and an int32 tensor
        lens = start if len(outs) % 2 == 0 else torch.full((q.shape[0],), start, dtype=torch.int32, device=q.device)
        outs.append(onlineattn.attention_with_kvcache(
            q[:, start:stop], k_cache, v_cache, k[:, start:stop], v[:, start:stop], cache_seqlens=lens,
            block_table=table, return_lse=True, **kw,
        ))
        start = stop
    return torch.cat([o for o, _ in outs], dim=1), torch.cat([lse for _, lse in outs], dim=2)


CASES = [  # backend, dtype: the interpreter takes fp32/fp16, float64 is the torch path's
    ("triton", torch.float32), ("triton", torch.float16), ("torch", torch.float64), ("torch", torch.float16),
]
if DEVICE == "cuda":
    CASES += [("triton", torch.bfloat16), ("torch", torch.bfloat16)]


@pytest.mark.parametrize("backend,dtype", CASES, ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_by_token_decode_reproduces_causal_attention(layout, backend, dtype):
    """Issue #5's acceptance: prefill, then decode one token at a time (with one 3-token speculative step), and compare
    every output with causal attention over the whole sequence (section 3 rule)."""
    prefill = 261 if layout == "paged256" else 37  # past one page of 256; odd lengths
    steps = [1, 1, 3, 1, 1]
    n = prefill + sum(steps)
    b, hq, hkv, d, dv = 2, 6, 2, 40, 24  # GQA 3:1, head dims that are not powers of two, Dv != D
    q, k, v = _sequence(b, n, hq, hkv, d, dv, dtype, seed=n + len(layout))
    caches = _cache(layout, b, n + 5, hkv, d, dv, dtype, seed=n)
    o, lse = _decode(q, k, v, caches, prefill, steps, num_splits=3, backend=backend)
    _check(o, lse, *R.naive_attention(q, k, v, causal=True, return_lse=True),
           *R.torch_math_attention(q, k, v, causal=True), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequences_of_different_lengths(layout):
    """Each sequence has its own length (odd ones, 1 and one past a page), decoded in one batch."""
    lengths = [1, 17, 129, 40] if layout != "paged256" else [1, 257, 100, 17]
    steps = 3
    b, hq, hkv, d = len(lengths), 4, 1, 32  # MQA
    q, k, v = _sequence(b, max(lengths) + steps, hq, hkv, d, d, torch.float16, seed=sum(lengths))
    caches = _cache(layout, b, max(lengths) + steps, hkv, d, d, torch.float16, seed=1)
    k_cache, v_cache, table = caches
    for i, length in enumerate(lengths):  # prefill sequence i alone, through a one-row view of the batch
        row = slice(i, i + 1)
        onlineattn.attention_with_kvcache(
            q[row, :1], k_cache[row] if table is None else k_cache, v_cache[row] if table is None else v_cache,
            k[row, :length], v[row, :length], cache_seqlens=0, block_table=None if table is None else table[row],
            backend="triton",
        )
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for step in range(steps):
        index = (lens.long() + step)[:, None, None, None].expand(b, 1, *k.shape[2:])
        take = lambda x: x.gather(1, index[..., : x.shape[-1]].expand(b, 1, x.shape[2], x.shape[3]))
        o, lse = onlineattn.attention_with_kvcache(
            take(q), k_cache, v_cache, take(k), take(v), cache_seqlens=lens + step, block_table=table,
            num_splits=0 if step == 0 else 4, return_lse=True, backend="triton",
        )
        for i, length in enumerate(lengths):  # token length + step of sequence i sees its first length + step + 1
            stop = length + step + 1
            qi, ki, vi = q[i : i + 1, stop - 1 : stop], k[i : i + 1, :stop], v[i : i + 1, :stop]
            _check(o[i : i + 1], lse[i : i + 1], *R.naive_attention(qi, ki, vi, causal=True, return_lse=True),
                   *R.torch_math_attention(qi, ki, vi, causal=True), torch.float16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_one_call_matches_the_oracle(layout, causal, backend):
    """One call with several query tokens, more than the visible keys for one sequence (its first rows see nothing
    when causal), against the oracle's ``kvcache_attention``, which also gives the caches after the append."""
    b, hq, hkv, d, dv, sq, new = 2, 8, 2, 64, 64, 6, 2
    q, k, v = _sequence(b, sq, hq, hkv, d, dv, torch.float32, seed=3)
    _, k_new, v_new = _sequence(b, new, hq, hkv, d, dv, torch.float32, seed=4)
    k_cache, v_cache, table = _cache(layout, b, 50, hkv, d, dv, torch.float32, seed=5)
    k_cache.normal_(), v_cache.normal_()  # earlier tokens
    lens = torch.tensor([0, 45], dtype=torch.int32)  # sequence 0: 2 visible keys for 6 queries
    exact = R.kvcache_attention(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
                                causal=causal)
    o, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens.to(DEVICE),
                                               block_table=table, causal=causal, return_lse=True, backend=backend)
    R.assert_within_rule("o", o, exact[0], dtype_name="float32")
    R.assert_within_rule("lse", lse, exact[1], dtype_name="float32")
    assert torch.equal(k_cache.double().cpu(), torch.as_tensor(exact[2])), "the append wrote elsewhere"
    assert torch.equal(v_cache.double().cpu(), torch.as_tensor(exact[3]))
    if causal:
        assert torch.all(o[0, :4] == 0) and torch.all(lse[0, :, :4] == float("-inf"))


def test_without_new_tokens_the_cache_is_only_read():
    q, k, v = _sequence(2, 30, 4, 2, 32, 32, torch.float16, seed=6)
    k_cache, v_cache, table = _cache("paged16", 2, 30, 2, 32, 32, torch.float16, seed=7)
    onlineattn.attention_with_kvcache(q[:, :1], k_cache, v_cache, k, v, cache_seqlens=0, block_table=table)
    before = k_cache.clone(), v_cache.clone()
    o, lse = onlineattn.attention_with_kvcache(q[:, -2:], k_cache, v_cache, cache_seqlens=30, block_table=table,
                                               return_lse=True, num_splits=2, backend="triton")
    assert torch.equal(k_cache.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), before[1].nan_to_num(7.0))
    _check(o, lse, *R.naive_attention(q[:, -2:], k, v, causal=True, return_lse=True),
           *R.torch_math_attention(q[:, -2:], k, v, causal=True), torch.float16)


def _splits_outermost(monkeypatch):
    """Triton's interpreter runs a grid with its last axis innermost, so one row block's splits would all finish
    before the next block's start; remapped (a bijection of the program ids), the row blocks of one (sequence, kv
    head) interleave their splits, as on a GPU, and sharing a counter or a partial row between them shows."""
    from triton.runtime import interpreter

    builder = type(interpreter.interpreter_builder)
    set_grid_idx = builder.set_grid_idx

    def remapped(self, x, y, z):
        gx, gy, gz = self.grid_dim
        z2, rest = divmod((x * gy + y) * gz + z, gx * gy)
        return set_grid_idx(self, rest % gx, rest // gx, z2)

    monkeypatch.setattr(builder, "set_grid_idx", remapped)


@pytest.mark.parametrize("merge", ["at-once", "tree", "loop"])
@pytest.mark.parametrize("sq,hq,hkv", [(2, 4, 2), (1, 2, 2), (3, 6, 2), (5, 8, 1)],
                         ids=["4-rows", "1-row", "9-of-16-rows", "40-rows-in-16-row-blocks"])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_every_split_is_written_poisoned_outputs(num_splits, sq, hq, hkv, merge, monkeypatch):
    """Outputs and the split scratch start as NaN; more splits than key blocks leave empty chunks, which must still
    write (o = 0, lse = -inf) for the merge, whether it loads every partial at once (packed rows padded to a power
    of two: 1, 4, or 9 of 16; 40 rows as row blocks of 16, 16 and 8, each merging its own), runs as a tree of two
    partials a node (5 splits: three levels; 64, cut to the key blocks: four) or loops over them. Fresh scratch for
    this test, so the poison is not another test's."""
    real, real_at_once, taken = D._workspace, D._merge_at_once, []

    def poisoned(*args):
        work, counts = real(*args)
        return work.fill_(float("nan")), counts

    monkeypatch.setattr(D, "_WORKSPACES", {})
    monkeypatch.setattr(D, "_STEPS", {})  # no launch kept from another case: each case chooses its merge afresh
    monkeypatch.setattr(D, "_workspace", poisoned)
    if DEVICE == "cpu":
        _splits_outermost(monkeypatch)
    b, d = 2, 16
    tile = C.decode_config(d, d, torch.float32, DEVICE)
    tile = dataclasses.replace(tile, block_m=16) if sq * hq // hkv > 16 else tile
    block_rows = min(sq * hq // hkv, tile.block_m)
    elements = {"at-once": C.MERGE_AT_ONCE_MAX_ELEMENTS, "tree": 2 * D.next_power_of_2(block_rows) * d, "loop": 0}
    monkeypatch.setattr(C, "MERGE_AT_ONCE_MAX_ELEMENTS", elements[merge])
    monkeypatch.setattr(C, "MERGE_TREE_MAX_ROWS", 16)  # below the default 32: the tree at 9 of 16 rows, its limit
    monkeypatch.setattr(D, "_sm_count", lambda device: 1 << 20)  # every grid here counts as one program per SM
    monkeypatch.setattr(D, "_merge_at_once", lambda *args: taken.append(real_at_once(*args)) or taken[-1])
    q, k, v = _sequence(b, 300, hq, hkv, d, d, torch.float32, seed=num_splits)
    k_cache, v_cache = k.clone(), v.clone()
    lens = torch.tensor([298, 20], dtype=torch.int32, device=DEVICE)
    out = torch.full((b, sq, hq, d), float("nan"), device=DEVICE)
    lse_out = torch.full((b, hq, sq), float("nan"), device=DEVICE)
    o, lse = D.attention_with_kvcache(q[:, :sq], k_cache, v_cache, None, None, lens, None, d**-0.5, True, num_splits,
                                      out=out, lse_out=lse_out, config=tile)
    exact = R.kvcache_attention(q[:, :sq], k_cache, v_cache, cache_seqlens=lens)
    R.assert_within_rule("o", o, exact[0], dtype_name="float32")
    R.assert_within_rule("lse", lse, exact[1], dtype_name="float32")
    if num_splits > 1:
        assert all(int(counts.abs().sum()) == 0 for _, counts in D._WORKSPACES.values()), "a counter was not reset"
        launched = min(num_splits, -(-300 // tile.block_n))
        node = {"at-once": D.next_power_of_2(launched), "tree": 2, "loop": 0}[merge]
        tree = 0 < node < D.next_power_of_2(launched)  # 2 splits: one node, the one-load code
        assert taken and all(n["MERGE_SPLITS"] == node and n["MERGE_TREE"] == tree for n in taken)


def test_merge_at_once_only_where_the_grid_fits_the_sms():
    """The merge runs as a tree of at-once loads (one node where every partial fits) only where every program has an
    SM to itself (NOTES v19) and a node holds two partials or more; elsewhere MERGE_SPLITS is 0, the loop. Each row
    block merges its own rows."""
    def plan(grid_bh, row_blocks=1, rows=4, width=128, block_m=64):
        return D._Plan(grid_bh, row_blocks, rows, 0, (), {"BLOCK_DV": width, "BLOCK_M": block_m})

    def merge(*args):
        chosen = D._merge_at_once(*args)
        assert bool(chosen["MERGE_SPLITS"]) == bool(chosen["MERGE_ROWS"])  # both set, or both 0 (one loop build)
        assert chosen["MERGE_TREE"] == (0 < chosen["MERGE_SPLITS"] < D.next_power_of_2(args[1]))
        return chosen["MERGE_SPLITS"], chosen["MERGE_ROWS"]

    assert merge(plan(8), 16, 132) == (16, 4)  # B = 1, Hkv 8: 128 programs
    assert merge(plan(8), 16, 128) == (16, 4)  # exactly one program per SM
    assert merge(plan(8, rows=3), 12, 132) == (16, 4)  # both padded to powers of two
    assert merge(plan(16 * 8), 8, 132) == (0, 0)  # B = 16: 1024 programs, more than one per SM
    assert merge(plan(8), 32, 1024) == (32, 4)  # 32 x 4 x 128 float32: MERGE_AT_ONCE_MAX_ELEMENTS
    assert merge(plan(8), 64, 1024) == (32, 4)  # 64 x 4 x 128: past it, a tree of two nodes under a root
    assert merge(plan(8, rows=8), 32, 1024) == (16, 8)
    assert merge(plan(1, rows=8), 128, 132) == (16, 8)  # a tree of 8-row nodes of 16 partials
    assert merge(plan(1, rows=32), 128, 132) == (4, 32)  # 32-row nodes of 4 partials
    assert merge(plan(1, rows=64), 128, 132) == (0, 0)  # past MERGE_TREE_MAX_ROWS rows: the loop
    assert merge(plan(1, rows=64), 2, 132) == (2, 64)  # ... unless every partial fits one load
    assert merge(plan(8, rows=128, block_m=128), 4, 132) == (0, 0)  # one partial a load: no tree
    assert merge(plan(8), 32, 264) == (32, 4)  # the short-cache tile: two programs per SM (slots = 2 x SMs)
    assert merge(plan(8, row_blocks=2, rows=80), 2, 132) == (0, 0)  # several blocks of 64 rows: the loop
    assert merge(plan(1, row_blocks=2, rows=32, block_m=16), 64, 132) == (8, 16)  # 16-row blocks, nodes of 8
    assert merge(plan(8), 1, 132) == (0, 0)  # one split: nothing to merge


def test_merge_tree_scratch():
    """The scratch holds every level of the merge tree: 9 splits at two a node leave 5, 3 and 2 partials above them
    (a program's counters, one a group: 5 + 3 + 2 + the root's 1, within the 2 · 9 it is given); the loop keeps one
    level and one counter a program (row block)."""
    plan = D._Plan(3, 1, 4, 0, (), {"BLOCK_DV": 128, "HEAD_DIM_V": 100, "BLOCK_M": 16})
    assert D._scratch(plan, 9, 2) == (3 * (9 + 5 + 3 + 2) * 4 * 101, 3 * 2 * 9)
    assert D._scratch(plan, 9, 16) == (3 * 9 * 4 * 101, 3 * 2 * 9)  # a node past the splits: no upper level
    two_blocks = D._Plan(3, 2, 80, 0, (), {"BLOCK_DV": 128, "HEAD_DIM_V": 100, "BLOCK_M": 64})
    assert D._scratch(two_blocks, 9, 0) == (3 * 9 * 80 * 101, 6)
    assert D._scratch(two_blocks, 9, 16)[1] == 3 * 2 * 2 * 9  # a tree's counters for each row block
    with pytest.raises(ValueError, match="one partial"):  # a node of one partial would never reach the root
        D._scratch(plan, 4, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_merge_reuses_its_scratch(layout):
    """The merge runs in the split kernel (the last split of each program merges), with scratch kept between calls:
    many splits over odd lengths, paged or not, several query rows per program (two row blocks: GROUP 40 > 64 / 2
    with Sq = 2) and a row that sees nothing, called twice in a row on the same scratch with different lengths."""
    b, sq, hq, hkv, d, dv = 3, 2, 40, 1, 24, 40
    n = 300
    q, k, v = _sequence(b, n, hq, hkv, d, dv, torch.float32, seed=21)
    k_cache, v_cache, table = _cache(layout, b, n, hkv, d, dv, torch.float32, seed=22)
    onlineattn.attention_with_kvcache(q[:, :1], k_cache, v_cache, k, v, cache_seqlens=0, block_table=table)
    for lengths, splits in (([1, 129, 300], 7), ([17, 1000 % n, 2], 7), ([299, 64, 33], 3)):
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        o, lse = onlineattn.attention_with_kvcache(q[:, :sq], k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                   num_splits=splits, return_lse=True, backend="triton")
        exact = R.kvcache_attention(q[:, :sq], k_cache, v_cache, cache_seqlens=lens, block_table=table)
        R.assert_within_rule("o", o, exact[0], dtype_name="float32")
        R.assert_within_rule("lse", lse, exact[1], dtype_name="float32")
        for i, length in enumerate(lengths):  # a 2-query step over 1 key: its first query sees nothing
            assert bool(torch.all(lse[i, :, 0] == float("-inf"))) == (length < sq)


def test_lse_is_not_written_unless_asked():
    q, k, v = _sequence(1, 40, 4, 2, 16, 16, torch.float32, seed=23)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        o, lse = D.attention_with_kvcache(q[:, -1:], k, v, None, None, lens, None, 0.25, True, splits,
                                          return_lse=False)
        assert lse is None
        R.assert_within_rule("o", o, R.kvcache_attention(q[:, -1:], k, v, cache_seqlens=lens, softmax_scale=0.25)[0],
                             dtype_name="float32")


def test_outputs_given_must_be_contiguous():
    q, k, v = _sequence(1, 8, 4, 2, 16, 16, torch.float32, seed=24)
    lens = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    strided = torch.empty(1, 1, 4, 32, device=DEVICE)[..., :16]
    with pytest.raises(ValueError, match="out must be a contiguous"):
        D.attention_with_kvcache(q[:, :1], k, v, None, None, lens, None, 0.25, True, 1, out=strided)


def test_logits_near_fp16_overflow_and_non_contiguous_inputs():
    """q scaled by 60; q, the caches (every other head, a head-dim slice) and the block table are strided views."""
    b, n, hq, hkv, d = 2, 50, 8, 2, 32
    q, k, v = _sequence(b, n, 2 * hq, 2 * hkv, 2 * d, 2 * d, torch.float16, seed=8, q_scale=60.0)
    q, k, v = q[:, :, ::2, :d], k[:, :, ::2, d:], v[:, :, ::2, :d]
    k_pool, v_pool, wide_table = _cache("paged16", b, 2 * n, 2 * hkv, 2 * d, 2 * d, torch.float16, seed=9)
    k_cache, v_cache, table = k_pool[:, :, ::2, :d], v_pool[:, :, 1::2, d:], wide_table[:, ::2]
    assert not (q.is_contiguous() or k_cache.is_contiguous() or table.is_contiguous())
    o, lse = _decode(q, k, v, (k_cache, v_cache, table), 45, [1] * 5, num_splits=2, backend="triton")
    _check(o, lse, *R.naive_attention(q, k, v, causal=True, return_lse=True),
           *R.torch_math_attention(q, k, v, causal=True), torch.float16)


def test_strided_lengths_and_block_table_are_read_as_views():
    """A block table that is every other column of a wider one and lengths that are every other entry: the kernel
    path reads (and appends through) the same pages and lengths as the torch path, which indexes the views."""
    b, hq, hkv, d, page = 2, 4, 2, 16, 16
    g = torch.Generator().manual_seed(12)
    pool = torch.randn(12, page, hkv, d, generator=g)
    table = torch.randperm(12, generator=g).int().reshape(b, 6).to(DEVICE)[:, ::2]  # .to would make it contiguous
    lens = torch.tensor([20, 99, 40, 99], dtype=torch.int32, device=DEVICE)[::2]
    q, k, v = (torch.randn(b, 1, h, d, generator=g).to(DEVICE) for h in (hq, hkv, hkv))
    assert not (table.is_contiguous() or lens.is_contiguous())
    results = []
    for backend in ("triton", "torch"):
        k_cache, v_cache = pool.clone().to(DEVICE), pool.flip(0).clone().to(DEVICE)
        o = onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                              backend=backend)
        results.append((o, k_cache, v_cache))
    (o_t, k_t, v_t), (o_r, k_r, v_r) = results
    assert torch.equal(k_t, k_r) and torch.equal(v_t, v_r)
    torch.testing.assert_close(o_t, o_r, rtol=1e-5, atol=1e-5)


def test_triton_and_torch_appends_write_the_same_slots():
    b, hkv, d = 3, 2, 24
    _, k, v = _sequence(b, 9, hkv, hkv, d, d, torch.float32, seed=10)
    lens = torch.tensor([0, 15, 30], dtype=torch.int32, device=DEVICE)
    q = torch.zeros(b, 1, hkv, d, device=DEVICE)
    caches = []
    for backend in ("triton", "torch"):
        k_cache, v_cache, table = _cache("paged16", b, 40, hkv, d, d, torch.float32, seed=11)
        onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                          backend=backend)
        caches.append((k_cache.nan_to_num(-7.0), v_cache.nan_to_num(-7.0)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    exact = R.kvcache_attention(q, *_cache("paged16", b, 40, hkv, d, d, torch.float32, seed=11)[:2], k, v,
                                cache_seqlens=lens, block_table=table)
    assert torch.equal(caches[0][0].cpu(), torch.as_tensor(exact[2]).float().nan_to_num(-7.0))


def test_deterministic_bitwise():
    q, k, v = _sequence(1, 200, 8, 2, 64, 64, torch.float16, seed=12)
    runs = [onlineattn.attention_with_kvcache(q[:, -1:], k, v, cache_seqlens=200, num_splits=3, return_lse=True,
                                              backend="triton") for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_split_heuristic():
    """The measured rule (H200, 132 SMs, Hkv 8, 64-key blocks): one program per SM when the grid is small, chunks of
    about 64 blocks (at most 16) when the cache is long, never chunks shorter than the minimum number of blocks."""
    sms, block = 132, 64
    assert C.decode_num_splits(1 * 8, 32768, sms, block) == 16  # fill: 16 x 8 = 128 programs
    assert C.decode_num_splits(1 * 8, 131072, sms, block) == 16
    assert C.decode_num_splits(1 * 8, 4096, sms, 128) == 8  # the minimum chunk: 32 blocks / 4
    assert C.decode_num_splits(64 * 8, 32768, sms, block) == 8  # balance: 512 blocks / 64
    assert C.decode_num_splits(64 * 8, 131072, sms, block) == 16  # balance, capped
    assert C.decode_num_splits(64 * 8, 4096, sms, block) == 1
    assert C.decode_num_splits(16 * 8, 131072, sms, block) == 16
    assert C.decode_num_splits(8, 100, sms, block) == 1
    assert C.decode_num_splits(1, 10**7, 1000, block) == C.DECODE_MAX_SPLITS
    # without balance (the long-chunk tile) only the fill counts
    assert C.decode_num_splits(64 * 8, 131072, sms, 128, balance=False) == 1
    assert C.decode_num_splits(16 * 8, 131072, sms, 128, balance=False) == 1
    assert C.decode_num_splits(8 * 8, 32768, sms, 128, balance=False) == 2
    assert C.decode_num_splits(1 * 8, 131072, sms, 128, balance=False) == 16
    # two programs per SM over chunks of one block or more (the short-cache tile)
    assert C.decode_num_splits(1 * 8, 4096, sms, block, balance=False, per_sm=2, min_blocks=1) == 33
    assert C.decode_num_splits(1 * 8, 1024, sms, block, balance=False, per_sm=2, min_blocks=1) == 16
    # a tile of two programs per SM takes no more splits than its at-once merge holds, where it holds more than one
    short = C.DecodeConfig(64, 64, 4, 2, balance=False, per_sm=2, min_blocks=1)
    assert C.decode_splits(short, 8, 4096, sms, 4, 128) == 32  # 33 by the fill; 32 x 4 rows x 128 merge at once
    assert C.decode_splits(short, 8, 4096, sms, 128, 128) == 33  # 128 rows a program: one split at once, so no cap
    # ... unless the capped chunks would pass DECODE_SHORT_MAX_KEYS and the merge may run as a tree: whole nodes
    assert C.decode_splits(short, 4, 8192, sms, 7, 128) == 64  # 66 by the fill, nodes of 16 (8 rows)
    assert C.decode_splits(short, 1, 8192, sms, 8, 128) == 128
    assert C.decode_splits(short, 4, 2048, sms, 8, 128) == 16  # capped chunks of 128 keys: one node
    # ... or half that where the capped grid would fill at most 1 / DECODE_TREE_SPARSE of the SMs
    assert C.decode_splits(short, 1, 4096, sms, 8, 128) == 64  # 16 programs of 256 keys capped; 64 of one block
    assert C.decode_splits(short, 2, 2048, sms, 16, 128) == 32  # 2 x 8 programs of 256 keys capped
    assert C.decode_splits(short, 1, 2048, sms, 8, 128) == 16  # 16 of 128 keys: the cap
    assert C.decode_splits(short, 4, 4096, sms, 7, 128) == 16  # 4 x 16 capped: the cap
    assert C.decode_splits(short, 1, 8192, sms, 32, 128) == 64  # 32 rows: nodes of 4, three levels, not four
    # a tree takes the largest split count of one level fewer where that adds at most DECODE_TREE_LEVEL_KEYS a chunk
    assert C.decode_splits(LONG, 2, 131072, sms, 16, 128) == 64  # 66 by the fill: 3 levels of nodes of 8
    assert C.decode_splits(LONG, 1, 4481, sms, 16, 128) == 9  # 8 would add 63 keys, but a whole 128-key block
    assert C.decode_splits(LONG, 4, 32768, sms, 16, 128) == 33  # 8 would add 3,072 keys (whole blocks)
    assert C.decode_splits(short, 1, 8192, sms, 16, 128) == 64  # 128 splits of 64 keys: 64 of 128
    assert C.decode_splits(short, 1, 8192, sms, 64, 128) == 2  # 64 rows: no tree, the cap
    assert C.decode_splits(C.DecodeConfig(64, 64, 4, 3), 8, 4096, sms, 4, 128) == 16  # one program per SM: no cap
    # the long tile's whole waves (from the fill's count up: at most four waves, the last >= 85 % full, chunks of
    # >= 32k keys)
    long = C._DECODE_LONG[128]
    for b, length, splits in [(16, 131072, 4), (24, 131072, 2), (32, 131072, 2), (64, 131072, 1), (8, 131072, 4),
                              (12, 131072, 4), (16, 32768, 1), (16, 65536, 2), (64, 32768, 1), (16, 4096, 1),
                              (1, 131072, 16), (2, 131072, 8), (4, 131072, 4)]:
        assert C.decode_splits(long, b * 8, length, sms, 4, 128) == splits, (b, length)
    assert C.decode_wave_splits(96, 131072, sms, 1) == 4  # 1: 0.73 waves; 2: 1.45; 3: 2.18; 4: 2.91; 5: 3.64
    assert C.decode_wave_splits(8, 131072, sms, 16) == 16  # 8k-key chunks already: the fill's count
    assert C.decode_wave_splits(64, 131072, sms, 2) == 4  # 8 (3.88 waves) would cut 16k-key chunks
    assert C.decode_wave_splits(600, 131072, sms, 1) == 1  # past four waves at once
    assert C.decode_wave_splits(1, 1 << 30, sms, 128) == C.DECODE_MAX_SPLITS  # one program: 528 by the waves


def test_launcher_splits_as_its_tile_says(monkeypatch):
    """_choose counts splits with the chosen tile's balance: the long tile fills the SMs and no more (B = 64, 128k:
    one split; B = 8, 32k: two), the 64-key tile of a full grid keeps its balance splits (B = 64, 4k: one; with
    64-key blocks at 32k, eight), and the short-cache tile fills two programs per SM, no more splits than its at-once
    merge holds; each length's chunks decide TMA, whatever length the step saw first, but head-major caches take it
    at any chunk. Caches on the meta device stand in for the long ones (nothing is launched); expanded ones (zero
    strides) keep pointer loads."""
    monkeypatch.setattr(D, "_sm_count", lambda device: 132)
    monkeypatch.setattr(D, "decode_config", lambda d, dv, dtype, device_type, **kw: C.decode_config(
        d, dv, dtype, "cuda", **kw))
    monkeypatch.setattr(D, "decode_block_m", lambda *args: C.decode_block_m(*args[:6], "cuda", *args[7:]))
    for b, hq, hkv, length, tile, splits in (
            (64, 32, 8, 131072, LONG, 1), (8, 32, 8, 32768, LONG, 2),
            (64, 32, 8, 4096, HALF, 1),
            (1, 32, 8, 8192, LONG, 16), (1, 32, 8, 4096, SHORT, 32), (1, 32, 8, 1024, SHORT, 16),
            (1, 32, 32, 1024, SHORT, 8), (1, 32, 4, 2048, SHORT, 16),  # capped: chunks of 128 keys
            (1, 8, 2, 16384, SHORT, 128), (1, 28, 4, 8192, SHORT, 64),  # whole nodes of a merge tree (32, 16)
            (1, 32, 1, 8192, dataclasses.replace(SHORT, block_m=16), 64),  # 32 rows as two 16-row blocks
            (1, 32, 2, 8192, SHORT, 64),  # 16-row nodes of 8, two levels
            (2, 32, 1, 32768, dataclasses.replace(LONG, block_m=16), 33),
            (2, 32, 8, 2048, FILL, 8), (1, 64, 8, 4096, FILL, 16)):
        q = torch.zeros(b, 1, hq, 128, dtype=torch.bfloat16)
        cache = torch.empty(b, length, hkv, 128, dtype=torch.bfloat16, device="meta")
        chosen = D._choose(D._Step(), q, cache, cache, None, False, length, 0, None)
        assert (chosen.tile, chosen.splits) == (tile, splits), (b, hq, hkv, length)
        chunk = -(-(-(-length // splits)) // tile.block_n) * tile.block_n  # whole blocks, as the kernel cuts them
        assert chosen.tma == (chunk <= tile.tma_max_keys), (b, hq, hkv, length)  # B = 64, 128k: pointers
        if tile.per_sm > 1:
            assert D._merge_at_once(chosen.plan, chosen.splits, 132 * tile.per_sm)["MERGE_SPLITS"]
        expanded = cache[:1, :1].expand(b, length, hkv, 128)
        assert not D._choose(D._Step(), q, expanded, expanded, None, False, length, 0, None).tma
        head_major = torch.empty(b, hkv, length, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        by_heads = D._choose(D._Step(), q, head_major, head_major, None, False, length, 0, None)
        assert (by_heads.tile, by_heads.splits, by_heads.tma) == (tile, splits, tile.tma_max_keys > 0)  # any chunk
    # B = 16 at 4k and at 128k both take the long tile: TMA at 4k-key chunks (one split), pointers at 128k (four
    # splits of 32k keys, whole waves), in either order
    q = torch.zeros(16, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(16, 131072, 8, 128, dtype=torch.bfloat16, device="meta")
    for lengths in ((4096, 131072), (131072, 4096)):
        step = D._Step()
        chosen = [D._choose(step, q, cache, cache, None, False, length, 0, None) for length in lengths]
        assert [(c.tile, c.splits, c.tma) for c in chosen] == [(LONG, 1 if length <= TMA else 4, length <= TMA)
                                                                for length in lengths]
    q = torch.zeros(64, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16).expand(64, 32768, 8, 128)
    chosen = D._choose(D._Step(), q, cache, cache, None, False, 32768, 0, C.DecodeConfig(64, 64, 4, 2))
    assert chosen.splits == 8  # balance: 512 blocks / 64


@pytest.mark.parametrize("sms,sq,causal_build", [(1, 1, False), (1 << 20, 1, True), (1, 3, True)],
                         ids=["pairs-past-sms", "fill", "three-tokens"])
def test_one_token_causal_build(sms, sq, causal_build, monkeypatch):
    """One query token sees every key, so a causal call launches the plain build where (sequence, kv head) pairs
    exceed the SMs and keeps the causal one elsewhere (the faster build of each, NOTES v36); more tokens always keep
    it (their masks are real). The rows against the oracle."""
    monkeypatch.setattr(D, "_STEPS", {})
    monkeypatch.setattr(D, "_sm_count", lambda device: sms)
    q, k, v = _sequence(2, 70, 4, 2, 16, 16, torch.float32, seed=16)
    lens = torch.tensor([70, 33], dtype=torch.int32, device=DEVICE)
    o, lse = D.attention_with_kvcache(q[:, -sq:], k, v, None, None, lens, None, 0.25, True, 2)
    (key,) = D._STEPS
    assert key[1] is causal_build
    exact = R.kvcache_attention(q[:, -sq:], k, v, cache_seqlens=lens, softmax_scale=0.25)
    R.assert_within_rule("o", o, exact[0], dtype_name="float32")
    R.assert_within_rule("lse", lse, exact[1], dtype_name="float32")


def test_growing_lengths_reuse_one_step(monkeypatch):
    """The step memo leaves the lengths out of its key (they grow by one per decoding step): the split count is
    recomputed, the plans and each (tile, split count)'s Relaunch are kept."""
    monkeypatch.setattr(D, "_STEPS", {})
    q, k, v = _sequence(2, 64, 4, 2, 16, 16, torch.float32, seed=13)
    lens = torch.full((2,), 40, dtype=torch.int32, device=DEVICE)
    for longest in (40, 41, 42, 64):
        D.attention_with_kvcache(q[:, :1], k, v, None, None, lens, None, 0.25, True, 0, max_seqlen_k=longest)
    assert len(D._STEPS) == 1


TMA = C.DECODE_TMA_MAX_KEYS  # d = 128's contiguous tiles stream K and V by TMA up to chunks of this many keys
LONG = C.DecodeConfig(128, 64, 4, 3, balance=False, tma_max_keys=TMA, waves=True)  # long chunks: fill, then waves
FILL = C.DecodeConfig(64, 64, 4, 3, tma_max_keys=TMA)  # one program per SM
HALF = C.DecodeConfig(64, 64, 4, 2, tma_max_keys=TMA)  # fuller grids
SHORT = C.DecodeConfig(64, 64, 4, 2, balance=False, per_sm=2, min_blocks=1)  # short caches: two programs per SM


def test_decode_tiles_count_row_blocks_and_given_splits():
    """The one-program-per-SM tile needs the programs actually launched: row blocks and an explicit split count
    count."""
    pick = lambda programs, length, splits=0: C.decode_config(  # noqa: E731
        128, 128, torch.bfloat16, "cuda", batch_heads=programs, max_seqlen_k=length, num_sms=132, num_splits=splits)
    assert pick(128, 4096) == LONG  # B = 16 x 8 kv heads, one row block, one split
    assert pick(256, 4096) == HALF  # two row blocks each
    assert pick(256, 32768) == LONG  # ... over chunks of at least DECODE_LONG_MIN_KEYS
    assert pick(128, 4096, splits=16) == HALF
    assert pick(8, 4096, splits=4) == LONG  # chunks of 1024 keys: 8 blocks of 128
    assert pick(8, 4096, splits=16) == FILL  # chunks of 256 keys


def test_decode_tiles():
    """Grids of at most one program per SM (after the automatic split) take 3 stages, the short-cache tile where
    their chunks would be short and the query rows few, and the long-chunk tile (128-key blocks, no balance splits)
    where every chunk still holds DECODE_MIN_BLOCKS_PER_SPLIT of them; fuller grids take it from DECODE_LONG_MIN_KEYS
    keys per chunk, and 64-key, 4-warp, 2-stage tiles below."""
    pick = lambda bh, length: C.decode_config(128, 128, torch.bfloat16, "cuda", batch_heads=bh, max_seqlen_k=length,
                                              num_sms=132, rows=32)
    for bh, length in ((8, 0), (128, 0), (128, 511), (128, 256), (8, 300)):  # lengths unknown, or too few splits
        assert pick(bh, length) == FILL
    short = lambda bh, length, rows: C.decode_config(128, 128, torch.bfloat16, "cuda", batch_heads=bh,  # noqa: E731
                                                     max_seqlen_k=length, num_sms=132, rows=rows)
    for bh, length, rows in ((8, 1024, 32), (8, 4096, 32), (16, 2048, 32), (32, 1024, 32), (2, 16384, 8)):
        assert short(bh, length, rows) == SHORT  # fill chunks of <= 256 keys
    assert short(2, 16384, 32) == SHORT  # 16 rows a program: a tree of 8-partial nodes, 128 splits of 128 keys
    assert short(8, 4096, 32) == SHORT and short(8, 4096, 64) != SHORT  # B = 1 with Hq 32, not Hq 64
    assert short(32, 1024, 32) == SHORT and short(32, 1024, 128) != SHORT  # 32 kv heads, not B = 4 of 8
    assert C.MERGE_TREE_MAX_ROWS >= C.DECODE_SHORT_MAX_ROWS  # every short-tile grid can merge as a tree
    for bh, length, rows in itertools.product((1, 2, 4, 8, 16, 32), range(64, 20000, 97), (1, 4, 8, 16, 32)):
        if rows >= bh and short(bh, length, rows) == SHORT:  # its split keeps chunks short: one load or a tree
            splits = C.decode_splits(SHORT, bh, length, 132, -(-rows // bh), 128)
            assert splits > 1 and -(-length // splits) <= 512, (bh, length, rows)
    for bh, length in ((8, 8192), (8, 32768), (8, 131072), (128, 512), (128, 4096), (128, 32768), (512, 16384),
                       (16, 4096), (32, 4096),
                       (512, 131072), (64, 32768), (32, 131072)):
        assert pick(bh, length) == LONG
    assert C.decode_config(64, 64, torch.bfloat16, "cuda", batch_heads=8, max_seqlen_k=131072,
                           num_sms=132) == C.DecodeConfig(64, 64, 4, 3)  # 128-key blocks measured at d = 128 only
    for bh, length in ((512, 4096), (512, 16383), (256, 4096), (512, 0)):
        assert pick(bh, length) == HALF
    # the long tile's own split count fills the SMs once: 512 keys a chunk suffice, as in fill grids
    for bh, length in ((128, 8192), (32, 32768), (16, 65536)):
        assert pick(bh, length) == LONG
    # explicit split counts in a full grid: chunks of 16384 keys or more take the long tile
    explicit = lambda splits: C.decode_config(128, 128, torch.bfloat16, "cuda", batch_heads=512,  # noqa: E731
                                              max_seqlen_k=32768, num_sms=132, num_splits=splits)
    assert explicit(2) == LONG and explicit(4) == HALF
    assert C.decode_config(128, 128, torch.float16, "cuda", batch_heads=512, max_seqlen_k=131072, num_sms=132) == LONG
    for d, dtype in ((64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)):  # long tile at d = 128 only
        tile = C.decode_config(d, d, dtype, "cuda", batch_heads=512, max_seqlen_k=131072, num_sms=132)
        assert tile.balance and tile.block_n < 128
    assert C.decode_config(128, 128, torch.float32, "cuda", batch_heads=8, max_seqlen_k=4096, num_sms=132).block_n == 32
    # TMA as measured: d = 128's half-precision contiguous tiles but the short-cache one; not d = 64 / 256 or float32
    assert SHORT.tma_max_keys == 0 and LONG.tma_max_keys == FILL.tma_max_keys == HALF.tma_max_keys == TMA > 0
    for d, dtype in ((64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)):
        for bh, length in ((8, 4096), (512, 4096), (512, 131072)):
            assert C.decode_config(d, d, dtype, "cuda", batch_heads=bh, max_seqlen_k=length, num_sms=132,
                                   rows=bh * 4).tma_max_keys == 0


def test_wide_groups_take_16_row_blocks():
    """One query token of a GQA group of 17-32 heads, over at most 4 (sequence, kv head) pairs with automatic splits:
    row blocks of 16 (contiguous half-precision caches of head dims 65-128, as measured); the tables' 64 elsewhere."""
    def block_m(group, pairs, sq=1, d=128, dtype=torch.bfloat16, device="cuda", paged=False, splits=0):
        return C.decode_block_m(sq, group, pairs, 132, d, dtype, device, paged, splits)

    assert block_m(32, 1) == block_m(17, 4) == block_m(32, 4) == 16  # Hq 32 / Hkv 1 at B = 1 or 4
    assert block_m(16, 1) == block_m(33, 1) == block_m(32, 5) == 64  # one block; three blocks; more pairs
    assert block_m(32, 1, sq=2) == block_m(16, 1, sq=2) == block_m(32, 1, splits=64) == 64  # untimed
    assert block_m(32, 1, d=64) == block_m(32, 1, d=256) == block_m(32, 1, dtype=torch.float32) == 64
    assert block_m(32, 1, device="cpu") == block_m(32, 1, paged=True) == 64


def test_decode_tiles_paged():
    """Paged d = 128 caches take 5 stages: 128-key blocks at one program per SM at any length, 64-key blocks in fuller
    grids; other head dims and float32 keep the contiguous tables."""
    pick = lambda bh, length, d=128, dtype=torch.bfloat16: C.decode_config(  # noqa: E731
        d, d, dtype, "cuda", batch_heads=bh, max_seqlen_k=length, num_sms=132, paged=True)
    for bh, length in ((8, 4096), (8, 131072), (128, 4096)):
        assert pick(bh, length) == C.DecodeConfig(128, 64, 4, 5)
    for bh, length in ((128, 32768), (512, 32768)):
        assert pick(bh, length) == C.DecodeConfig(64, 64, 4, 5)
    assert pick(8, 131072, d=64) == C.decode_config(64, 64, torch.bfloat16, "cuda", batch_heads=8,
                                                    max_seqlen_k=131072, num_sms=132)
    assert pick(8, 4096, dtype=torch.float32).block_n == 32


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16, long caches, the benchmark shapes.


TMA_DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=_name)
@pytest.mark.parametrize("sq,num_splits", [(1, 1), (1, 3), (3, 2)], ids=["one-token", "splits", "causal-rows"])
def test_tma_and_pointer_loads_agree(sq, num_splits, dtype, monkeypatch):
    """K and V by TMA (tensor descriptors) and by pointer loads give the same bits, and the oracle's answer, over a
    NaN-filled cache whose sequences end inside a key block (the copy engine reads the stale slots there: the masked
    block must zero their values) and past it (zero-filled at the capacity's end)."""
    monkeypatch.setattr(D, "_STEPS", {})
    built = []
    monkeypatch.setattr(D, "descriptor", lambda x, *box: built.append(box) or descriptor(x, *box))
    b, hq, hkv, d, capacity = 3, 8, 2, 64, 150
    q, k, v = _sequence(b, capacity, hq, hkv, d, d, dtype, seed=sq + num_splits)
    k_cache, v_cache, _ = _cache("contiguous", b, capacity, hkv, d, d, dtype, seed=0)
    lens = torch.tensor([150, 77, 5], dtype=torch.int32, device=DEVICE)
    for i, n in enumerate(lens.tolist()):
        k_cache[i, :n], v_cache[i, :n] = k[i, :n], v[i, :n]
    base = C.decode_config(d, d, dtype, DEVICE, batch_heads=b * hkv, max_seqlen_k=capacity, num_sms=132)
    outs = {}
    for tma in (0, 1 << 20):
        tile = dataclasses.replace(base, tma_max_keys=tma)
        outs[tma] = D.attention_with_kvcache(q[:, :sq], k_cache, v_cache, None, None, lens, None, d**-0.5, True,
                                             num_splits, config=tile)
        ((chosen,),) = [list(step.lengths.values()) for step in D._STEPS.values()]
        D._STEPS.clear()
        assert chosen.tma == bool(tma) and len(built) == (2 if tma else 0)
        assert (chosen.descriptors is not None) == (tma and DEVICE == "cuda")  # kept on CUDA only
    for a, b_ in zip(outs[0], outs[1 << 20]):
        assert torch.equal(a, b_)
    exact = R.kvcache_attention(q[:, :sq].double(), k_cache.double(), v_cache.double(), cache_seqlens=lens)
    base_o = R.kvcache_attention(q[:, :sq], k_cache, v_cache, cache_seqlens=lens)
    R.assert_within_rule("o", outs[0][0], exact[0], base_o[0], _name(dtype))
    R.assert_within_rule("lse", outs[0][1], exact[1], base_o[1], _name(dtype))


HEAD_MAJOR_LAYOUTS = [  # (name, head dim, kv heads, K head-major, V head-major, TMA at a long chunk)
    ("head-major", 32, 2, True, True, True),
    ("flash-attn", 32, 2, False, False, False),
    ("one-kv-head", 32, 1, False, False, True),  # flash-attn's layout, but each head's keys are adjacent
    ("k-only", 32, 2, True, False, False),
    ("unaligned-rows", 34, 2, True, True, False),  # 136-byte keys: the copy engine takes 16-byte multiples only
]


@pytest.mark.parametrize("name,d,hkv,k_by_heads,v_by_heads,tma", HEAD_MAJOR_LAYOUTS, ids=[c[0] for c in
                                                                                            HEAD_MAJOR_LAYOUTS])
def test_head_major_caches_take_tma_at_any_chunk(name, d, hkv, k_by_heads, v_by_heads, tma, monkeypatch):
    """Caches whose heads' keys are adjacent (``[B, Hkv, L, D]`` memory viewed as ``[B, L, Hkv, D]``, or one kv head)
    stream chunks longer than the tile's ``tma_max_keys`` by TMA (descriptors handed to the kernel); flash-attn's
    layout, one cache of each kind, or strides the copy engine cannot take keep pointer loads. Every layout gives
    the bits of flash-attn's layout through pointer loads, and the oracle's answer (NaN past each length)."""
    monkeypatch.setattr(D, "_STEPS", {})
    built = []
    monkeypatch.setattr(D, "descriptor", lambda x, *box: built.append(box) or descriptor(x, *box))
    b, hq, capacity = 2, 4, 200
    q, k, v = _sequence(b, capacity, hq, hkv, d, d, torch.float32, seed=11)
    lens = torch.tensor([200, 131], dtype=torch.int32, device=DEVICE)
    tile = dataclasses.replace(C.decode_config(d, d, torch.float32, DEVICE), tma_max_keys=64)  # one split: 200 keys

    def caches(k_heads, v_heads):
        out = []
        for x, by_heads in ((k, k_heads), (v, v_heads)):
            c = torch.full((b, hkv, capacity, d) if by_heads else (b, capacity, hkv, d), float("nan"), device=DEVICE)
            c = c.transpose(1, 2) if by_heads else c
            for i, n in enumerate(lens.tolist()):
                c[i, :n] = x[i, :n]
            out.append(c)
        return out

    def run(k_cache, v_cache, config):
        o = D.attention_with_kvcache(q[:, :1], k_cache, v_cache, None, None, lens, None, d**-0.5, False, 1,
                                     config=config)
        ((chosen,),) = [list(step.lengths.values()) for step in D._STEPS.values()]
        D._STEPS.clear()
        return o, chosen

    flash_layout = caches(False, False)
    want, pointers = run(*flash_layout, dataclasses.replace(tile, tma_max_keys=0))  # a tile without TMA
    assert not pointers.tma and not built
    got, chosen = run(*caches(k_by_heads, v_by_heads), tile)
    assert chosen.tma == tma and len(built) == (2 if tma else 0), name
    for a, b_ in zip(got, want):
        assert torch.equal(a, b_)
    exact = R.kvcache_attention(q[:, :1].double(), *(x.double() for x in flash_layout), cache_seqlens=lens)
    base_o = R.kvcache_attention(q[:, :1], *flash_layout, cache_seqlens=lens)
    _check(*got, exact[0], exact[1], base_o[0], base_o[1], torch.float32)


def test_tma_needs_aligned_bases(monkeypatch):
    """Two caches of the same shape and strides but different values, one at a 16-byte aligned address and one 4
    bytes past it: the launcher hands the kernel descriptors of the aligned pair (kept on CUDA) and the shifted
    caches themselves (pointer loads: the copy engine cannot read them), each call right against its own values, and
    goes back to the aligned pair's descriptors."""
    monkeypatch.setattr(D, "_STEPS", {})
    handed = []
    real_kv_args = D._kv_args
    monkeypatch.setattr(D, "_kv_args", lambda *args: handed.append(real_kv_args(*args)) or handed[-1])
    b, hq, hkv, d, n = 2, 4, 2, 16, 40
    room = torch.zeros(2, 2, b * n * hkv * d + 4, device=DEVICE)  # per shift, K's and V's
    q, caches, exact = None, {}, {}
    for shift in (0, 1):
        q, k, v = _sequence(b, n, hq, hkv, d, d, torch.float32, seed=5 + shift)
        k_cache, v_cache = (room[shift, i, shift : shift + k.numel()].view(k.shape) for i in (0, 1))
        k_cache.copy_(k), v_cache.copy_(v)
        caches[shift] = k_cache, v_cache
    assert caches[0][0].data_ptr() % 16 == 0 and caches[1][0].data_ptr() % 16 == 4
    tile = dataclasses.replace(C.decode_config(d, d, torch.float32, DEVICE), tma_max_keys=1 << 20)
    lens = torch.tensor([n, 9], dtype=torch.int32, device=DEVICE)
    for shift in (0, 1):
        exact[shift] = R.kvcache_attention(q[:, :1], *caches[shift], cache_seqlens=lens)
    assert not np.allclose(exact[0][0], exact[1][0])
    for shift in (0, 1, 0):
        o, lse = D.attention_with_kvcache(q[:, :1], *caches[shift], None, None, lens, None, d**-0.5, False, 2,
                                          config=tile)
        R.assert_within_rule("o", o, exact[shift][0], dtype_name="float32")
        ((step,),) = [list(s.lengths.values()) for s in D._STEPS.values()]
        k_arg, v_arg = handed[-1]
        assert step.tma and (k_arg is caches[1][0] and v_arg is caches[1][1]) == (shift == 1)
        if shift == 0:
            assert [x.base.data_ptr() for x in (k_arg, v_arg)] == [x.data_ptr() for x in caches[0]]
    if DEVICE == "cuda":  # the aligned pair's descriptors, kept: the same objects both times
        assert handed[0][0] is handed[2][0] and handed[0][1] is handed[2][1]


def _check_decode_rows(q, k, v, o, lse, lengths, dtype):
    """Sequence i's ``Sq`` queries are its last tokens: check them against float64 math on the GPU over its first
    ``lengths[i]`` keys (bottom-right causal)."""
    for i, length in enumerate(lengths):
        qi, ki, vi = q[i : i + 1], k[i : i + 1, :length], v[i : i + 1, :length]
        exact_o, exact_lse = R.torch_math_attention(qi.double(), ki.double(), vi.double(), causal=True)
        base_o, base_lse = R.torch_math_attention(qi, ki, vi, causal=True)
        _check(o[i : i + 1], lse[i : i + 1], exact_o, exact_lse, base_o, base_lse, dtype)


@gpu
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", [[4113, 1, 32768 + 5, 999], [131072]], ids=["ragged", "128k"])
def test_long_caches_bf16(lengths, layout, num_splits, sq):
    """Sequences of different lengths (one shorter than the queries: its first rows see nothing), written with the
    append kernel into NaN-filled caches, then ``sq`` query tokens per sequence into NaN-poisoned outputs."""
    b, hq, hkv, d = len(lengths), 32, 8, 128
    _, k, v = _sequence(b, max(lengths), hkv, hkv, d, d, torch.bfloat16, seed=sum(lengths), device="cuda")
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache, table = _cache(layout, b, max(lengths), hkv, d, d, torch.bfloat16, seed=13, device="cuda")
    for i, length in enumerate(lengths):
        row = slice(i, i + 1)
        D.cache.append_kv(k_cache[row] if table is None else k_cache, v_cache[row] if table is None else v_cache,
                          k[row, :length], v[row, :length], torch.zeros(1, dtype=torch.int32, device="cuda"),
                          None if table is None else table[row])
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.full((b, sq, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse_out = torch.full((b, hq, sq), float("nan"), device="cuda")
    o, lse = D.attention_with_kvcache(q, k_cache, v_cache, None, None, lens, table, d**-0.5, True, num_splits,
                                      out=out, lse_out=lse_out)
    _check_decode_rows(q, k, v, o, lse, lengths, torch.bfloat16)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_by_token_decode_bf16_gpu(layout):
    b, hq, hkv, d, prefill, steps = 3, 32, 8, 128, 1000, 48
    q, k, v = _sequence(b, prefill + steps, hq, hkv, d, d, torch.bfloat16, seed=14, device="cuda")
    caches = _cache(layout, b, prefill + steps, hkv, d, d, torch.bfloat16, seed=15, device="cuda")
    o, lse = _decode(q, k, v, caches, prefill, [1] * steps)
    exact_o, exact_lse = R.torch_math_attention(q.double(), k.double(), v.double(), causal=True)
    _check(o, lse, exact_o, exact_lse, *R.torch_math_attention(q, k, v, causal=True), torch.bfloat16)


@gpu
@pytest.mark.parametrize("b,length", [(1, 4096), (16, 32768), (64, 32768)])
def test_benchmark_shapes_bf16(b, length):
    """The bench grid's shapes (Hq 32, Hkv 8, d 128), contiguous, automatic splits; a few sequences checked."""
    q, k, v = _sequence(b, 1, 32, 8, 128, 128, torch.bfloat16, seed=b, device="cuda")
    k_cache = torch.randn(b, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(b, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    o, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, return_lse=True)
    for i in sorted({0, b // 2, b - 1}):
        _check_decode_rows(q[i : i + 1], k_cache[i : i + 1], v_cache[i : i + 1], o[i : i + 1], lse[i : i + 1],
                           [length], torch.bfloat16)


@gpu
@pytest.mark.parametrize("b,hq,hkv,lengths", [(1, 32, 8, [1024]), (1, 32, 8, [4096]), (2, 16, 4, [2048, 700]),
                                              (1, 32, 32, [1000]), (1, 8, 2, [16384]), (1, 16, 16, [2001]),
                                              (1, 32, 1, [8192]), (1, 32, 2, [8191]), (1, 8, 1, [32768])])
def test_short_caches_bf16(b, hq, hkv, lengths, monkeypatch):
    """Short caches take the two-programs-per-SM tile with automatic splits (chunks of 64-key blocks, merged at once
    or by a tree of such loads): the rows against float64, the choice, and the launch's own
    merge (recorded from the launcher, so a grid counted against one program per SM would show as the loop)."""
    real, taken = D._merge_at_once, []
    monkeypatch.setattr(D, "_STEPS", {})
    monkeypatch.setattr(D, "_merge_at_once", lambda *args: taken.append(real(*args)) or taken[-1])
    length = max(lengths)
    q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(b, length, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    chosen = D._choose(D._Step(), q, k_cache, v_cache, None, False, length, 0, None)
    tile, plan, splits = chosen.tile, chosen.plan, chosen.splits
    assert tile.per_sm == 2 and splits > 1
    o, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
    assert taken and all(chosen["MERGE_SPLITS"] for chosen in taken)
    _check_decode_rows(q, k_cache, v_cache, o, lse, lengths, torch.bfloat16)


@gpu
@pytest.mark.parametrize("b,hq,hkv,length,num_splits,tree", [(2, 32, 8, 65536, 16, False), (1, 32, 1, 8192, 0, True),
                                                             (1, 8, 1, 32768, 0, True), (1, 32, 2, 8000, 0, True)])
def test_split_decode_is_deterministic_gpu(b, hq, hkv, length, num_splits, tree, monkeypatch):
    """Twenty calls give the same bits: the splits finish in whatever order the GPU runs them, and the merge (one
    program's loop, or a tree of at-once loads whose groups and node order are fixed) must not depend on it."""
    real, taken = D._merge_at_once, []
    monkeypatch.setattr(D, "_STEPS", {})
    monkeypatch.setattr(D, "_merge_at_once", lambda *args: taken.append(real(*args)) or taken[-1])
    q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(b, length + 1000, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    first = onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, num_splits=num_splits,
                                              return_lse=True)
    assert taken and all(chosen["MERGE_TREE"] == tree for chosen in taken)
    for _ in range(20):
        again = onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, num_splits=num_splits,
                                                  return_lse=True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    if tree:
        _check_decode_rows(q, k_cache, v_cache, *first, [length], torch.bfloat16)


@gpu
def test_decode_memory_is_only_the_partials():
    b, length, hq, hkv, d, splits = 4, 65536, 32, 8, 128, 16
    k_cache = torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=splits, check_indices=False)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = splits * b * hq * (d + 1) * 4 + b * hq * (d * 2 + 4)  # float32 partials + o + lse
    assert extra < 2 * budget + 2**20, f"{extra} bytes beyond the inputs, budget {budget}"


def test_api_steps_are_keyed_by_the_checked_metadata(monkeypatch):
    """The public call hands the launcher the key its checks were memoised under (CacheDims.meta_key), so repeated
    steps share one launcher entry; a strided view of the lengths, made contiguous by the launcher, gives its own
    entry and the same result."""
    from onlineattn import _validate as V

    monkeypatch.setattr(D, "_STEPS", {})
    monkeypatch.setattr(V, "_CHECKED_KVCACHE", {})
    q, k, v = _sequence(3, 40, 4, 2, 16, 16, torch.float32, seed=31)
    lens = torch.tensor([40, 7, 23], dtype=torch.int32, device=DEVICE)
    call = lambda lengths: onlineattn.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths,  # noqa: E731
                                                             return_lse=True, backend="triton")
    first, again = call(lens), call(lens)
    (dims,) = V._CHECKED_KVCACHE.values()
    assert [key[0] for key in D._STEPS] == [dims.meta_key] and isinstance(dims.meta_key, V.MetaToken)
    strided = torch.stack([lens, lens], 1)[:, 0]
    assert strided.stride(0) == 2
    other = call(strided)
    assert len(D._STEPS) == 2
    for a, b_, c in zip(first, again, other):
        assert torch.equal(a, b_) and torch.equal(a, c)


@gpu
def test_kept_step_launches_directly_on_the_current_device_only(monkeypatch):
    """On CUDA a repeated decoding step relaunches its kept kernel through the C launcher (a direct Relaunch), asking
    CUDA's C call for the current device (not torch.cuda.current_device's Python); where that is another device than
    the one it was kept on, it declines, and a launch would go through Triton again."""
    monkeypatch.setattr(D, "_STEPS", {})
    q, k, v = _sequence(2, 300, 8, 2, 64, 64, torch.bfloat16, seed=32, device="cuda")
    lens = torch.tensor([300, 123], dtype=torch.int32, device="cuda")
    call = lambda: onlineattn.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=lens,  # noqa: E731
                                                     check_indices=False)
    first, again = call(), call()
    assert torch.equal(first, again)
    (step,) = D._STEPS.values()
    (chosen,) = step.lengths.values()
    relaunch = chosen.relaunch
    assert relaunch is not None and relaunch.direct is not None
    work, counts = chosen.workspaces[D._stream_id(q.device)] if chosen.splits > 1 else (again, lens)
    arrays = (q[:, :1].contiguous(), k, v, lens, lens, again, again, work, counts)
    here = torch.cuda.current_device()

    def no_python(*args):
        raise AssertionError("torch.cuda's lazy-init check was called")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_python)  # torch.cuda.current_device() calls it first
    assert relaunch.ready(arrays)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: here + 1)
    assert not relaunch.ready(arrays)
