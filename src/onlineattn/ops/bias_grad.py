"""The gradient of ``attn_bias`` in Triton: a separate kernel that runs after the backward's kernels (and their delta).

The bias's gradient is the logits' gradient ``dS = P ∘ (dP − delta)`` summed over the dims the bias broadcasts
(a ``(1, Hq, Sq, Sk)`` bias sums over the batch, a ``(B, 1, 1, Sk)`` one over heads and queries). The dK/dV and dQ
kernels cannot write it without atomics: a dS element is made once, but a broadcast bias needs sums across programs.
So this kernel owns tiles of the gradient's own shape and recomputes ``P`` and ``dP`` for every (batch entry, head,
query tile, key tile) that folds into its tile, in a fixed order: deterministic, no atomics, and the gradient is
never larger than the bias. It costs two more matmuls per score tile (``Q Kᵀ`` and ``dO Vᵀ``), so a bias that needs
a gradient makes the backward about a third slower; without one this kernel does not run.

Read top-down: the kernel, then the launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._mods import Mods, bias_4d
from ._common import LOG2E, bwd_probs
from ._configs import bias_grad_config


@triton.jit
def attention_bwd_dbias_kernel(
    Q, K, V, DO, LSE, DELTA, DBIAS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gi, stride_gj,
    seqlen_q, seqlen_k, heads_q, bias_heads, qk_scale,
    sum_b, sum_h,
    CU_Q, CU_K, SLOPES, BIAS, SINKS, RNG,
    stride_sb, stride_bb, stride_bh, stride_bi, stride_bj,
    window_left, window_right, softcap_in, softcap_out, dropout_p, batch0,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SUM_ROWS: tl.constexpr, SUM_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, SINK: tl.constexpr = False,
    DROPOUT: tl.constexpr = False,
):
    """A program owns one tile ``[BLOCK_M, BLOCK_N]`` of the gradient ``[B', H', Sq', Sk']`` (each dim 1 or full) and
    sums dS over ``sum_b`` batch entries and ``sum_h`` heads (B or H where the bias broadcasts them, else 1), over
    every query tile when ``SUM_ROWS`` and every key tile when ``SUM_KEYS``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    g_b = pid_bh // bias_heads
    g_h = pid_bh % bias_heads
    o_m = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V
    diag = seqlen_k - seqlen_q
    m_lo = pid_m * BLOCK_M  # one query tile, or all of them
    m_hi = m_lo + 1
    if SUM_ROWS:
        m_lo = 0
        m_hi = seqlen_q
    n_lo = pid_n * BLOCK_N
    n_hi = n_lo + 1
    if SUM_KEYS:
        n_lo = 0
        n_hi = seqlen_k
    vargs = (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_q,
             window_left, window_right, softcap_in, softcap_out, dropout_p, batch0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for bb in range(0, sum_b):
        off_b = (g_b + bb).to(tl.int64)
        for hh in range(0, sum_h):
            h = g_h + hh
            h_kv = h // GROUP
            for start_m in range(m_lo, m_hi, BLOCK_M):
                o_i = start_m + o_m
                m_i = o_i < seqlen_q
                p_q = Q + off_b * stride_qb + h * stride_qh + o_i[:, None] * stride_qs + o_d[None, :]
                p_do = DO + off_b * stride_dob + h * stride_doh + o_i[:, None] * stride_dos + o_dv[None, :]
                b_q = tl.load(p_q, mask=m_i[:, None] & m_d[None, :], other=0.0)
                b_do = tl.load(p_do, mask=m_i[:, None] & m_dv[None, :], other=0.0)
                p_row = off_b * stride_lb + h * stride_lh + o_i
                b_lse = tl.load(LSE + p_row, mask=m_i, other=float("inf"))
                b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
                b_delta = tl.load(DELTA + p_row, mask=m_i, other=0.0)
                for start_n in range(n_lo, n_hi, BLOCK_N):
                    o_j = start_n + o_n
                    m_j = o_j < seqlen_k
                    p_k = K + off_b * stride_kb + h_kv * stride_kh + o_j[:, None] * stride_ks + o_d[None, :]
                    p_v = V + off_b * stride_vb + h_kv * stride_vh + o_j[:, None] * stride_vs + o_dv[None, :]
                    b_k = tl.load(p_k, mask=m_j[:, None] & m_d[None, :], other=0.0)
                    b_v = tl.load(p_v, mask=m_j[:, None] & m_dv[None, :], other=0.0)
                    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=INPUT_PRECISION)
                    b_p, th, keep = bwd_probs(
                        b_s, o_i[:, None], o_j[None, :], h, off_b, m_i[:, None] & m_j[None, :], b_lse[:, None],
                        seqlen_k, diag, qk_scale, vargs, CAUSAL, True, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT,
                    )
                    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=INPUT_PRECISION)
                    if DROPOUT:
                        b_dp = b_dp * keep
                    acc += b_p * (b_dp - b_delta[:, None])
    o_i = pid_m * BLOCK_M + o_m
    o_j = pid_n * BLOCK_N + o_n
    m_out = (o_i < seqlen_q)[:, None] & (o_j < seqlen_k)[None, :]
    if SUM_ROWS:  # a bias with one query row: the column sums land in row 0
        acc = tl.sum(acc, 0)[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        m_out = m_out & (o_i == 0)[:, None]
    if SUM_KEYS:
        acc = tl.sum(acc, 1)[:, None] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        m_out = m_out & (o_j == 0)[None, :]
    p_g = DBIAS + g_b.to(tl.int64) * stride_gb + g_h.to(tl.int64) * stride_gh + o_i.to(tl.int64)[:, None] * stride_gi
    tl.store(p_g + o_j[None, :] * stride_gj, acc, mask=m_out)


def bias_gradient(q, k, v, do, lse, delta, scale: float, causal: bool, mods: Mods) -> torch.Tensor:
    """``d attn_bias`` in the bias's shape and dtype, from q ``[B, Sq, Hq, D]``, k, v, do, lse ``[B, Hq, Sq]`` and the
    backward's ``delta [B, Hq, Sq]`` (float32, ``rowsum(dO ∘ O) − dlse``). Not for packed sequences."""
    from .forward import variant_args  # forward.py imports the backward lazily; this module is imported by it

    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    bias = mods.attn_bias
    gb, gh, gi, gj = bias_4d(bias).shape
    grad = torch.empty((gb, gh, gi, gj), dtype=torch.float32, device=q.device)
    cfg = bias_grad_config(max(d, dv), q.dtype, q.device.type)
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    grid = (1 if gi == 1 else triton.cdiv(sq, cfg.block_m), 1 if gj == 1 else triton.cdiv(sk, cfg.block_n), gb * gh)
    attention_bwd_dbias_kernel[grid](
        q, k, v, do, lse, delta, grad,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1), *grad.stride(),
        sq, sk, hq, gh, scale * LOG2E, b if gb == 1 else 1, hq if gh == 1 else 1,
        **variant_args(mods, causal, scale, b, hq, sq, sk),
        GROUP=hq // hkv, HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUM_ROWS=gi == 1 and sq != 1, SUM_KEYS=gj == 1 and sk != 1,
        CAUSAL=causal and mods.band(causal) is None, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return grad.reshape(bias.shape).to(bias.dtype)
