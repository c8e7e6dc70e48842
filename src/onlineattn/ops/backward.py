"""Fused attention backward in Triton (FlashAttention-2's): dQ, dK, dV from q, k, v, o, lse and dO, deterministic.

Read top-down: three kernels, then the launcher.

1. ``attention_bwd_preprocess_kernel``: ``delta = rowsum(dO ∘ O)`` in float32 (minus the gradient flowing into lse,
   which enters dS the same way: ``dS = P ∘ (dP − delta + dlse)``).
2. ``attention_bwd_dkdv_kernel``: a program owns ``BLOCK_N`` keys of one (batch, kv head) and loops over the query
   rows of every head in its GQA group, recomputing ``P`` from lse. The group's sum lands in registers, so dK and dV
   need no atomics and no per-head copies.
3. ``attention_bwd_dq_kernel``: a program owns ``BLOCK_M`` packed query rows, as in the forward, and loops over keys.

No atomics anywhere, so results are bitwise reproducible by construction. Rows use the forward's packing: row ``r`` is
query ``r // GROUP`` of head ``kv_head · GROUP + r % GROUP``. Scores are in the log2 domain (``qk_scale`` holds
``scale · log2 e`` and lse is converted once on load); a row with ``lse = -inf`` saw no key and gets ``P = 0``.

Status: checked against the oracle through Triton's interpreter; not yet measured on the GPU, so the CUDA path still
takes its gradients from the torch recomputation (``ops/forward.py``) until issue #4's GPU run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, packed_rows, visible_key_range
from ._configs import bwd_config
from .forward import KERNEL_DTYPES, _last_dim_contiguous, batch_slices, check_int32_offsets


@triton.jit
def attention_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    seqlen_q, heads_q,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = pid_bh % heads_q
    o_i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_i = o_i < seqlen_q
    m_o = m_i[:, None] & (o_dv < HEAD_DIM_V)[None, :]
    b_o = tl.load(O + off_b * stride_ob + o_i[:, None] * stride_os + off_h * stride_oh + o_dv[None, :], mask=m_o)
    b_do = tl.load(DO + off_b * stride_dob + o_i[:, None] * stride_dos + off_h * stride_doh + o_dv[None, :], mask=m_o)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    p_lse = off_b * stride_lb + off_h * stride_lh + o_i  # DELTA and DLSE share lse's [B, Hq, Sq] layout
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + p_lse, mask=m_i, other=0.0).to(tl.float32)
    tl.store(DELTA + p_lse, b_delta, mask=m_i)


@triton.jit
def _row_stats(LSE, DELTA, off_b, o_h, o_i, m_r, stride_lb, stride_lh):
    """lse in the log2 domain (+inf where the row saw nothing, so that P = 2^(s - inf) = 0) and delta, per row."""
    p = off_b * stride_lb + o_h * stride_lh + o_i
    lse = tl.load(LSE + p, mask=m_r, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse, tl.load(DELTA + p, mask=m_r, other=0.0)


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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = pid_bh % heads_kv
    start_n = pid_n * BLOCK_N
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_m = tl.arange(0, BLOCK_M)
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
    # and only feed dK/dV rows that are never stored.
    diag = seqlen_k - seqlen_q
    rows = seqlen_q * GROUP
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = (tl.maximum(start_n - diag, 0) * GROUP) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0) * GROUP, BLOCK_M) * BLOCK_M
    for start_m in range(lo, tl.minimum(full_lo, rows), BLOCK_M):
        b_dk, b_dv = _dkdv_tile(
            Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m + o_m, o_n, o_d, o_dv, m_d, m_dv, off_b, off_hkv,
            stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
            rows, diag, qk_scale, GROUP, INPUT_PRECISION, MASKED=True,
        )
    for start_m in range(full_lo, rows, BLOCK_M):
        b_dk, b_dv = _dkdv_tile(
            Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, start_m + o_m, o_n, o_d, o_dv, m_d, m_dv, off_b, off_hkv,
            stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
            rows, diag, qk_scale, GROUP, INPUT_PRECISION, MASKED=False,
        )

    p_dk = DK + off_b * stride_dkb + off_hkv * stride_dkh + o_n[:, None] * stride_dks + o_d[None, :]
    p_dv = DV + off_b * stride_dvb + off_hkv * stride_dvh + o_n[:, None] * stride_dvs + o_dv[None, :]
    tl.store(p_dk, (b_dk * sm_scale).to(DK.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])
    tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=m_n[:, None] & m_dv[None, :])


@triton.jit
def _dkdv_tile(
    Q, DO, LSE, DELTA, b_k, b_v, b_dk, b_dv, o_r, o_n, o_d, o_dv, m_d, m_dv, off_b, off_hkv,
    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    rows, diag, qk_scale, GROUP: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):
    """One tile of packed query rows ``o_r`` against the program's keys: adds ``Pᵀ dO`` to dV and ``dSᵀ Q`` to dK."""
    o_i = o_r // GROUP
    o_h = off_hkv * GROUP + o_r % GROUP
    m_r = o_r < rows
    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    p_do = DO + off_b * stride_dob + o_i[:, None] * stride_dos + o_h[:, None] * stride_doh + o_dv[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    b_do = tl.load(p_do, mask=m_r[:, None] & m_dv[None, :], other=0.0)
    b_lse, b_delta = _row_stats(LSE, DELTA, off_b, o_h, o_i, m_r, stride_lb, stride_lh)
    b_st = tl.dot(b_k, tl.trans(b_q), input_precision=INPUT_PRECISION)  # Sᵀ: [BLOCK_N, BLOCK_M]
    if MASKED:
        b_st = tl.where(o_n[:, None] <= o_i[None, :] + diag, b_st, float("-inf"))
    b_pt = tl.math.exp2(b_st * qk_scale - b_lse[None, :])
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=INPUT_PRECISION)
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=INPUT_PRECISION)
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    b_dk += tl.dot(b_dst.to(b_q.dtype), b_q, input_precision=INPUT_PRECISION)
    return b_dk, b_dv


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_kv, qk_scale, sm_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal rows first
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = pid_bh % heads_kv
    o_i, o_h, m_r = packed_rows(pid_m, off_hkv, seqlen_q, GROUP, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    p_do = DO + off_b * stride_dob + o_i[:, None] * stride_dos + o_h[:, None] * stride_doh + o_dv[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    b_do = tl.load(p_do, mask=m_r[:, None] & m_dv[None, :], other=0.0)
    b_lse, b_delta = _row_stats(LSE, DELTA, off_b, o_h, o_i, m_r, stride_lb, stride_lh)
    p_k = K + off_b * stride_kb + off_hkv * stride_kh + o_n[:, None] * stride_ks + o_d[None, :]
    p_vt = V + off_b * stride_vb + off_hkv * stride_vh + o_n[None, :] * stride_vs + o_dv[:, None]
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The forward's key range: unmasked blocks every row sees whole, then the diagonal and the tail, masked.
    diag, hi, full_hi = visible_key_range(pid_m, seqlen_q, seqlen_k, GROUP, BLOCK_M, CAUSAL)
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_hi, BLOCK_N):
        b_k = tl.load(p_k + start_n * stride_ks, mask=m_d[None, :], other=0.0)
        b_vt = tl.load(p_vt + start_n * stride_vs, mask=m_dv[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)
        b_p = tl.math.exp2(b_s * qk_scale - b_lse[:, None])
        b_ds = b_p * (tl.dot(b_do, b_vt, input_precision=INPUT_PRECISION) - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=INPUT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):
        m_n = (start_n + o_n) < seqlen_k
        b_k = tl.load(p_k + start_n * stride_ks, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_vt = tl.load(p_vt + start_n * stride_vs, mask=m_n[None, :] & m_dv[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)
        visible = m_n[None, :]
        if CAUSAL:
            visible = visible & ((start_n + o_n)[None, :] <= o_i[:, None] + diag)
        b_s = tl.where(visible, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s * qk_scale - b_lse[:, None])
        b_ds = b_p * (tl.dot(b_do, b_vt, input_precision=INPUT_PRECISION) - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=INPUT_PRECISION)

    p_dq = DQ + off_b * stride_dqb + o_i[:, None] * stride_dqs + o_h[:, None] * stride_dqh + o_d[None, :]
    tl.store(p_dq, (b_dq * sm_scale).to(DQ.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


def backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None):
    """Gradients ``(dq, dk, dv)`` in the inputs' dtypes. Shapes as the forward: q ``[B, Sq, Hq, D]``,
    k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``, o and do ``[B, Sq, Hq, Dv]``, lse and dlse ``[B, Hq, Sq]``."""
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    q, k, v, o, do = (_last_dim_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    b, sq, hq, d = q.shape
    hkv, dv_dim = k.shape[2], v.shape[3]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if b * sq * hq == 0 or k.shape[1] == 0:  # no query or no key: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    dlse = None if dlse is None else dlse.contiguous()
    check_int32_offsets(q=q, k=k, v=v, o=o, do=do, dq=dq, dk=dk, dv=dv, lse=lse)
    cfg = bwd_config(d, dv_dim, q.dtype, q.device.type)
    for rows in batch_slices(b, max(hq, hkv)):
        _launch(
            do[rows], q[rows], k[rows], v[rows], o[rows], lse[rows], None if dlse is None else dlse[rows],
            delta[rows], dq[rows], dk[rows], dv[rows], scale, causal, cfg,
        )
    return dq, dk, dv


def _launch(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, scale, causal, cfg) -> None:
    b, sq, hq, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv_dim))
    attention_bwd_preprocess_kernel[(triton.cdiv(sq, cfg.block_m), b * hq)](
        o, do, lse if dlse is None else dlse, delta,
        o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        delta.stride(0), delta.stride(1),
        sq, hq,
        HEAD_DIM_V=dv_dim, BLOCK_M=cfg.block_m, BLOCK_DV=block_dv, HAS_DLSE=dlse is not None,
    )
    common = dict(
        GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    strides_in = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
    )
    scalars = (sq, sk, hkv, scale * LOG2E, scale)
    attention_bwd_dkdv_kernel[(triton.cdiv(sk, cfg.block_n), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, *strides_in,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        lse.stride(0), lse.stride(1), *scalars, **common,
    )
    attention_bwd_dq_kernel[(triton.cdiv(sq * group, cfg.block_m), b * hkv)](
        q, k, v, do, lse, delta, dq, *strides_in,
        dq.stride(0), dq.stride(1), dq.stride(2),
        lse.stride(0), lse.stride(1), *scalars, **common,
    )
