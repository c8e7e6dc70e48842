"""Fused attention backward in Triton (FlashAttention-2's): dQ, dK, dV from q, k, v, o, lse and dO.

Read top-down: three kernels (and a fused dQ's scaling pass), then the launcher.

1. ``attention_bwd_preprocess_kernel``: ``delta = rowsum(dO ∘ O)`` in float32 (minus the gradient flowing into lse,
   which enters dS the same way: ``dS = P ∘ (dP − delta + dlse)``). Only where no dQ kernel runs (``fused_dq``); it
   also zeroes what the fused dQ needs zeroed (``_dq_accumulator``), so no memset is launched for it (one still is
   for the ordered tile's rows no key block sees: causal, Sq > Sk by a row tile or more).
2. ``attention_bwd_dkdv_kernel``: a program owns ``BLOCK_N`` keys of one (batch, kv head) and loops over the query
   rows of every head in its GQA group, recomputing ``P`` from lse. The group's sum lands in registers, so dK and dV
   need no atomics and no per-head copies.
3. ``attention_bwd_dq_kernel``: a program owns ``BLOCK_M`` packed query rows, as in the forward, computes their
   delta as the preprocess kernel would (and stores it) and loops over keys. It runs first, so the dK/dV kernel,
   after it, reads that delta: one pass over O and dO fewer.
4. ``attention_bwd_dq_scale_kernel``: where sm_90's dK/dV kernel sums dQ itself (``fused_dq``, below), dQ is its
   float32 sum times the scale, in dQ's dtype, each row tile's values put back from the order the kernel adds them
   in (its warpgroups' registers).

These kernels use no atomics, so their results are bitwise reproducible. (On sm_90 a call may instead take the Gluon
dK/dV kernel with dQ fused into it, ``fused_dq``: its dQ tiles are added into a float32 accumulator by TMA
reduce-adds, in no fixed order where ``deterministic=False``, or in a fixed one, ``dq_ordered``, which keeps dQ
bitwise reproducible; ``bwd_config`` says where.) Rows use the forward's packing: row ``r`` is
query ``r // GROUP`` of head ``kv_head · GROUP + r % GROUP``. Scores are in the log2 domain (``qk_scale`` holds
``scale · log2 e`` and lse is converted once on load); a row with ``lse = -inf`` saw no key and gets ``P = 0``.

With ``USE_TMA`` the streamed operands come through the copy engine: Q and dO in the dK/dV kernel (boxes of
``BLOCK_M / GROUP`` queries × ``GROUP`` heads, which are the packed rows in order), K and V in the dQ kernel.

``SPLIT_SCORES`` (dK/dV kernel) computes a tile's ``Pᵀ`` and ``dSᵀ`` inside a branch that is always taken
(``seqlen_k > 0``: no launch has empty keys). Triton gives a dot whose result reaches another dot all warps along M
(``warpsPerTileV3``'s chained-dot rule), so with 8 warps and a 64-key tile both warpgroups computed the whole of
``Sᵀ`` and ``dPᵀ``, each twice (sm_90 SASS: 72 HGMMA per loop instead of 40). The branch ends that forward slice at
its yield, the score dots take the plain rule (warpgroups split the columns) and P crosses warpgroups through shared
memory for the dV and dK dots. This is what lets d = 256 hold 64 keys with 8 warps (benchmarks/NOTES.md, v8).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._mods import PLAIN, Mods
from ..torch_impl import BWD_SCHEMA, fake_backward, op_outputs, refuse_double_backward
from . import bias_grad as bias_grad_kernel
from . import _launch as launch_cache

try:  # Gluon's Hopper API as triton 3.6 has it; without it the Triton dK/dV kernel runs
    from . import backward_sm90, backward_sm90_dq
except ImportError:  # pragma: no cover - other Triton versions
    backward_sm90 = backward_sm90_dq = None
from ._common import (
    LOG2E, band_key_range, band_row_range, bwd_probs, key_range, packed_rows, row_tile, sequence_bounds,
    tile_order, tma_aligned,
)
from ._configs import BWD_WS_WINDOW_MIN_SPAN, bwd_config, bwd_head_group
from ._launch import bounded_put, cdiv, next_power_of_2, start
from .forward import (
    KERNEL_DTYPES, _last_dim_contiguous, _window_span, batch_slices, check_int32_offsets, descriptor, variant_args,
)
from .forward import ws_ok as _forward_ws_ok
from .sink_grad import sink_grad

PREPROCESS_ROWS = 64  # rows per program of the delta pass: it streams O and dO once, any tile saturates bandwidth


@triton.jit
def attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, ZERO,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    seqlen_q, heads_q, zero_rows,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
    ZERO_ROWS: tl.constexpr, ZERO_TILE: tl.constexpr,
):
    """Delta of ``BLOCK_M`` rows of one (batch, head); and, for a fused dQ, zeroes in ``ZERO``: with ``ZERO_ROWS``
    these rows of the float32 accumulator (``[B, zero_rows, Hq, Dv]``, padding rows past Sq too: the kernel lays
    each row tile's values out in its own order, ``backward_sm90_dq._dq_coord``; the grid covers ``zero_rows``),
    with ``ZERO_TILE`` the int32 counter of each ``ZERO_TILE``-row tile that starts among these rows
    (``[B, Hq, zero_rows]``: zero_rows tiles), else nothing."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = pid_bh % heads_q
    o_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_i = o_i < seqlen_q
    m_o = m_i[:, None] & (o_dv < HEAD_DIM_V)[None, :]
    b_do = tl.load(DO + off_b * stride_dob + o_i[:, None] * stride_dos + off_h * stride_doh + o_dv[None, :], mask=m_o,
                   other=0.0)
    p_o = O + off_b * stride_ob + o_i[:, None] * stride_os + off_h * stride_oh + o_dv[None, :]
    _store_delta(p_o, b_do, m_o, DELTA, DLSE, off_b, off_h, o_i, m_i, stride_lb, stride_lh, HAS_DLSE)
    if ZERO_ROWS:
        p_z = ZERO + ((off_b * zero_rows + o_i[:, None]) * heads_q + off_h) * HEAD_DIM_V + o_dv[None, :]
        m_z = (o_i < zero_rows)[:, None] & (o_dv < HEAD_DIM_V)[None, :]
        tl.store(p_z, tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32), mask=m_z)
    if ZERO_TILE > 0:
        tl.static_assert(ZERO_TILE % BLOCK_M == 0, "a counted tile spans whole programs")
        if (pid_m * BLOCK_M) % ZERO_TILE == 0:
            tl.store(ZERO + pid_bh.to(tl.int64) * zero_rows + pid_m * BLOCK_M // ZERO_TILE, 0)


@triton.jit
def _store_delta(p_o, b_do, m_o, DELTA, DLSE, off_b, o_h, o_i, m_r, stride_lb, stride_lh, HAS_DLSE: tl.constexpr):
    """Rows' ``delta = rowsum(dO ∘ O) − dlse`` in float32 from loaded ``b_do`` and O's pointers ``p_o`` (mask
    ``m_o``), stored where ``m_r`` (DELTA and DLSE share lse's ``[B, Hq, Sq]`` layout: batch ``off_b``, heads
    ``o_h``, rows ``o_i``). Returns (delta, the rows' offsets in that layout)."""
    b_delta = tl.sum(tl.load(p_o, mask=m_o, other=0.0).to(tl.float32) * b_do.to(tl.float32), 1)
    p_stats = off_b * stride_lb + o_h * stride_lh + o_i
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + p_stats, mask=m_r, other=0.0).to(tl.float32)
    tl.store(DELTA + p_stats, b_delta, mask=m_r)
    return b_delta, p_stats


@triton.jit
def _row_stats(LSE, DELTA, off_b, o_h, o_i, m_r, stride_lb, stride_lh):
    """lse in the log2 domain (+inf where the row saw nothing, so that P = 2^(s - inf) = 0) and delta, per row."""
    p = off_b * stride_lb + o_h * stride_lh + o_i
    return _row_lse2(LSE, p, m_r), tl.load(DELTA + p, mask=m_r, other=0.0)


@triton.jit
def _row_lse2(LSE, p, m_r):
    lse = tl.load(LSE + p, mask=m_r, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_kv, qk_scale, sm_scale,
    # Score variants, as in the forward kernel (None or 0 unless their flag is set).
    CU_Q, CU_K, SLOPES, BIAS, SINKS, RNG,
    stride_sb, stride_bb, stride_bh, stride_bi, stride_bj,
    window_left, window_right, softcap_in, softcap_out, dropout_p, batch0, head_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_SCORES: tl.constexpr,
    VARLEN: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, SINK: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
):
    pid_n, pid_bh = tile_order(head_group)  # key block 0 (under causal masking the most rows) first
    pid_n = tl.num_programs(0) - 1 - pid_n
    pid_b = pid_bh // heads_kv  # int32 coordinate for tensor descriptors
    off_b = pid_b.to(tl.int64)
    off_hkv = pid_bh % heads_kv
    if VARLEN:  # packed sequences (batch strides 0): move each pointer to this sequence
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, VARLEN)
        if pid_n * BLOCK_N >= seqlen_k:
            return
        Q += q_start.to(tl.int64) * stride_qs
        DO += q_start.to(tl.int64) * stride_dos
        LSE += q_start
        DELTA += q_start
        K += k_start.to(tl.int64) * stride_ks
        V += k_start.to(tl.int64) * stride_vs
        DK += k_start.to(tl.int64) * stride_dks
        DV += k_start.to(tl.int64) * stride_dvs
    vargs = (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_kv * GROUP,
             window_left, window_right, softcap_in, softcap_out, dropout_p, batch0)
    start_n = pid_n * BLOCK_N
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_n = o_n < seqlen_k
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    p_k = K + off_b * stride_kb + off_hkv * stride_kh + o_n[:, None] * stride_ks + o_d[None, :]
    p_v = V + off_b * stride_vb + off_hkv * stride_vh + o_n[:, None] * stride_vs + o_dv[None, :]
    b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Packed row r holds query r // GROUP, which sees key j when j <= r // GROUP + diag. Rows before ``lo`` see none of
    # this block; rows from ``full_lo`` on see all of it; tiles in between are masked. Keys past seqlen_k load as zero
    # and only feed dK/dV rows that are never stored. A window adds masked rows after ``full_hi``.
    diag = seqlen_k - seqlen_q
    rows = seqlen_q * GROUP
    lo = 0
    full_lo = 0
    full_hi = rows
    hi = rows
    if WINDOW:
        lo, full_lo, full_hi, hi = band_row_range(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                  BLOCK_N, GROUP)
    elif CAUSAL:
        lo = (tl.maximum(start_n - diag, 0) * GROUP) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0) * GROUP, BLOCK_M) * BLOCK_M
    for start_m in range(lo, tl.minimum(full_lo, rows), BLOCK_M):
        b_dk, b_dv = _dkdv_tile(
            Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m, o_n, o_d, o_dv, m_d, m_dv, pid_b, off_b, off_hkv,
            stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, seqlen_q,
            seqlen_k, diag, qk_scale, vargs, GROUP, BLOCK_M, BLOCK_D, BLOCK_DV, INPUT_PRECISION, USE_TMA,
            SPLIT_SCORES, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )
    for start_m in range(full_lo, full_hi, BLOCK_M):
        b_dk, b_dv = _dkdv_tile(
            Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m, o_n, o_d, o_dv, m_d, m_dv, pid_b, off_b, off_hkv,
            stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, seqlen_q,
            seqlen_k, diag, qk_scale, vargs, GROUP, BLOCK_M, BLOCK_D, BLOCK_DV, INPUT_PRECISION, USE_TMA,
            SPLIT_SCORES, False, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )
    if WINDOW:
        for start_m in range(full_hi, hi, BLOCK_M):
            b_dk, b_dv = _dkdv_tile(
                Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m, o_n, o_d, o_dv, m_d, m_dv, pid_b, off_b, off_hkv,
                stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, seqlen_q,
                seqlen_k, diag, qk_scale, vargs, GROUP, BLOCK_M, BLOCK_D, BLOCK_DV, INPUT_PRECISION, USE_TMA,
                SPLIT_SCORES, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
            )

    p_dk = DK + off_b * stride_dkb + off_hkv * stride_dkh + o_n[:, None] * stride_dks + o_d[None, :]
    p_dv = DV + off_b * stride_dvb + off_hkv * stride_dvh + o_n[:, None] * stride_dvs + o_dv[None, :]
    tl.store(p_dk, (b_dk * sm_scale).to(DK.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])
    tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=m_n[:, None] & m_dv[None, :])


@triton.jit
def _dkdv_tile(
    Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m, o_n, o_d, o_dv, m_d, m_dv, pid_b, off_b, off_hkv,
    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, diag, qk_scale, vargs,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_SCORES: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """One tile of packed query rows ``[start_m, start_m + BLOCK_M)`` against the program's keys: adds ``Pᵀ dO`` to dV
    and ``dSᵀ Q`` to dK. The tile is transposed (keys × rows), so the variants see ``i`` along the columns."""
    o_i, o_h, m_r = packed_rows(start_m, off_hkv, seqlen_q, BLOCK_M, GROUP)
    if USE_TMA:  # [B, Sq, Hq, D] descriptors with boxes [1, BLOCK_M / GROUP, GROUP, D]: the packed rows in order
        b_q = Q.load([pid_b, start_m // GROUP, off_hkv * GROUP, 0]).reshape(BLOCK_M, BLOCK_D)
        b_do = DO.load([pid_b, start_m // GROUP, off_hkv * GROUP, 0]).reshape(BLOCK_M, BLOCK_DV)
    else:
        p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
        p_do = DO + off_b * stride_dob + o_i[:, None] * stride_dos + o_h[:, None] * stride_doh + o_dv[None, :]
        b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
        b_do = tl.load(p_do, mask=m_r[:, None] & m_dv[None, :], other=0.0)
    b_lse, b_delta = _row_stats(LSE, DELTA, off_b, o_h, o_i, m_r, stride_lb, stride_lh)
    sargs = (b_lse, o_i, o_h, o_n, m_r, pid_b, seqlen_k, diag, qk_scale, vargs)
    if SPLIT_SCORES:
        if seqlen_k > 0:  # always true at launch: see SPLIT_SCORES in the module notes
            b_pt, b_pv, th, keep = _dkdv_probs(b_k, b_q, b_do, sargs, INPUT_PRECISION, MASKED, CAUSAL, WINDOW,
                                               SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)
            b_dst = _dkdv_dscores(b_v, b_q, b_do, b_pt, th, keep, b_delta, INPUT_PRECISION, SOFTCAP, DROPOUT)
        else:
            b_pv = tl.zeros([o_n.shape[0], BLOCK_M], dtype=b_do.dtype)
            b_dst = tl.zeros([o_n.shape[0], BLOCK_M], dtype=b_q.dtype)
        b_dv += tl.dot(b_pv, b_do, input_precision=INPUT_PRECISION)
    else:
        b_pt, b_pv, th, keep = _dkdv_probs(b_k, b_q, b_do, sargs, INPUT_PRECISION, MASKED, CAUSAL, WINDOW, SOFTCAP,
                                           ALIBI, HAS_BIAS, DROPOUT)
        b_dv += tl.dot(b_pv, b_do, input_precision=INPUT_PRECISION)
        b_dst = _dkdv_dscores(b_v, b_q, b_do, b_pt, th, keep, b_delta, INPUT_PRECISION, SOFTCAP, DROPOUT)
    b_dk += tl.dot(b_dst, b_q, input_precision=INPUT_PRECISION)
    return b_dk, b_dv


@triton.jit
def _dkdv_probs(
    b_k, b_q, b_do, sargs, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """A tile's ``Pᵀ`` from ``Sᵀ = K Qᵀ`` ([BLOCK_N, BLOCK_M]): in float32, and as dV's operand (dropout's kept
    probabilities, scaled) in dO's dtype; with ``bwd_probs``'s softcap tanh and dropout scale."""
    b_lse, o_i, o_h, o_n, m_r, pid_b, seqlen_k, diag, qk_scale, vargs = sargs
    b_st = tl.dot(b_k, tl.trans(b_q), input_precision=INPUT_PRECISION)
    th = b_st
    keep = b_st
    if WINDOW or SOFTCAP or ALIBI or HAS_BIAS or DROPOUT:
        b_pt, th, keep = bwd_probs(
            b_st, o_i[None, :], o_n[:, None], o_h[None, :], pid_b, m_r[None, :] & (o_n < seqlen_k)[:, None],
            b_lse[None, :], seqlen_k, diag, qk_scale, vargs, CAUSAL, MASKED, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )
    else:
        if MASKED:
            b_st = tl.where(o_n[:, None] <= o_i[None, :] + diag, b_st, float("-inf"))
        b_pt = tl.math.exp2(b_st * qk_scale - b_lse[None, :])
    if DROPOUT:  # dV takes the kept probabilities, scaled; dP flows back through the same mask
        b_pv = (b_pt * keep).to(b_do.dtype)
    else:
        b_pv = b_pt.to(b_do.dtype)
    return b_pt, b_pv, th, keep


@triton.jit
def _dkdv_dscores(b_v, b_q, b_do, b_pt, th, keep, b_delta, INPUT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                  DROPOUT: tl.constexpr):
    """``dSᵀ = Pᵀ ∘ (dPᵀ − delta)`` with ``dPᵀ = V dOᵀ``, in Q's dtype."""
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=INPUT_PRECISION)
    if DROPOUT:
        b_dpt = b_dpt * keep
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    if SOFTCAP:
        b_dst = b_dst * (1.0 - th * th)
    return b_dst.to(b_q.dtype)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, O, DLSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, heads_kv, qk_scale, sm_scale,
    CU_Q, CU_K, SLOPES, BIAS, SINKS, RNG,
    stride_sb, stride_bb, stride_bh, stride_bi, stride_bj,
    window_left, window_right, softcap_in, softcap_out, dropout_p, batch0, head_group,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, SINK: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
):
    pid_m, pid_bh = tile_order(head_group)  # longest causal rows first
    pid_b = pid_bh // heads_kv
    off_b = pid_b.to(tl.int64)
    off_hkv = pid_bh % heads_kv
    if VARLEN:
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, VARLEN)
        if pid_m * BLOCK_M >= seqlen_q * GROUP:
            return
        Q += q_start.to(tl.int64) * stride_qs
        DO += q_start.to(tl.int64) * stride_dos
        DQ += q_start.to(tl.int64) * stride_dqs
        O += q_start.to(tl.int64) * stride_os
        LSE += q_start
        DELTA += q_start
        DLSE += q_start
        K += k_start.to(tl.int64) * stride_ks
        V += k_start.to(tl.int64) * stride_vs
    o_i, o_h, m_r, o_d, o_dv, o_n, m_d, m_dv = row_tile(pid_m * BLOCK_M, off_hkv, seqlen_q, BLOCK_M, GROUP, BLOCK_N,
                                                        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)

    # These rows' delta (the preprocess kernel's), stored for the dK/dV kernel, which runs after this one.
    p_do = DO + off_b * stride_dob + o_i[:, None] * stride_dos + o_h[:, None] * stride_doh + o_dv[None, :]
    p_o = O + off_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh + o_dv[None, :]
    b_do = tl.load(p_do, mask=m_r[:, None] & m_dv[None, :], other=0.0)
    b_delta, p_stats = _store_delta(p_o, b_do, m_r[:, None] & m_dv[None, :], DELTA, DLSE, off_b, o_h, o_i, m_r,
                                    stride_lb, stride_lh, HAS_DLSE)
    b_lse = _row_lse2(LSE, p_stats, m_r)
    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    if USE_TMA:  # the descriptors themselves (the pointers are unused)
        p_k = K
        p_v = V
    else:
        p_k = K + off_b * stride_kb + off_hkv * stride_kh + o_n[:, None] * stride_ks + o_d[None, :]
        p_v = V + off_b * stride_vb + off_hkv * stride_vh + o_n[:, None] * stride_vs + o_dv[None, :]
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    vargs = (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_kv * GROUP,
             window_left, window_right, softcap_in, softcap_out, dropout_p, batch0)

    # The forward's key range: unmasked blocks every row sees whole, then the diagonal and the tail, masked (and with
    # a window, the masked blocks of its left edge first).
    lo = 0
    full_lo = 0
    if WINDOW:
        lo, full_lo, full_hi, hi = band_key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, GROUP)
    else:
        full_hi, hi = key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, GROUP, CAUSAL)
    diag = seqlen_k - seqlen_q
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            b_dq = _dq_block(
                start_n, b_q, b_do, b_lse, b_delta, b_dq, K, V, p_k, p_v, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d,
                m_dv, seqlen_k, diag, stride_ks, stride_vs, qk_scale, vargs, BLOCK_N, BLOCK_D, BLOCK_DV,
                INPUT_PRECISION, USE_TMA, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
            )
    for start_n in range(full_lo, full_hi, BLOCK_N):
        b_dq = _dq_block(
            start_n, b_q, b_do, b_lse, b_delta, b_dq, K, V, p_k, p_v, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d,
            m_dv, seqlen_k, diag, stride_ks, stride_vs, qk_scale, vargs, BLOCK_N, BLOCK_D, BLOCK_DV,
            INPUT_PRECISION, USE_TMA, False, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        b_dq = _dq_block(
            start_n, b_q, b_do, b_lse, b_delta, b_dq, K, V, p_k, p_v, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d,
            m_dv, seqlen_k, diag, stride_ks, stride_vs, qk_scale, vargs, BLOCK_N, BLOCK_D, BLOCK_DV,
            INPUT_PRECISION, USE_TMA, True, CAUSAL, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )

    p_dq = DQ + off_b * stride_dqb + o_i[:, None] * stride_dqs + o_h[:, None] * stride_dqh + o_d[None, :]
    tl.store(p_dq, (b_dq * sm_scale).to(DQ.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


@triton.jit
def _dq_block(
    start_n, b_q, b_do, b_lse, b_delta, b_dq, K, V, p_k, p_v, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d,
    m_dv, seqlen_k, diag, stride_ks, stride_vs, qk_scale, vargs,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """One key block of the dQ loop: ``dQ += dS K`` with ``dS = P ∘ (dP − delta)``, ``dP = dO Vᵀ``."""
    o_j = start_n + o_n
    m_n = o_j < seqlen_k
    if USE_TMA:  # [B, Sk, Hkv, D] descriptors; the copy engine zero-fills past the end
        b_k = K.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_D)
        b_v = V.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_DV)
    elif MASKED:
        b_k = tl.load(p_k + start_n * stride_ks, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(p_v + start_n * stride_vs, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    else:
        b_k = tl.load(p_k + start_n * stride_ks, mask=m_d[None, :], other=0.0)
        b_v = tl.load(p_v + start_n * stride_vs, mask=m_dv[None, :], other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)
    if WINDOW or SOFTCAP or ALIBI or HAS_BIAS or DROPOUT:
        b_p, th, keep = bwd_probs(
            b_s, o_i[:, None], o_j[None, :], o_h[:, None], pid_b, m_r[:, None] & m_n[None, :], b_lse[:, None],
            seqlen_k, diag, qk_scale, vargs, CAUSAL, MASKED, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
        )
    else:
        if MASKED:
            visible = m_n[None, :]
            if CAUSAL:
                visible = visible & (o_j[None, :] <= o_i[:, None] + diag)
            b_s = tl.where(visible, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s * qk_scale - b_lse[:, None])
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=INPUT_PRECISION)
    if DROPOUT:
        b_dp = b_dp * keep
    b_ds = b_p * (b_dp - b_delta[:, None])
    if SOFTCAP:
        b_ds = b_ds * (1.0 - th * th)
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=INPUT_PRECISION)


@triton.jit
def attention_bwd_dq_scale_kernel(ACC, DQ, scale, stride_db, stride_ds, stride_dh, tiles, seqlen_q, heads_q,
                                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """dQ = ``scale`` · a fused dQ's float32 sum in dQ's dtype, one (batch, row tile, head) a program: its
    ``BLOCK_M · HEAD_DIM`` values of ``ACC`` (``backward_sm90_dq._dq_coord``: rows of 128 values, ``heads_q`` rows
    apart, holding two warpgroup parts of 64 rows by ``C`` columns, each in the order of wgmma's registers,
    ``_register_order``), put back in place; rows past Sq are padding, never stored."""
    pid = tl.program_id(0)
    h = pid % heads_q
    t = (pid // heads_q) % tiles
    b = (pid // (heads_q * tiles)).to(tl.int64)
    tl.static_assert(BLOCK_M == 64 or BLOCK_M == 128, "parts of 64 rows: the row tile's halves, or all of it")
    C: tl.constexpr = BLOCK_M * HEAD_DIM // 128  # a part's columns; also the tile's rows of 128 values per head
    acc_rows = (b * tiles + t) * C + tl.arange(0, C)
    x = tl.load(ACC + ((acc_rows * heads_q + h) * 128)[:, None] + tl.arange(0, 128)[None, :])
    # [part, warp, column group, lane // 4, lane % 4, row half, pair] -> [part, row (warp, half, lane // 4),
    # column (group, lane % 4, pair)]
    x = tl.reshape(tl.permute(tl.reshape(x, [2, 4, C // 8, 8, 4, 2, 2]), (0, 1, 5, 3, 2, 4, 6)), [2, 64, C])
    if BLOCK_M == 128:  # the parts split the rows
        x = tl.reshape(x, [BLOCK_M, HEAD_DIM])
    else:  # the columns
        x = tl.reshape(tl.permute(x, (1, 0, 2)), [BLOCK_M, HEAD_DIM])
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    out = DQ + (b * stride_db + rows.to(tl.int64) * stride_ds + h * stride_dh)[:, None] + cols[None, :]
    tl.store(out, (x * scale).to(DQ.dtype.element_ty), mask=(rows < seqlen_q)[:, None])


def backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, *, out=None, config=None,
             deterministic: bool = True):
    """Gradients ``(dq, dk, dv)`` in the inputs' dtypes. Shapes as the forward: q ``[B, Sq, Hq, D]``,
    k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``, o and do ``[B, Sq, Hq, Dv]``, lse and dlse ``[B, Hq, Sq]``.

    ``out`` is an optional ``(dq, dk, dv)`` of buffers of those shapes, last dim contiguous, in any float dtype the
    kernels store to: ring attention passes float32 buffers so each block's gradients are summed before rounding.
    ``config`` (a ``BwdConfig``) overrides the table, for the tile sweep. ``deterministic=False`` lets the table
    pick a tile whose dQ sums in no fixed order (``fused_dq``), unless torch's deterministic mode is on."""
    return gradients(do, q, k, v, o, lse, scale, causal, dlse, out=out, config=config,
                     deterministic=deterministic)[:3]


def gradients(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, *, out=None, config=None,
              mods: Mods = PLAIN, bias_grad: bool = False, deterministic: bool = True):
    """``(dq, dk, dv, dbias, dsinks)``: ``backward``'s gradients with the score variants of ``mods``; ``dbias`` (in
    attn_bias's shape and dtype, from the separate kernel of ``bias_grad.py``) only with ``bias_grad``, ``dsinks``
    (``[Hq]``, ``-Σ_rows exp(sink − lse) · delta``) only with sinks; None otherwise. With varlen ``mods`` every
    tensor is packed: q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``, lse ``[Hq, total_q]``."""
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    q, k, v, o, do = (_last_dim_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if out is None else out
    if any(x.stride(-1) != 1 for x in (dq, dk, dv)):
        raise ValueError("the out buffers (dq, dk, dv) must be contiguous in their last dim")
    dlse = None if dlse is None else dlse.contiguous()
    exact = deterministic or torch.are_deterministic_algorithms_enabled()
    # A whole-batch call whose only variants are a window and sinks is kept for its repeats (_repeat): its kernels
    # depend on the window's band alone (they never read the sinks, which reach them through lse)
    keep = mods.window_sinks_only and not bias_grad and launch_cache.enabled
    routing = (config, exact, None if mods is PLAIN else mods.band(causal))
    if keep:
        delta = _repeat(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing)
        if delta is not None:
            return dq, dk, dv, None, sink_grad(mods.sinks, lse, delta)
    if mods.varlen:  # packed [1, total, H, D] views, as in the forward
        q, k, v, o, do, dq, dk, dv = (x[None] for x in (q, k, v, o, do, dq, dk, dv))
        lse, dlse = lse[None], None if dlse is None else dlse[None]
    b, sq, hq, d = q.shape
    hkv, dv_dim = k.shape[2], v.shape[3]
    dbias = None
    if q.numel() == 0 or k.shape[1] == 0:  # no query or no key: every gradient of q, k, v is zero
        dq.zero_(), dk.zero_(), dv.zero_()
        delta = (do.float() * o.float()).sum(-1).transpose(1, 2) - (0 if dlse is None else dlse)
    else:
        delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        hopper = ws_ok(do, q, k, v, mods, causal)
        span = _window_span(mods, causal, k.shape[1])  # 0 without a window, Sk where it leaves a row every key
        # the table takes the Hopper kernel where it measured faster: windows at d = 64 from a 256-key span
        table_hopper = hopper and (span in (0, k.shape[1]) or BWD_WS_WINDOW_MIN_SPAN.get(d, 1) <= span)
        windowed = table_hopper and span > 0  # a causal window: the Hopper kernel's causal launch
        cfg = config or bwd_config(d, dv_dim, q.dtype, q.device.type, causal=causal or windowed,
                                   ws_ok=table_hopper and not mods.varlen, seqlen_q=sq, seqlen_k=k.shape[1],
                                   deterministic=exact,
                                   ordered_blocks=backward_sm90.ordered_blocks(q.device) if table_hopper else 0)
        if cfg.dkdv.fused_dq and not cfg.dkdv.gluon:
            raise ValueError("config: fused_dq needs a gluon dK/dV tile (the Hopper kernel adds dQ)")
        if cfg.dkdv.dq_ordered and not cfg.dkdv.fused_dq:
            raise ValueError("config: dq_ordered orders a fused_dq tile's adds; this tile fuses no dQ")
        if cfg.dkdv.early_dv and not cfg.dkdv.gluon:
            raise ValueError("config: early_dv orders the Hopper dK/dV kernel's matmuls; this tile is not gluon")
        if (cfg.dkdv.persistent and not cfg.dkdv.gluon) or cfg.dq.persistent:
            raise ValueError("config: persistent runs the Hopper dK/dV kernel's programs over key blocks; "
                             "this tile is not a gluon dK/dV tile")
        if cfg.dkdv.last_block_first and not cfg.dkdv.dq_ordered:
            raise ValueError("config: last_block_first orders a dq_ordered tile's launch; this tile is not ordered")
        if cfg.dkdv.fused_dq and exact and not cfg.dkdv.dq_ordered:
            raise ValueError("config: a fused_dq tile without dq_ordered sums dQ in no fixed order; it needs "
                             "deterministic=False and torch's deterministic algorithms off")
        if cfg.dkdv.gluon and not hopper:
            raise ValueError("config: a gluon dK/dV tile runs only plain half-precision calls (or with sinks and a "
                             "window whose right side is 0) on sm_90 with equal head dims of 64, 128 or 256 "
                             "(backward_sm90.HEAD_DIMS) and TMA-aligned q, k, v and do")
        if cfg.dq.split_scores:  # measured slower at every tile tried (NOTES v8), so the dQ kernel has no branch
            raise ValueError("config: split_scores applies to the dK/dV tile only, not to config.dq")
        group = hq // hkv
        # Packed query rows come through the copy engine when a row tile holds whole groups in order (boxes must be
        # powers of two); K and V in the dQ kernel whenever the strides allow. Not for packed sequences, whose
        # bounds a descriptor over the whole pack cannot know.
        tma_rows = (cfg.dkdv.tma and group & (group - 1) == 0 and cfg.dkdv.block_m % group == 0 and tma_aligned(q, do)
                    and not mods.varlen)
        tma_keys = cfg.dq.tma and tma_aligned(k, v) and not mods.varlen
        # Every tensor is also read through pointers by one kernel or another, so all must fit int32 offsets.
        if mods.varlen:
            lq, lk = slice(0, mods.max_seqlen_q), slice(0, mods.max_seqlen_k)
            check_int32_offsets(q=q[:, lq], k=k[:, lk], v=v[:, lk], o=o[:, lq], do=do[:, lq], dq=dq[:, lq],
                                dk=dk[:, lk], dv=dv[:, lk], lse=lse)
            for seqs in batch_slices(mods.cu_seqlens_q.shape[0] - 1, hkv):
                _launch(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale, causal, cfg, False, False,
                        mods.batch_slice(seqs))
        else:
            check_int32_offsets(q=q, k=k, v=v, o=o, do=do, dq=dq, dk=dk, dv=dv, lse=lse)
            for rows in batch_slices(b, max(hq, hkv)):
                if rows == slice(0, b):  # the whole batch: no views to make (each costs host time)
                    kernels = _launch(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale, causal, cfg, tma_rows,
                                      tma_keys, mods, keep)
                    if keep:
                        _remember(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing,
                                  _Step(cfg, tma_rows, tma_keys, *kernels))
                    continue
                _launch(do[rows], q[rows], k[rows], v[rows], o[rows], lse[rows], None if dlse is None else dlse[rows],
                        delta[rows], dq[rows], dk[rows], dv[rows], scale, causal, cfg, tma_rows, tma_keys,
                        mods.batch_slice(rows))
        if bias_grad:
            dbias = bias_grad_kernel.bias_gradient(q, k, v, do, lse, delta, scale, causal, mods)
    if bias_grad and dbias is None:
        dbias = torch.zeros_like(mods.attn_bias)
    if mods.varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv, dbias, sink_grad(mods.sinks, lse, delta)


def ws_ok(do, q, k, v, mods: Mods, causal: bool = False) -> bool:
    """Whether the Hopper dK/dV kernel (backward_sm90.py) can run this call: plain attention, or with sinks and a
    window whose right side is 0 (causal, or right = 0: the kernel's ``window_left``) as its only variants (sinks
    reach the gradients only through lse, which holds them, and dsinks, computed apart), with what the forward's
    needs (forward.ws_ok, with a unit scale: the backward takes no max), a head dim it is built for, and dO through a
    descriptor too."""
    band = None if mods is PLAIN else mods.band(causal)
    plain = mods is PLAIN or (mods.window_sinks_only and (band is None or band[1] == 0))
    return (backward_sm90 is not None and plain and q.shape[-1] in backward_sm90.HEAD_DIMS
            and _forward_ws_ok(q, k, v, 1.0, mods) and tma_aligned(k, v, do))


def _preprocess(o, do, lse, dlse, delta, zero=None, keep: bool = False):
    """``delta = rowsum(dO ∘ O) − dlse`` for o, do ``[B, Sq, Hq, Dv]`` into delta ``[B, Hq, Sq]`` (lse's layout),
    and, for a fused dQ, the zeroing ``zero`` says (``_Zero``: what ``_dq_accumulator`` needs zeroed). Returns
    ``(grid, Relaunch)`` of the launch: with ``keep`` the Relaunch to repeat it (None where it cannot be kept), else
    None."""
    b, sq, hq, dv_dim = o.shape
    zero = zero or _Zero(delta, 0, False, 0)
    if zero.accumulator and zero.memory.shape[-1] != dv_dim:  # the kernel zeroes Dv columns of each row
        raise ValueError(f"zero: the accumulator's head dim must be o's {dv_dim}, not {zero.memory.shape[-1]}")
    grid = (cdiv(max(sq, zero.rows if zero.accumulator else 0), PREPROCESS_ROWS), b * hq)
    arrays = _pre_arrays(o, do, lse, dlse, delta, zero.memory)
    return grid, start(
        keep, attention_bwd_preprocess_kernel, grid, len(arrays), *arrays,
        *o.stride()[:3], *do.stride()[:3], *delta.stride()[:2],
        sq, hq, zero.rows,
        HEAD_DIM_V=dv_dim, BLOCK_M=PREPROCESS_ROWS, BLOCK_DV=max(16, next_power_of_2(dv_dim)),
        HAS_DLSE=dlse is not None, ZERO_ROWS=zero.accumulator, ZERO_TILE=zero.tile,
    )


def _launch(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale, causal, cfg, tma_rows, tma_keys,
            mods: Mods = PLAIN, keep: bool = False):
    """The kernels over q ``[B, Sq, Hq, D]`` (with varlen ``mods``: packed ``[1, total, H, D]`` views, one program
    column per sequence and kv head), delta into ``delta``: the dQ kernel (which computes delta), then the dK/dV
    kernel; or, where the dK/dV kernel fuses dQ, the preprocess kernel, the dK/dV kernel and the pass that scales
    dQ. Returns ``(pre, dkdv, dq)``, each ``(grid, Relaunch)`` (``pre`` None without the preprocess kernel; ``dq``
    the scaling pass where fused): with ``keep`` the Relaunch to repeat it (None where it cannot be kept), else
    None."""
    b, sq, hq, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv_dim))
    common = dict(
        GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
        CAUSAL=causal and mods.band(causal) is None, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    strides_in = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    strides_dk = (*dk.stride()[:3], *dv.stride()[:3])
    strides_dq, strides_lse, strides_o = dq.stride()[:3], lse.stride()[:2], o.stride()[:3]
    if mods.varlen:  # one sequence per batch entry: batch strides 0, each program moves its pointers
        b, sq, sk = mods.cu_seqlens_q.shape[0] - 1, mods.max_seqlen_q, mods.max_seqlen_k
        strides_in = tuple(0 if i % 3 == 0 else x for i, x in enumerate(strides_in))
        strides_dk = tuple(0 if i % 3 == 0 else x for i, x in enumerate(strides_dk))
        strides_dq, strides_lse, strides_o = (0, *strides_dq[1:]), (0, strides_lse[1]), (0, *strides_o[1:])
    # the kernels never read sinks (lse holds them), so a kept launch holds no sinks tensor to go stale (_repeat)
    variants = variant_args(mods if mods.sinks is None else replace(mods, sinks=None).canonical(), causal, scale,
                            b, hq, sq, sk)
    band = mods.band(causal)  # a causal window (right = 0) where a gluon tile runs (ws_ok): its causal launch
    hopper = dict(causal=causal or band is not None,  # a left side reaching every key is plain causal
                  window_left=None if band is None or band[0] >= sq + sk else band[0])
    scalars = (sq, sk, hkv, scale * LOG2E, scale)
    head_group = bwd_head_group(b * hkv, common["CAUSAL"])
    t = cfg.dkdv
    if t.gluon and t.fused_dq:  # dQ comes with dK and dV: delta first, and after them the pass that scales dQ
        dq_acc, dq_sem, zero = _dq_accumulator(dq, t, hopper["causal"], sk)
        pre = _preprocess(o, do, lse, dlse, delta, zero, keep)
        dkdv = backward_sm90.launch_dkdv(q, k, v, do, lse, delta, dk, dv, scale, tile=t, keep=keep, dq_acc=dq_acc,
                                         dq_sem=dq_sem, head_group=head_group, **hopper)
        return pre, dkdv, _scale_dq(dq_acc, scale, dq, t.block_m, keep)
    t = cfg.dq
    k_arg, v_arg = k, v
    if tma_keys:
        k_arg, v_arg = descriptor(k, t.block_n, 1, block_d), descriptor(v, t.block_n, 1, block_dv)
    grid_dq = (cdiv(sq * group, t.block_m), b * hkv)
    arrays = _dq_arrays(q, k_arg, v_arg, do, lse, delta, dq, o, dlse)
    dq_kernel = start(
        keep, attention_bwd_dq_kernel, grid_dq, len(arrays),
        *arrays, *strides_in, *strides_dq, *strides_lse, *strides_o, *scalars, **variants, head_group=head_group,
        **common, BLOCK_M=t.block_m, BLOCK_N=t.block_n, USE_TMA=tma_keys, HAS_DLSE=dlse is not None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    t = cfg.dkdv
    if t.gluon:
        dkdv = backward_sm90.launch_dkdv(q, k, v, do, lse, delta, dk, dv, scale, tile=t, keep=keep,
                                         head_group=head_group, **hopper)
    else:
        q_arg, do_arg = q, do
        if tma_rows:
            q_arg = descriptor(q, t.block_m // group, group, block_d)
            do_arg = descriptor(do, t.block_m // group, group, block_dv)
        grid_dkdv = (cdiv(sk, t.block_n), b * hkv)
        dkdv = grid_dkdv, start(
            keep, attention_bwd_dkdv_kernel, grid_dkdv, 8,
            q_arg, k, v, do_arg, lse, delta, dk, dv, *strides_in, *strides_dk, *strides_lse, *scalars, **variants,
            head_group=head_group, **common, BLOCK_M=t.block_m, BLOCK_N=t.block_n, USE_TMA=tma_rows,
            SPLIT_SCORES=t.split_scores, num_warps=t.num_warps, num_stages=t.num_stages,
        )
    return None, dkdv, (grid_dq, dq_kernel)


def _pre_arrays(o, do, lse, dlse, delta, zero) -> tuple:
    """The preprocess kernel's array arguments, in its order (the full path's launch and a kept launch's repeat):
    ``zero`` the memory it zeroes (delta standing in, unwritten, where it zeroes nothing)."""
    return o, do, _dlse_arg(lse, dlse), delta, zero


def _dq_arrays(q, k, v, do, lse, delta, dq, o, dlse) -> tuple:
    """The dQ kernel's array arguments, in its order (the full path's launch and a kept launch's repeat)."""
    return q, k, v, do, lse, delta, dq, o, _dlse_arg(lse, dlse)


def _dlse_arg(lse, dlse):
    """A kernel's DLSE argument: dlse, or lse standing in for an absent one (unread: HAS_DLSE is false)."""
    return lse if dlse is None else dlse


class _Zero(NamedTuple):
    """What the preprocess kernel zeroes for a fused dQ: ``memory`` (float32 or int32), with ``accumulator`` all
    ``rows`` rows per batch entry of a float32 accumulator (padding rows past Sq too), else with ``tile`` > 0 the int32
    counters of ``tile``-row tiles (``rows`` of them per (batch, head)); nothing where neither."""

    memory: torch.Tensor
    rows: int
    accumulator: bool
    tile: int


def _dq_accumulator(dq, tile, causal: bool, seqlen_k: int):
    """Float32 dQ ``[B, Sq rounded up to the row tile, Hq, D]`` for a ``fused_dq`` kernel's TMA copies (each row
    tile's memory in the kernel's order, ``backward_sm90_dq._dq_coord``, which the scaling pass undoes), and for a
    ``dq_ordered`` one its int32 counters ``[B, Hq, row tiles]`` (else None), from one allocation; and the ``_Zero``
    the preprocess kernel, which runs before the dK/dV kernel, applies: every row of the accumulator (padding rows
    too) for the adds in any order, the counters for the ordered ones.
    The ordered kernel stores each row tile's first add, so its accumulator is zeroed (here) only in the row tiles
    no key block sees (causal, whole tiles above every key's diagonal: Sq - Sk rows and more)."""
    b, sq, hq, d = dq.shape
    tiles = cdiv(sq, tile.block_m)
    n_acc, n_sem = b * tiles * tile.block_m * hq * d, b * hq * tiles if tile.dq_ordered else 0
    buf = torch.empty(n_acc + n_sem, dtype=torch.float32, device=dq.device)
    dq_acc = buf[:n_acc].view(b, tiles * tile.block_m, hq, d)
    if not tile.dq_ordered:
        return dq_acc, None, _Zero(dq_acc, tiles * tile.block_m, True, 0)
    sem = buf[n_acc:].view(torch.int32)
    unseen = (sq - seqlen_k) // tile.block_m * tile.block_m if causal else 0
    if unseen > 0:
        dq_acc[:, :unseen].zero_()
    return dq_acc, sem.view(b, hq, tiles), _Zero(sem, tiles, False, tile.block_m)


def _scale_dq(dq_acc, scale: float, dq, block_m: int, keep: bool = False):
    """dQ = scale · the fused kernel's sum (``dq_acc``, in its ``block_m``-row tiles' order: its rows past Sq are
    padding), into dq: one pass over the accumulator. Returns ``(grid, Relaunch)``: with ``keep`` the Relaunch to
    repeat it (None where it cannot be kept), else None."""
    b, sq, hq, d = dq.shape
    tiles = dq_acc.shape[1] // block_m
    grid = (b * tiles * hq,)
    return grid, start(keep, attention_bwd_dq_scale_kernel, grid, 2, dq_acc, dq, scale, *dq.stride()[:3], tiles, sq,
                       hq, HEAD_DIM=d, BLOCK_M=block_m, num_warps=8)


# ---------------------------------------------------------------------------------------------------------------
# Repeats. A training loop runs the backward with the same shapes every step, so a whole-batch call, plain or with a
# window and sinks as its only variants, keeps its choices (tile, descriptor use) and its launches (``_Step``: the dQ
# and dK/dV kernels, or with a fused dQ the preprocess kernel, the dK/dV kernel and the pass that scales dQ), keyed by
# the metadata they depend on; a repeat only swaps the tensors in (``Relaunch``) with descriptors around them (the
# Gluon kernel's kept by address: ``forward_sm90.descriptor``). All must be ready before any starts; where one is not
# (a hook set, an alignment changed...), the call takes the full path, which keeps a fresh step.


class _Step:
    __slots__ = ("cfg", "tma_rows", "tma_keys", "pre", "dkdv", "dq")

    def __init__(self, cfg, tma_rows: bool, tma_keys: bool, pre, dkdv, dq):
        self.cfg, self.tma_rows, self.tma_keys = cfg, tma_rows, tma_keys
        # each (grid, Relaunch or None); pre None without the preprocess kernel; dq the scaling pass if fused
        self.pre, self.dkdv, self.dq = pre, dkdv, dq


_STEPS: dict = {}
_MAX_STEPS = 256  # shapes a training process sees are few; past this the table starts over


def _step_key(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing):
    """Everything a kept whole-batch launch depends on besides the data: shapes, strides, dtypes, device, scalars
    (with their types: an int scale specialises differently), the base alignment of the tensors that may go
    through descriptors (``tma_aligned`` reads it), and ``routing``: (the explicit config or None, whether the call
    must be deterministic, the window's band or None). Sinks are not in it: no backward kernel reads them."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(), do.shape,
            do.stride(), lse.shape, lse.stride(), dq.shape, dq.stride(), dk.shape, dk.stride(), dv.shape, dv.stride(),
            q.dtype, k.dtype, v.dtype, o.dtype, do.dtype, lse.dtype, dq.dtype, dk.dtype, dv.dtype, q.device,
            None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype), scale, type(scale), causal,
            type(causal), routing, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, do.data_ptr() % 16,
            dk.data_ptr() % 16, dv.data_ptr() % 16)


def _remember(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing, step: _Step) -> None:
    bounded_put(_STEPS, _step_key(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing), step, _MAX_STEPS)


def _repeat(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing):
    """Launch a backward seen before through its kept launches and return the delta they write; None, launching
    nothing, where there is no step for this metadata or one of its launches cannot be repeated."""
    step = _STEPS.get(_step_key(do, q, k, v, o, lse, dlse, dq, dk, dv, scale, causal, routing))
    if step is None or step.dkdv[1] is None or step.dq[1] is None or (step.pre is not None and step.pre[1] is None):
        return None
    fused = step.pre is not None  # dQ comes with dK and dV, after the preprocess kernel, and a pass scales it
    b, sq, hq, d = q.shape
    hkv, dv_dim = k.shape[2], v.shape[3]
    group = hq // hkv
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv_dim))
    q_arg, do_arg, k_arg, v_arg = q, do, k, v
    if step.tma_rows and not step.cfg.dkdv.gluon:
        rows = step.cfg.dkdv.block_m // group
        q_arg, do_arg = descriptor(q, rows, group, block_d), descriptor(do, rows, group, block_dv)
    if step.tma_keys and not fused:
        keys = step.cfg.dq.block_n
        k_arg, v_arg = descriptor(k, keys, 1, block_d), descriptor(v, keys, 1, block_dv)
    (grid_dkdv, dkdv), (grid_dq, dq_kernel) = step.dkdv, step.dq
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    masked = causal or routing[2] is not None  # a window's band: launched causal (_launch's hopper["causal"])
    dq_acc, dq_sem, zero = _dq_accumulator(dq, step.cfg.dkdv, masked, k.shape[1]) if fused else (None, None, None)
    if step.cfg.dkdv.gluon:
        descriptors = backward_sm90.descriptors(q, k, v, do, dk, dv, step.cfg.dkdv)
        dq_arg = backward_sm90_dq.dq_descriptor(dq_acc, step.cfg.dkdv, q.shape[-1], q.device)
        arrays_dkdv = (*descriptors, lse, delta, dk, dv, dq_arg, backward_sm90_dq.semaphores(dq_sem, q.device))
    else:
        arrays_dkdv = (q_arg, k, v, do_arg, lse, delta, dk, dv)
    if fused:
        (grid_pre, pre), arrays_dq = step.pre, (dq_acc, dq)
        arrays_pre = _pre_arrays(o, do, lse, dlse, delta, zero.memory)
        if not (pre.ready(arrays_pre) and dkdv.ready(arrays_dkdv) and dq_kernel.ready(arrays_dq)):
            return None
        pre.go(grid_pre, arrays_pre)
        dkdv.go(grid_dkdv, arrays_dkdv)
        dq_kernel.go(grid_dq, arrays_dq)
        return delta
    arrays_dq = _dq_arrays(q, k_arg, v_arg, do, lse, delta, dq, o, dlse)
    if not (dq_kernel.ready(arrays_dq) and dkdv.ready(arrays_dkdv)):
        return None
    dq_kernel.go(grid_dq, arrays_dq)  # first: it writes the delta the dK/dV kernel reads
    dkdv.go(grid_dkdv, arrays_dkdv)
    return delta


# ---------------------------------------------------------------------------------------------------------------
# torch.library registration: the forward op's autograd formula (ops/forward.py) calls this op, so the whole
# training step composes with torch.compile.


def _attention_bwd(do, q, k, v, o, lse, dlse, scale, causal, *mod_args):
    mods, bias_grad = Mods.from_bwd_args(mod_args)
    return op_outputs(gradients(do, q, k, v, o, lse, scale, causal, dlse, mods=mods, bias_grad=bias_grad), q)


attention_bwd = torch.library.custom_op("onlineattn::attention_bwd", _attention_bwd, mutates_args=(),
                                        schema=BWD_SCHEMA)
attention_bwd.register_fake(fake_backward)
attention_bwd.register_autograd(refuse_double_backward)
