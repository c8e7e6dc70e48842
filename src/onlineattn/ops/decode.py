"""Split-KV decoding (flash-decoding) in Triton: attention of a few query tokens over a long KV cache.

Read top-down: the kernel and its helpers, then the launcher (append the new tokens, choose the splits, launch).

Decoding reads every cached K/V byte once per step and does little arithmetic on it, so the kernel is built to keep
the memory system busy:

- GQA packing. A program owns one (sequence, kv head) and the query rows of its group: row ``r`` is query token
  ``r // GROUP`` of head ``kv_head · GROUP + r % GROUP`` (as in ``forward.py``), so K and V are read once for up
  to ``BLOCK_M`` rows. With many query tokens (chunked prefill) rows beyond ``BLOCK_M`` run as further programs (row
  blocks), as do wide groups on sparse grids (``_decode_configs.decode_block_m``: 16-row blocks reading the same keys).
- Split-KV. With few (sequence, kv head) pairs there are too few programs to fill the GPU, so the key range of each
  sequence is cut into ``num_splits`` chunks processed in parallel. Each writes a float32 partial state into a
  scratch buffer and counts itself in with an atomic; the last split of a program to arrive merges all of them, in
  a fixed order (deterministic whichever arrives last; a loop over the splits, or where the grid is at most one
  program per SM, two for the short-cache tile, one load of every partial, or past what one load holds a tree of
  such loads, each node merged by the last of its members to arrive), writes o and lse, and resets its counter(s)
  for the next launch.
  One launch, no second merge kernel. A sequence's chunks follow its own length (read on the device), so sequences
  of different lengths split evenly. With one split the kernel writes o and lse directly.
- Caches. Contiguous ``[B, L_max, Hkv, D]`` or paged ``[num_pages, page_size, Hkv, D]``: for a paged cache each key
  block gathers its page ids from the block table (``page_and_slot``), so a block may span pages and any page size
  that is a multiple of 16 works with any block size.

Causal masking is bottom-right over the ``cache_seqlens[b] + S_new`` visible keys: query i sees key j when
``j <= i + L_b − Sq``. Key blocks that every row of the program sees whole take the unmasked loop; the rest (the
diagonal and the end of the sequence) the masked one; blocks no row sees are never loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import cache
from ._common import (LOG2E, finalize_merge, finalize_state, key_range, merge_splits,
                      online_softmax_step, packed_rows, page_and_slot, row_tile)
from ._decode_configs import (DECODE_WIDE_ROWS, INTERPRETER_SMS, DecodeConfig, decode_block_m, decode_chunk,
                              decode_config, decode_splits, merge_at_once_splits, merge_tree_node)
from ._launch import bounded_put, cdiv, keep_by_address, next_power_of_2, prepare, sm_count
from .forward import KERNEL_DTYPES, MAX_GRID_Y, _last_dim_contiguous, check_int32_offsets, descriptor


@triton.jit
def _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, start_n, pos, m_n, o_d, o_dv, m_d, m_dv,
                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE: tl.constexpr,
                   USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """Keys at positions ``pos [BLOCK_N]`` (the block from ``start_n``) as ``kᵀ [BLOCK_D, BLOCK_N]`` and values
    ``[BLOCK_N, BLOCK_DV]``; values outside ``m_n`` read as zeros (the caller masks their scores).

    With ``USE_TMA`` K and V are tensor descriptors of a contiguous cache ``[B, L_max, Hkv, D]`` (boxes of one block
    of one head): the copy engine zero-fills past ``L_max`` only, so a masked block zeroes the values of the slots
    past the sequence (stale or never written: they may hold NaN, and 0 · NaN is NaN)."""
    if USE_TMA:
        block_n: tl.constexpr = pos.shape[0]
        b_k = K.load([off_b.to(tl.int32), start_n, off_hkv, 0])
        b_v = V.load([off_b.to(tl.int32), start_n, off_hkv, 0])
        b_kt = tl.trans(b_k.reshape(block_n, b_k.shape[3]))
        b_v = b_v.reshape(block_n, b_v.shape[3])
        if MASKED:
            b_v = tl.where(m_n[:, None], b_v, 0.0)
    else:
        page, slot = page_and_slot(BLOCK_TABLE, off_bt, off_b, pos, m_n, PAGE_SIZE)
        p_kt = K + (page * stride_kp + slot * stride_ks + off_hkv * stride_kh)[None, :] + o_d[:, None]
        p_v = V + (page * stride_vp + slot * stride_vs + off_hkv * stride_vh)[:, None] + o_dv[None, :]
        b_kt = tl.load(p_kt, mask=m_d[:, None] & m_n[None, :], other=0.0)
        b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    return b_kt, b_v


@triton.jit
def _store_state(O, LSE, b_o, b_lse, off_b, o_i, o_h, m_r, o_dv, m_dv, seqlen_q,
                 HEADS_Q: tl.constexpr, HEAD_DIM_V: tl.constexpr, STORE_LSE: tl.constexpr):
    """Rows of the contiguous outputs ``o [B, Sq, Hq, Dv]`` (q's dtype) and, with ``STORE_LSE``, ``lse [B, Hq, Sq]``."""
    p_o = O + ((off_b * seqlen_q + o_i[:, None]) * HEADS_Q + o_h[:, None]) * HEAD_DIM_V + o_dv[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    if STORE_LSE:
        tl.store(LSE + (off_b * HEADS_Q + o_h) * seqlen_q + o_i, b_lse, mask=m_r)


@triton.jit
def _merge_splits_at_once(P_O, P_LSE, first, row0, rows, num_splits, o_dv, m_dv, SPLITS: tl.constexpr,
                          ROWS: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """Merge the ``num_splits`` partial states of packed rows ``[row0, row0 + ROWS)`` (of ``rows``: one row block's)
    with one load of all of them (``[ROWS, SPLITS, BLOCK_DV]``, the splits padded to a power of two): one L2 round
    trip, where the loop of ``merge_splits`` takes one per pipeline depth. The same weights, ``exp(lse_s − max
    lse)``, summed over the splits in a fixed tree order (deterministic; a single non-empty split comes back bit for
    bit). Rows lead the load so that Triton spreads the warps over the rows and each thread sums its splits in
    registers; with the splits leading, one split a warp, the sum crossed the warps through shared memory (NOTES
    v37: 61 barriers and 254 registers for 32 rows, against 43 and 209)."""
    o_r = row0 + tl.arange(0, ROWS)[:, None]
    o_s = tl.arange(0, SPLITS)[None, :]
    part = (first + o_s) * rows + o_r  # [ROWS, SPLITS] partial rows, int64
    ok = (o_s < num_splits) & (o_r < rows)
    lse = tl.load(P_LSE + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    p_o = P_O + part[:, :, None] * HEAD_DIM_V + o_dv[None, None, :]
    o = tl.load(p_o, mask=ok[:, :, None] & m_dv[None, None, :], other=0.0, cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])  # 0 for an empty part (lse = -inf)
    acc = tl.sum(tl.where(w[:, :, None] > 0.0, w[:, :, None] * o, 0.0), axis=1)
    return finalize_merge(m, tl.sum(w, axis=1), acc)


@triton.jit
def _merge_tree(WORK, COUNTS, O, LSE, off_b, off_hkv, pid_bh, grid_bh, pid_m, row0, split, num_splits, seqlen_q, rows,
                o_dv, m_dv, GROUP: tl.constexpr, HEADS_Q: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                SPLITS: tl.constexpr, ROWS: tl.constexpr, STORE_LSE: tl.constexpr):
    """Split ``split`` of row block ``pid_m`` (packed rows ``[row0, row0 + ROWS)``) has stored its partial state:
    merge the program's ``num_splits`` partials as a tree of ``SPLITS`` (≥ 2) partials a node, each node one load of
    all its members (``_merge_splits_at_once``). The last of a group to arrive merges the group and stores the result
    as a partial of the next level (or, at the root, as o and lse), then counts itself in there. So the merge after
    the last split is ⌈log_SPLITS(num_splits)⌉ loads and atomics, where one program looping over the splits takes
    one L2 round trip per split and pipeline depth.

    Level ``l`` holds ``n_l`` partials a program (``n_0 = num_splits``, ``n_{l+1} = ⌈n_l / SPLITS⌉``) as o
    ``[grid_bh, n_l, rows, Dv]`` then lse ``[grid_bh, n_l, rows]``, level after level in WORK, each row block
    writing and reading its own rows; the program's group counters follow each other in ``COUNTS[(pid_bh · row
    blocks + pid_m) · 2 · num_splits:]`` (fewer than 2 · num_splits in all). Groups and the order within a node are
    fixed, so the result does not depend on the arrival order (a single non-empty split comes back bit for bit)."""
    tl.static_assert(SPLITS >= 2, "a merge-tree node of one partial never reaches the root")
    o_r = row0 + tl.arange(0, ROWS)
    w_i, w_h, w_r = packed_rows(row0, off_hkv, seqlen_q, ROWS, GROUP)
    level = WORK
    counts = COUNTS + (pid_bh.to(tl.int64) * tl.num_programs(1) + pid_m) * 2 * num_splits
    node = split
    n = num_splits
    go = split >= 0
    while go:
        group = node // SPLITS
        members = tl.minimum(n - group * SPLITS, SPLITS)
        # The barrier puts every thread's stores of this level's partial before the counter's release; the acquire
        # side orders the merge's loads after the other members' stores.
        tl.debug_barrier()
        go = tl.atomic_add(counts + group, 1, sem="acq_rel", scope="gpu") == members - 1
        if go:
            tl.store(counts + group, 0)  # ready for the next launch that uses this workspace
            lse_level = level + grid_bh.to(tl.int64) * n * rows * HEAD_DIM_V
            w_o, w_lse = _merge_splits_at_once(level, lse_level, pid_bh.to(tl.int64) * n + group * SPLITS, row0,
                                               rows, members, o_dv, m_dv, SPLITS, ROWS, HEAD_DIM_V)
            if n <= SPLITS:  # the root
                _store_state(O, LSE, w_o, w_lse, off_b, w_i, w_h, w_r, o_dv, m_dv, seqlen_q, HEADS_Q, HEAD_DIM_V,
                             STORE_LSE)
                go = False
            else:
                level += grid_bh.to(tl.int64) * n * rows * (HEAD_DIM_V + 1)
                counts += tl.cdiv(n, SPLITS)
                n = tl.cdiv(n, SPLITS)
                node = group
                part = (pid_bh.to(tl.int64) * n + node) * rows + o_r
                tl.store(level + part[:, None] * HEAD_DIM_V + o_dv[None, :], w_o, mask=w_r[:, None] & m_dv[None, :])
                tl.store(level + grid_bh.to(tl.int64) * n * rows * HEAD_DIM_V + part, w_lse, mask=w_r)


@triton.jit
def decode_kernel(
    Q, K, V, CACHE_SEQLENS, BLOCK_TABLE, O, LSE, WORK, COUNTS,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb,
    seqlen_q, seqlen_new, num_splits, qk_scale,
    HEADS_KV: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, MERGE_STAGES: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    MERGE_ROWS: tl.constexpr, MERGE_TREE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    off_b = (pid_bh // HEADS_KV).to(tl.int64)
    off_hkv = pid_bh % HEADS_KV
    off_bt = off_b * stride_btb
    seqlen_k = tl.load(CACHE_SEQLENS + off_b) + seqlen_new

    o_i, o_h, m_r, o_d, o_dv, o_n, m_d, m_dv = row_tile(pid_m * BLOCK_M, off_hkv, seqlen_q, BLOCK_M, GROUP, BLOCK_N,
                                                        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)

    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)

    # Keys some row sees: [0, hi); keys every row sees: [0, full_hi). Query i sees key j when j <= i + diag.
    full_hi, hi = key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, GROUP, CAUSAL)
    diag = seqlen_k - seqlen_q
    # This split's chunk: a whole number of blocks, sized from this sequence's length, so blocks never straddle
    # two splits and the splits of a short sequence are as even as those of a long one.
    chunk = tl.cdiv(tl.cdiv(seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(hi, lo + chunk)
    full_hi = lo + (tl.maximum(tl.minimum(full_hi, hi) - lo, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for start_n in tl.range(lo, full_hi, BLOCK_N):
        pos = start_n + o_n
        b_kt, b_v = _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, start_n, pos, pos < seqlen_k, o_d, o_dv,
                                   m_d, m_dv, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                   PAGE_SIZE, USE_TMA, False)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=False)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    for start_n in range(full_hi, hi, BLOCK_N):
        pos = start_n + o_n
        m_n = pos < seqlen_k
        b_kt, b_v = _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, start_n, pos, m_n, o_d, o_dv, m_d, m_dv,
                                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE,
                                   USE_TMA, True)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        visible = m_n[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= o_i[:, None] + diag)
        qk = tl.where(visible, qk, float("-inf"))
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=True)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    b_o, b_lse = finalize_state(m_i, l_i, acc)
    if SPLIT:
        # Every split stores its partial state, even an empty chunk (o = 0, lse = -inf): the merge reads them all.
        # WORK holds o partials [B·Hkv, S, R, Dv] then lse partials [B·Hkv, S, R], R = Sq·GROUP packed rows (a
        # merge tree's upper levels follow, _merge_tree).
        rows = seqlen_q * GROUP
        o_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        first = pid_bh.to(tl.int64) * num_splits
        p_o = WORK + ((first * rows + o_r) * HEAD_DIM_V)[:, None] + o_dv[None, :]
        lse_parts = WORK + tl.num_programs(0).to(tl.int64) * num_splits * rows * HEAD_DIM_V
        p_lse = lse_parts + first * rows + o_r
        tl.store(p_o + split * rows * HEAD_DIM_V, b_o, mask=m_r[:, None] & m_dv[None, :])
        tl.store(p_lse + split * rows, b_lse, mask=m_r)
        # A row block's merge covers its own rows, MERGE_ROWS of them: BLOCK_M, or fewer where one block holds all
        # (row 0 on, known when compiling: a runtime offset there read 7.7 -> 8.6 us at Hq 32 / Hkv 8, B = 1, 4k).
        if MERGE_ROWS == BLOCK_M:
            merge_row0 = pid_m * MERGE_ROWS
        else:
            merge_row0 = 0
        if MERGE_TREE:  # more partials than one load holds: a tree of at-once merges
            _merge_tree(WORK, COUNTS, O, LSE, off_b, off_hkv, pid_bh, tl.num_programs(0), pid_m, merge_row0, split,
                        num_splits, seqlen_q, rows, o_dv, m_dv, GROUP, HEADS_KV * GROUP, HEAD_DIM_V, MERGE_SPLITS,
                        MERGE_ROWS, STORE_LSE)
        else:
            # The last of the program's splits to finish merges them all. The barrier puts every thread's stores
            # before the counter's release; the acquire side orders the merge's loads after the other splits'.
            tl.debug_barrier()
            p_count = COUNTS + pid_bh * tl.num_programs(1) + pid_m
            if tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(p_count, 0)  # ready for the next launch that uses this workspace
                # New names for the merged rows: the at-once merge's tile has MERGE_ROWS rows, not BLOCK_M.
                if MERGE_SPLITS > 0:  # one load of every partial of the row block's rows
                    w_o, w_lse = _merge_splits_at_once(WORK, lse_parts, first, merge_row0, rows, num_splits, o_dv,
                                                       m_dv, MERGE_SPLITS, MERGE_ROWS, HEAD_DIM_V)
                    w_i, w_h, w_r = packed_rows(merge_row0, off_hkv, seqlen_q, MERGE_ROWS, GROUP)
                else:
                    w_o, w_lse = merge_splits(p_o, p_lse, rows * HEAD_DIM_V, rows, num_splits, m_r, m_dv, BLOCK_M,
                                              BLOCK_DV, MERGE_STAGES)
                    w_i, w_h, w_r = o_i, o_h, m_r
                _store_state(O, LSE, w_o, w_lse, off_b, w_i, w_h, w_r, o_dv, m_dv, seqlen_q, HEADS_KV * GROUP,
                             HEAD_DIM_V, STORE_LSE)
    else:
        _store_state(O, LSE, b_o, b_lse, off_b, o_i, o_h, m_r, o_dv, m_dv, seqlen_q, HEADS_KV * GROUP, HEAD_DIM_V,
                     STORE_LSE)


# ---------------------------------------------------------------------------------------------------------------
# Launcher. A decode loop calls it with the same shapes every step, so everything that depends only on shapes and
# strides is computed once (``_plan``) and the split scratch is allocated once per size (``_workspace``).


@functools.lru_cache(maxsize=None)  # per device (a tensor's has its index): the eager step's one lookup
def _sm_count(device: torch.device) -> int:
    return sm_count(device, INTERPRETER_SMS)


# The merge loop's pipelining (NOTES v9: B = 1, L = 4k 17.9 -> 17.3 us cold at d = 128, one query token: 16 rows x
# 128 float32 per stage). Its stages sit in shared memory for the whole kernel, so wider partials (d = 256, or 64
# packed rows: up to ~100 KiB more, halving the programs per SM) keep the plain loop, unmeasured either way.
MERGE_STAGES = 4
MERGE_PIPELINE_MAX_ELEMENTS = 16 * 128
# Where every split's partials of a program's packed rows (its row block's) fit in registers at once
# (_decode_configs.merge_at_once_splits) and the grid has at most the tile's programs per SM, the merging split loads
# them in one go (_merge_splits_at_once) instead of looping over the splits. NOTES v19 (graph-timed, d = 128, Hq 32,
# Hkv 8): B = 1, L = 4k 11.2 -> 10.0 us, L = 32k 40.1 -> 38.5 us; over fuller grids it tied or lost (B = 16, L = 32k:
# 2 splits 548 -> 561 us, 8 splits 490 -> 513 us), so those keep the loop (_merge_at_once). The short-cache tile
# (_decode_configs._DECODE_SHORT) fills two programs per SM and merges at once over them. Past one load the merge runs
# as a tree of such loads (_merge_tree) where a program holds few rows (_decode_configs.merge_tree_node, NOTES v37).


@dataclass(frozen=True, eq=False)
class _Plan:
    grid_bh: int  # programs along axis 0: B · Hkv
    row_blocks: int  # programs along axis 1: packed rows Sq · GROUP in blocks of block_m
    rows: int  # packed rows Sq · GROUP
    capacity: int  # most keys one sequence can hold
    strides: tuple  # q, k_cache, v_cache and block-table strides, in the kernel's order
    constexprs: dict

    @property
    def block_rows(self) -> int:
        """Packed rows a program (row block) holds: its merge's rows."""
        return min(self.rows, self.constexprs["BLOCK_M"])


def _make_plan(q, k_cache, v_cache, block_table, cfg: DecodeConfig, causal: bool) -> _Plan:
    b, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    group = hq // hkv
    paged = block_table is not None
    block_m = min(cfg.block_m, max(16, next_power_of_2(sq * group)))
    block_dv = max(16, next_power_of_2(dv))
    row_blocks = cdiv(sq * group, block_m)
    if row_blocks > MAX_GRID_Y:
        raise ValueError(f"{sq} query tokens x {group} heads per kv head need {row_blocks} row blocks, beyond the "
                         f"decode kernel's limit of {MAX_GRID_Y}; use onlineattn.attention for long prefills")
    check_int32_offsets(q=q)
    if not paged:  # a contiguous cache is indexed in int32 within a batch entry (pages are indexed in int64)
        check_int32_offsets(k_cache=k_cache, v_cache=v_cache)
    strides = (*q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0) if paged else 0)
    constexprs = dict(
        HEADS_KV=hkv, GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv,
        BLOCK_D=max(16, next_power_of_2(d)), BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, PAGE_SIZE=k_cache.shape[1] if paged else 0, CAUSAL=causal,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE_STAGES=MERGE_STAGES if block_m * block_dv <= MERGE_PIPELINE_MAX_ELEMENTS else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    return _Plan(b * hkv, row_blocks, sq * group, capacity, strides, constexprs)


_WORKSPACES: dict = {}


def _stream_id(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def _workspace(device: torch.device, floats: int, counters: int):
    """Scratch for split partials (float32, at least ``floats``) and arrival counters (int32, at least ``counters``,
    zero between launches: each merging program resets the counter it read, at every level of a merge tree).

    One pair per (device, stream, power-of-two size class), never freed: launches on one stream run in order, so
    they can share it, and a CUDA graph that captured a launch keeps pointing at memory that stays allocated.
    Launches on different streams get different scratch.
    """
    floats, counters = 1 << (floats - 1).bit_length(), 1 << (counters - 1).bit_length()
    key = (device, _stream_id(device), floats, counters)
    scratch = _WORKSPACES.get(key)
    if scratch is None:
        scratch = _WORKSPACES[key] = (torch.empty(floats, dtype=torch.float32, device=device),
                                      torch.zeros(counters, dtype=torch.int32, device=device))
    return scratch


def _checked_out(x: torch.Tensor, name: str, shape: tuple, dtype) -> torch.Tensor:
    if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape}, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    return x


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale: float, causal: bool,
                           num_splits: int, *, max_seqlen_k=None, return_lse=True, out=None, lse_out=None,
                           config=None, meta_key=None):
    """Append ``k``/``v`` (if given) into the caches, then attend in one launch: ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq]
    float32)``, lse None when ``return_lse`` is False (it is then never written).

    ``q [B, Sq, Hq, D]``; caches ``[B, L_max, Hkv, D]`` or ``[num_pages, page_size, Hkv, D]`` with ``block_table
    [B, max_pages]`` int32; ``cache_seqlens`` int32 ``[B]``, on the device (validated by the caller, values included).
    ``num_splits = 0`` chooses with ``decode_splits`` from the grid, ``max_seqlen_k`` (if known, else the cache's
    capacity) and the SM count. ``out``/``lse_out`` (contiguous) let tests pass pre-poisoned buffers; ``config``
    overrides the table. ``meta_key`` (the API's ``CacheDims.meta_key``, a token for the shapes, strides, dtypes and
    devices of every argument) stands for the metadata part of this call's memo key, which is then not rebuilt.
    """
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    if not scale > 0:
        raise ValueError(f"scale: the kernels take scale > 0 (the API passes -q or q · 0 for others), got {scale}")
    # The kernels index the lengths and each block-table row as contiguous: strided views (a column of a larger
    # table, every other length) are copied, both tiny.
    if cache_seqlens.dim() == 1 and cache_seqlens.shape[0] > 1 and cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    if block_table is not None and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if k is not None:
        cache.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    if q.stride(-1) != 1:
        q = q.contiguous()
    b, sq, hq, _ = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    device = q.device
    # One query token sees every key under the bottom-right diagonal, so causal masks nothing. Over more (sequence,
    # kv head) pairs than SMs the plain build streamed faster (NOTES v36, graph-timed, Hq 32 / Hkv 8: B = 64, L = 4k
    # 307 -> 244 us, where the causal build's 137 registers a thread against 128 leave 3 programs per SM, not 4: two
    # waves; B = 32, L = 8k and B = 64, L = 32k tied); over fewer the causal build was 0-9 % faster (B = 2, L = 2k 9.4
    # against 10.3 us; cause not found), so there it stays.
    if causal and sq == 1 and b * hkv > _sm_count(device):
        causal = False
    o_shape, lse_shape = (b, sq, hq, dv), (b, hq, sq)
    o = q.new_empty(o_shape) if out is None else _checked_out(out, "out", o_shape, q.dtype)
    if lse_out is not None:
        lse = _checked_out(lse_out, "lse_out", lse_shape, torch.float32)
    else:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device) if return_lse else None
    if b * sq * hq == 0:
        return o, lse

    longest = max_seqlen_k
    if longest is None:  # the capacity bounds every length without reading them
        longest = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    # A step seen before (same metadata) reuses its choices. The longest length grows by one per decoding step, so it
    # keys a second, per-step table: the tile and split count it gives (a _Splits, with its scratch and Relaunch).
    if meta_key is None:
        meta_key = (q.shape, q.stride(), q.dtype, device, k_cache.shape, k_cache.stride(), k_cache.dtype,
                    v_cache.shape, v_cache.stride(), v_cache.dtype, cache_seqlens.dtype,
                    None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype), new)
    key = (meta_key, causal, scale, lse is not None, num_splits, config)
    step = _STEPS.get(key)
    if step is None:
        step = bounded_put(_STEPS, key, _Step(), _MAX_STEPS)
    splits_at = step.lengths.get(longest)
    if splits_at is None:
        splits_at = bounded_put(step.lengths, longest, _choose(step, q, k_cache, v_cache, block_table, causal, longest,
                                                               num_splits, config), _MAX_LENGTHS)
    if splits_at.splits > 1:
        stream = _stream_id(device)
        scratch = splits_at.workspaces.get(stream)
        if scratch is None:
            scratch = splits_at.workspaces[stream] = _workspace(device, *splits_at.scratch)
        work, counts = scratch
    else:
        work, counts = o, cache_seqlens  # unused: stand-ins of the right kind
    k_arg, v_arg = _kv_args(splits_at, k_cache, v_cache)
    tensors = (q, k_arg, v_arg, cache_seqlens, cache_seqlens if block_table is None else block_table,
               o, o if lse is None else lse, work, counts)
    relaunch = splits_at.relaunch
    if relaunch is None or not relaunch(splits_at.grid, tensors):
        splits_at.relaunch = prepare(
            decode_kernel, splits_at.grid, len(tensors), *tensors, *splits_at.plan.strides,
            sq, new, splits_at.splits, scale * LOG2E,
            SPLIT=splits_at.splits > 1, STORE_LSE=lse is not None, USE_TMA=k_arg is not k_cache, **splits_at.merge,
            **splits_at.plan.constexprs,
        )
    return o, lse


def _kv_args(chosen: "_Splits", k_cache, v_cache) -> tuple:
    """K and V as the kernel takes them: where ``chosen`` streams them by TMA (``_Splits.tma``) and both bases are
    16-byte aligned, tensor descriptors (boxes of one key block of one head), on CUDA kept for the last pair of
    caches by address, so a decode loop over the same caches builds none (the interpreter reads a descriptor's
    tensor, so there they are built per call); otherwise the caches themselves (pointer loads)."""
    if not chosen.tma:
        return k_cache, v_cache
    ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
    kept = chosen.descriptors
    if kept is not None and kept[0] == ptrs:
        return kept[1], kept[2]
    if ptrs[0] % 16 or ptrs[1] % 16:  # the strides were checked when choosing
        return k_cache, v_cache
    c = chosen.plan.constexprs
    k_desc = descriptor(k_cache, c["BLOCK_N"], 1, c["BLOCK_D"])
    v_desc = descriptor(v_cache, c["BLOCK_N"], 1, c["BLOCK_DV"])
    if k_cache.is_cuda:
        chosen.descriptors = (ptrs, keep_by_address(k_desc, ptrs[0]), keep_by_address(v_desc, ptrs[1]))
    return k_desc, v_desc


def _merge_at_once(plan: _Plan, splits: int, slots: int) -> dict:
    """The kernel's MERGE_SPLITS, MERGE_ROWS and MERGE_TREE: partials a load and the packed rows, padded to powers of
    two, where the merging split loads every partial at once (``merge_at_once_splits``), or, past what one load
    holds, where the merge runs as a tree of such loads (``_merge_tree``, nodes of ``merge_tree_node``; MERGE_TREE:
    the tree's own code, which read 0.3-0.7 us slower than the one load where one node would do, NOTES v37);
    elsewhere 0, 0 and False (the pipelined loop of one merging split; one build serves every row count). Each row
    block merges its own rows (``_Plan.block_rows``; several row blocks only as the wide groups' 16-row blocks, NOTES
    v39). Only where the grid has at most ``slots`` programs (SMs times the tile's programs per SM): there the
    merge after the last split is the launch's critical path. Over fuller grids the loop stays (NOTES v19: at B =
    16, L = 32k with 8 splits the merge at once read 511-518 us against the loop's 490)."""
    padded, width, rows = next_power_of_2(splits), plan.constexprs["BLOCK_DV"], plan.block_rows
    node = padded if padded <= merge_at_once_splits(rows, width) else merge_tree_node(rows, width)
    fits = plan.grid_bh * plan.row_blocks * splits <= slots
    blocks = plan.row_blocks == 1 or rows <= DECODE_WIDE_ROWS  # several blocks of 64 rows keep the loop (untimed)
    if not (splits > 1 and fits and node and blocks):
        return {"MERGE_SPLITS": 0, "MERGE_ROWS": 0, "MERGE_TREE": False}
    return {"MERGE_SPLITS": node, "MERGE_ROWS": next_power_of_2(rows), "MERGE_TREE": node < padded}


def _scratch(plan: _Plan, splits: int, node: int) -> tuple[int, int]:
    """Split scratch a launch needs, ``(float32 values, int32 counters)``: every split's partial (o and lse of the
    packed rows), and for a merge tree of ``node`` partials a node (``_merge_tree``) its upper levels' partials and
    up to ``2 · splits`` counters a program (row block); otherwise (``node`` 0) one counter a program."""
    if node == 1:
        raise ValueError("a merge-tree node of one partial never reaches the root")
    partials = splits
    if node:
        n = splits
        while n > node:
            n = cdiv(n, node)
            partials += n
    counters = plan.grid_bh * plan.row_blocks * (2 * splits if node else 1)
    return plan.grid_bh * partials * plan.rows * (plan.constexprs["HEAD_DIM_V"] + 1), counters


class _Step:
    """What decode calls of one metadata have chosen: per longest length the ``_Splits`` that ``_choose`` gave (one
    per (tile, split count, TMA or not), shared by the lengths that chose it) and per tile its plan."""

    __slots__ = ("lengths", "plans", "splits")

    def __init__(self):
        self.lengths, self.plans, self.splits = {}, {}, {}


class _Splits:
    """One (tile, split count, TMA or not) of a step: its plan, grid, merge constexprs and scratch sizes, per stream
    the scratch it launches with, the ``Relaunch`` that repeats its launch with the next step's tensors, and the
    caches' kept descriptors. Held by the lengths that chose it, so a repeated step reads them without hashing a
    key."""

    __slots__ = ("tile", "plan", "splits", "grid", "merge", "scratch", "tma", "workspaces", "relaunch", "descriptors")

    def __init__(self, tile: DecodeConfig, plan: _Plan, splits: int, merge: dict, scratch: tuple[int, int],
                 tma: bool):
        self.tile, self.plan, self.splits, self.merge, self.scratch = tile, plan, splits, merge, scratch
        self.grid = (plan.grid_bh, plan.row_blocks, splits)
        self.tma = tma  # K and V by TMA where the caches' bases allow (_kv_args)
        self.workspaces, self.relaunch, self.descriptors = {}, None, None


_STEPS: dict = {}
_MAX_STEPS = 256  # metadata a process decodes with are few; past this the table starts over
_MAX_LENGTHS = 4096  # per metadata; past this (a very long generation) the table starts over


def _choose(step: _Step, q, k_cache, v_cache, block_table, causal: bool, longest: int, num_splits: int,
            config) -> _Splits:
    """The tile and split count (with its plan, merge constexprs and scratch sizes) for keys up to ``longest``."""
    b, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    sms = _sm_count(q.device)
    if config is None:  # programs per split: (sequence, kv head) pairs times row blocks (of 64 rows in the tables,
        paged = block_table is not None  # or 16 for wide groups with automatic splits)
        block_m = decode_block_m(sq, hq // hkv, b * hkv, sms, max(d, dv), q.dtype, q.device.type, paged, num_splits)
        programs = b * hkv * cdiv(sq * (hq // hkv), block_m)
        config = decode_config(d, dv, q.dtype, q.device.type, batch_heads=programs, max_seqlen_k=longest,
                               num_sms=sms, num_splits=num_splits, paged=paged, rows=b * sq * hq)
        config = config if block_m == 64 else replace(config, block_m=block_m)  # the wide groups' row blocks
    plan = step.plans.get(config)
    if plan is None:
        plan = step.plans[config] = _make_plan(q, k_cache, v_cache, block_table, config, causal)
    splits = num_splits or decode_splits(config, plan.grid_bh * plan.row_blocks, longest, sms, plan.block_rows,
                                         plan.constexprs["BLOCK_DV"])
    splits = max(1, min(splits, cdiv(longest, config.block_n)))  # more would only add empty chunks
    tma = _tma(config, plan, k_cache, v_cache, block_table, longest, splits)  # per length: its chunks decide
    chosen = step.splits.get((config, splits, tma))
    if chosen is None:
        merge = _merge_at_once(plan, splits, sms * config.per_sm)
        scratch = _scratch(plan, splits, merge["MERGE_SPLITS"] if merge["MERGE_TREE"] else 0)
        chosen = step.splits[config, splits, tma] = _Splits(config, plan, splits, merge, scratch, tma)
    return chosen


def _tma(tile: DecodeConfig, plan: _Plan, k_cache, v_cache, block_table, longest: int, splits: int) -> bool:
    """Whether ``tile`` streams K and V by TMA for keys up to ``longest`` in ``splits`` splits: chunks of at most
    ``tile.tma_max_keys`` keys, or chunks of any length where each head's keys lie next to each other (head-major
    memory, ``[B, Hkv, L, D]`` viewed as ``[B, L, Hkv, D]``, or one kv head), of a contiguous cache that the copy
    engine reads (a device with TMA, or the interpreter; outer strides positive 16-byte multiples: an expanded
    cache's zero strides keep pointers; the bases are checked per call, ``_kv_args``). A cache of no slot at all
    keeps pointers (a descriptor has no zero-sized dim)."""
    if block_table is not None or plan.capacity == 0 or not tile.tma_max_keys:
        return False
    chunk = decode_chunk(longest, splits, tile.block_n)
    # _common.tma_aligned's stride rule, and no zero stride; not shared: tma_aligned's loop runs on every forward
    # call, where a helper call per tensor measured ~0.3 µs more (CPU, timeit), and this runs once per length
    strides_ok = all(0 < st * x.element_size() and st * x.element_size() % 16 == 0
                     for x in (k_cache, v_cache) for st in x.stride()[:-1])
    head_major = all(x.stride(1) == x.shape[3] for x in (k_cache, v_cache))
    return (chunk <= tile.tma_max_keys or head_major) and strides_ok and _has_tma(k_cache.device)


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """The copy engine's tensor maps: sm_90 and later (off CUDA: the interpreter, which emulates them)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
