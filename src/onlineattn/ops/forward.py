"""Fused attention forward in Triton: Q tiles stay on-chip, K and V stream through, only o and lse are written.

Read top-down: the kernel, the launcher (pick a config, allocate, launch), then the ``torch.library`` custom op with
its fake implementation and autograd registration.

Tiling. One program owns ``BLOCK_M`` rows of one (batch, kv head). Rows pack the query heads of a GQA group:
row ``r`` is query ``r // GROUP`` of head ``kv_head · GROUP + r % GROUP``, so the group's heads share one read of each
K/V block. Key blocks split into two loops: blocks every row of the tile sees whole (no mask work), then the blocks
that cross the causal diagonal or the end of the keys (masked). Blocks above the diagonal are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._mods import PLAIN, Mods, bias_4d
from .._validate import FLOAT32_MAX
from ..torch_impl import FWD_SCHEMA, autograd_formula, fake_forward, plain_eager, save_for_backward
from . import _launch as launch_cache

try:  # Gluon's Hopper API as triton 3.6 has it; without it every launch takes the Triton kernel
    from . import forward_sm90
except ImportError:  # pragma: no cover - other Triton versions
    forward_sm90 = None
from ._common import (
    LOG2E, band_key_range, finalize_state, keep_scale, key_range, row_tile, score_mod, sequence_bounds, softmax_probs,
    tile_order, tma_aligned, visible,
)
from ._configs import fwd_config
from ._launch import bounded_put, cdiv, next_power_of_2, start


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_kv, qk_scale,
    # Score variants (onlineattn._mods), each read only under its flag; None or 0 otherwise. ``batch0`` is the
    # first batch entry of this launch (dropout counts entries from the call's first).
    CU_Q, CU_K, SLOPES, BIAS, SINKS, RNG,
    stride_sb, stride_bb, stride_bh, stride_bi, stride_bj,
    window_left, window_right, softcap_in, softcap_out, dropout_p, batch0,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    VARLEN: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, SINK: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, PIPELINE: tl.constexpr = False,
):
    # Causal tiles near the bottom have the most key blocks: launch them first so the tail of the grid is short.
    pid_m, pid_bh = tile_order(HEADS_PER_GROUP)
    pid_b = pid_bh // heads_kv  # int32 coordinate for tensor descriptors
    off_b = pid_b.to(tl.int64)  # int64 for pointer arithmetic: B·S·H·D may pass 2^31
    off_hkv = pid_bh % heads_kv
    if VARLEN:  # packed sequences: batch strides are 0 and each pointer moves to its sequence's first row
        q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, VARLEN)
        if pid_m * BLOCK_M >= seqlen_q * GROUP:  # the grid covers the longest sequence
            return
        Q += q_start.to(tl.int64) * stride_qs
        O += q_start.to(tl.int64) * stride_os
        LSE += q_start
        K += k_start.to(tl.int64) * stride_ks
        V += k_start.to(tl.int64) * stride_vs

    o_i, o_h, m_r, o_d, o_dv, o_n, m_d, m_dv = row_tile(pid_m * BLOCK_M, off_hkv, seqlen_q, BLOCK_M, GROUP, BLOCK_N,
                                                        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)

    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    if USE_TMA:  # the descriptors themselves (the pointers are unused)
        p_kt = K
        p_v = V
    else:
        p_kt = K + off_b * stride_kb + off_hkv * stride_kh + o_n[None, :] * stride_ks + o_d[:, None]
        p_v = V + off_b * stride_vb + off_hkv * stride_vh + o_n[:, None] * stride_vs + o_dv[None, :]

    lo = 0
    full_lo = 0
    if WINDOW:  # masked [lo, full_lo), whole [full_lo, full_hi), masked [full_hi, hi)
        lo, full_lo, full_hi, hi = band_key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, GROUP)
    else:  # whole [0, full_hi), masked [full_hi, hi)
        full_hi, hi = key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, GROUP, CAUSAL)
    diag = seqlen_k - seqlen_q  # query i sees key j when j <= i + diag

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    vargs = (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_kv * GROUP,
             window_left, window_right, softcap_in, softcap_out, dropout_p, batch0)
    if SINK:  # the sink is a first "key" with no value: it starts the running max and sum
        m_i = tl.load(SINKS + o_h).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)

    # Common arguments of the block helpers below, in their order.
    kargs = (K, p_kt, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d, seqlen_k, diag, stride_ks, qk_scale, vargs)
    vload = (V, p_v, pid_b, off_hkv, o_n, m_dv, seqlen_k, stride_vs)
    if WINDOW:
        for start_n in range(lo, full_lo, BLOCK_N):
            m_i, l_i, acc = _fwd_block(start_n, b_q, m_i, l_i, acc, kargs, vload, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL,
                                       INPUT_PRECISION, USE_TMA, True, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)
    if PIPELINE:
        # Software-pipelined: block j's softmax runs while the tensor cores add block j-1's P·V. That dot's result
        # is only carried to the next iteration, whose rescale by alpha (deferred one block) reads it after the
        # wait for block j's QKᵀ, so Triton leaves it in flight across the softmax (its "properly async" wgmma
        # rule). The first iteration adds 0 · V (p = 0, alpha = 1: exact) in place of a peeled first block, whose
        # separate K buffer Triton would keep alive through the loop (16 KiB more shared memory: one program per
        # SM instead of two at d = 128), and the pending block passes from the whole-block loop to the masked one
        # without a drain between them (with one there, ptxas serialises every wgmma of the kernel at d = 128).
        # Each block's rescale and P·V happen in the same order as in the plain loops.
        if hi > full_lo:
            p = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            alpha = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
            for start_n in tl.range(full_lo, full_hi, BLOCK_N):
                p, m_i, l_i, alpha, acc = _fwd_pipelined_block(
                    start_n, full_lo, b_q, p, m_i, l_i, alpha, acc, kargs, vload, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL,
                    INPUT_PRECISION, USE_TMA, False, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)
            for start_n in range(full_hi, hi, BLOCK_N):
                p, m_i, l_i, alpha, acc = _fwd_pipelined_block(
                    start_n, full_lo, b_q, p, m_i, l_i, alpha, acc, kargs, vload, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL,
                    INPUT_PRECISION, USE_TMA, True, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)
            last = full_lo + (hi - 1 - full_lo) // BLOCK_N * BLOCK_N  # the block whose P is still pending
            acc = _fwd_pv(last, p.to(b_q.dtype), acc * alpha[:, None], vload, BLOCK_N, BLOCK_DV, INPUT_PRECISION,
                          USE_TMA, True)
    else:
        for start_n in tl.range(full_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _fwd_block(start_n, b_q, m_i, l_i, acc, kargs, vload, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL,
                                       INPUT_PRECISION, USE_TMA, False, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)
        for start_n in range(full_hi, hi, BLOCK_N):
            m_i, l_i, acc = _fwd_block(start_n, b_q, m_i, l_i, acc, kargs, vload, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL,
                                       INPUT_PRECISION, USE_TMA, True, WINDOW, SOFTCAP, ALIBI, HAS_BIAS, DROPOUT)

    b_o, b_lse = finalize_state(m_i, l_i, acc)
    p_o = O + off_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh + o_dv[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    tl.store(LSE + off_b * stride_lb + o_h * stride_lh + o_i, b_lse, mask=m_r)


@triton.jit
def _fwd_block(
    start_n, b_q, m_i, l_i, acc, kargs, vload, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
):
    """One key block ``[start_n, start_n + BLOCK_N)`` of the recurrence: scores, probabilities, the rescale, then
    ``acc += P V``."""
    qk = _fwd_scores(start_n, b_q, kargs, BLOCK_N, BLOCK_D, INPUT_PRECISION, USE_TMA, MASKED)
    p, m_i, l_i, alpha = _fwd_softmax(start_n, qk, m_i, l_i, kargs, CAUSAL, MASKED, WINDOW, SOFTCAP, ALIBI, HAS_BIAS,
                                      DROPOUT)
    acc = _fwd_pv(start_n, p.to(b_q.dtype), acc * alpha[:, None], vload, BLOCK_N, BLOCK_DV, INPUT_PRECISION, USE_TMA,
                  MASKED)
    return m_i, l_i, acc


@triton.jit
def _fwd_pipelined_block(
    start_n, full_lo, b_q, p, m_i, l_i, alpha, acc, kargs, vload, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    """``_fwd_block``'s steps one block apart: block ``start_n``'s scores, the previous block's rescale and P·V (its
    ``p``, ``alpha``; the first block's previous is ``p = 0`` at ``full_lo``), then block ``start_n``'s softmax, whose
    ``(p, m, l, alpha)`` the next call (or the drain after the loops) finishes."""
    qk = _fwd_scores(start_n, b_q, kargs, BLOCK_N, BLOCK_D, INPUT_PRECISION, USE_TMA, MASKED)
    acc = _fwd_pv(tl.maximum(start_n - BLOCK_N, full_lo), p.to(b_q.dtype), acc * alpha[:, None], vload, BLOCK_N,
                  BLOCK_DV, INPUT_PRECISION, USE_TMA, MASKED)
    p, m_i, l_i, alpha = _fwd_softmax(start_n, qk, m_i, l_i, kargs, CAUSAL, MASKED, WINDOW, SOFTCAP, ALIBI, HAS_BIAS,
                                      DROPOUT)
    return p, m_i, l_i, alpha, acc


@triton.jit
def _fwd_scores(start_n, b_q, kargs, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """Raw scores ``q kᵀ`` of the key block at ``start_n``, float32 ``[BLOCK_M, BLOCK_N]``."""
    K, p_kt, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d, seqlen_k, diag, stride_ks, qk_scale, vargs = kargs
    if USE_TMA:  # K and V are [B, Sk, Hkv, D] tensor descriptors; the copy engine zero-fills past the end
        b_kt = tl.trans(K.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_D))
    elif MASKED:
        b_kt = tl.load(p_kt + start_n * stride_ks, mask=m_d[:, None] & (start_n + o_n < seqlen_k)[None, :], other=0.0)
    else:
        b_kt = tl.load(p_kt + start_n * stride_ks, mask=m_d[:, None], other=0.0)
    return tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)


@triton.jit
def _fwd_softmax(start_n, qk, m_i, l_i, kargs, CAUSAL: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    """The score variants, the visibility mask when ``MASKED`` (the causal diagonal, the window's edges, the end of
    the keys), then one online-softmax step: ``(p, m, l, alpha)``, dropout applied to p (float32); the caller owes
    ``acc * alpha`` before adding ``p @ v``."""
    K, p_kt, pid_b, off_hkv, o_i, o_h, o_n, m_r, m_d, seqlen_k, diag, stride_ks, qk_scale, vargs = kargs
    o_j = start_n + o_n
    m_n = o_j < seqlen_k
    step_scale = qk_scale
    if SOFTCAP or ALIBI or HAS_BIAS:  # logits in the log2 domain already
        qk, _ = score_mod(qk, o_i[:, None], o_j[None, :], o_h[:, None], pid_b, m_r[:, None] & m_n[None, :], diag,
                          qk_scale, vargs, SOFTCAP, ALIBI, HAS_BIAS)
        step_scale = 1.0
    if MASKED:
        vis = visible(o_i[:, None], o_j[None, :], m_n[None, :], diag, vargs, CAUSAL, WINDOW)
        qk = tl.where(vis, qk, float("-inf"))
    # A bias may hold -inf anywhere, so with one every block needs the masked step's guard.
    p, m_i, l_i, alpha = softmax_probs(qk, m_i, l_i, step_scale, MASKED=MASKED or HAS_BIAS)
    if DROPOUT:  # the normaliser counts every probability; the output only the kept ones, scaled up
        p = p * keep_scale(o_i[:, None], o_j[None, :], o_h[:, None], pid_b, vargs)
    return p, m_i, l_i, alpha


@triton.jit
def _fwd_pv(start_n, p, acc, vload, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
            USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """``acc + p @ v`` for the value block at ``start_n``."""
    V, p_v, pid_b, off_hkv, o_n, m_dv, seqlen_k, stride_vs = vload
    if USE_TMA:
        b_v = V.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_DV)
    elif MASKED:
        b_v = tl.load(p_v + start_n * stride_vs, mask=(start_n + o_n < seqlen_k)[:, None] & m_dv[None, :], other=0.0)
    else:
        b_v = tl.load(p_v + start_n * stride_vs, mask=m_dv[None, :], other=0.0)
    return tl.dot(p, b_v, acc, input_precision=INPUT_PRECISION)


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def ws_ok(q, k, v, scale, mods: Mods) -> bool:
    """Whether the warp-specialized Hopper kernel (forward_sm90.py) can run this call: plain attention, or with a
    sliding window and/or sinks as its only variants, on an sm_90 device in half precision, equal head dims of 64, 128
    or 256 (forward_sm90.HEAD_DIMS), a positive scale (its max is taken before scaling), and Q through a tensor
    descriptor too (K and V are checked by the caller)."""
    return (forward_sm90 is not None and (mods is PLAIN or mods.window_sinks_only) and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] and q.shape[-1] in forward_sm90.HEAD_DIMS and scale > 0
            and forward_sm90.is_sm90(q.device) and tma_aligned(q))


def _window_span(mods: Mods, causal: bool, seqlen_k: int) -> int:
    """The keys a row's window spans (at most ``seqlen_k``), else 0."""
    band = None if mods is PLAIN else mods.band(causal)
    return 0 if band is None else min(seqlen_k, band[0] + band[1] + 1)


def descriptor(x, box_rows: int, box_heads: int, box_d: int) -> TensorDescriptor:
    """A tensor descriptor over ``x [B, S, H, D]`` with boxes ``[1, box_rows, box_heads, box_d]``."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, box_rows, box_heads, box_d])


def _kv_descriptors(k, v, cfg):
    """K's and V's descriptors for the forward kernel: boxes of ``cfg.block_n`` keys of one head."""
    block_d, block_dv = max(16, next_power_of_2(k.shape[3])), max(16, next_power_of_2(v.shape[3]))
    return descriptor(k, cfg.block_n, 1, block_d), descriptor(v, cfg.block_n, 1, block_dv)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# CUDA caps the grid's second axis (one program column per (batch, kv head)); larger batches launch in slices.
MAX_GRID_Y = 65535
INT32_LIMIT = 2**31


def check_int32_offsets(**tensors) -> None:
    """The kernels add offsets within one batch entry in int32 (the batch offset is int64): the largest must fit."""
    for name, x in tensors.items():
        if x.untyped_storage().nbytes() < INT32_LIMIT * x.element_size():  # no offset into x's storage can reach it
            continue
        if sum((size - 1) * stride for size, stride in zip(x.shape[1:], x.stride()[1:])) >= INT32_LIMIT:
            raise ValueError(
                f"{name} of shape {tuple(x.shape)} spans more than 2^31 elements within one batch entry, beyond the "
                "int32 offsets of the Triton kernels; split the sequence and merge the parts with merge_states"
            )


def batch_slices(batch: int, programs_per_entry: int):
    """Slices of the batch small enough that ``slice length × programs_per_entry`` fits CUDA's grid-y limit."""
    if programs_per_entry > MAX_GRID_Y:
        raise ValueError(f"{programs_per_entry} heads exceed the Triton kernels' limit of {MAX_GRID_Y}")
    per_launch = MAX_GRID_Y // programs_per_entry
    return [slice(b0, min(batch, b0 + per_launch)) for b0 in range(0, batch, per_launch)]


def forward(q, k, v, scale: float, causal: bool, *, out=None, lse_out=None, config=None, mods: Mods = PLAIN):
    """Launch the kernel: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` (validated by the caller)
    -> ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)``. With varlen ``mods`` the inputs are packed ``(total, H, D)``
    and the outputs ``o [total_q, Hq, Dv]``, ``lse [Hq, total_q]``. ``out``/``lse_out`` let tests pass pre-poisoned
    buffers; ``config`` (a ``FwdConfig``) overrides the table, for the tile sweep.
    """
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    if not scale > 0:
        raise ValueError(f"scale: the kernels take scale > 0 (their row max precedes the scaling; the API passes -q "
                         f"or q · 0 for others, _validate.positive_scale), got {scale}")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    hq, hkv, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    rows = q.shape[:-2]  # (B, Sq), or (total_q,) packed
    o = torch.empty((*rows, hq, dv), dtype=q.dtype, device=q.device) if out is None else out
    lse_shape = (hq, q.shape[0]) if mods.varlen else (q.shape[0], hq, q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if o.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("out and lse_out must be contiguous in their last dim")
    if mods is PLAIN and launch_cache.enabled and _repeat(q, k, v, o, lse, scale, causal, config):
        return o, lse
    if q.numel() == 0 or o.numel() == 0:
        return o, lse
    if k.shape[-3] == 0:  # no key at all: every row is empty (and a descriptor cannot have a zero-sized dim)
        o.zero_()
        if mods.sinks is None:
            return o, lse.fill_(float("-inf"))
        return o, lse.copy_(mods.sinks.view(hq, 1) if mods.varlen else mods.sinks.view(1, hq, 1))  # lse = the sink
    tma_ok = not mods.varlen and tma_aligned(k, v)  # a descriptor's bounds would be the whole pack, not a sequence
    gluon_ok = tma_ok and ws_ok(q, k, v, scale, mods) and o.dtype == q.dtype and tma_aligned(o)  # O leaves by TMA
    cfg = config or fwd_config(q.shape[-1], dv, q.dtype, causal, q.device.type, variants=mods is not PLAIN,
                               seqlen_q=mods.max_seqlen_q if mods.varlen else q.shape[1],
                               seqlen_k=mods.max_seqlen_k if mods.varlen else k.shape[1], tma_ok=tma_ok,
                               ws_ok=gluon_ok, hopper=mods.window_sinks_only, window=_window_span(mods, causal,
                                                                                                   k.shape[-3]))
    if cfg.gluon:  # one launch: its grid is one-dimensional (tiles), with no grid-y limit to slice the batch for
        if not gluon_ok:  # only an explicit config gets here so: the table picks gluon only where it can run
            raise ValueError("config: a gluon tile runs only plain (or window and sinks only) half-precision calls "
                             "on sm_90 with equal head dims, "
                             "a positive scale, TMA-aligned q, k, v and out, and out of q's dtype")
        check_int32_offsets(lse=lse)  # the kernel's offsets within a batch entry are int32 (Q, K, V and O go by TMA)
        keep = mods is PLAIN and launch_cache.enabled  # kept: a repeat skips the routing above (_repeat)
        band, sinks = (None, None) if mods is PLAIN else (mods.band(causal), mods.sinks)  # what ws_ok lets through
        grid, kept = forward_sm90.launch(q, k, v, o, lse, scale, causal, cfg, keep=keep, band=band,  # a 1-D grid
                                         sinks=None if sinks is None else sinks.float().contiguous())
        if keep:
            bounded_put(_STEPS, _step_key(q, k, v, o, lse, scale, causal, config), (cfg, True, grid, kept), _MAX_STEPS)
        return o, lse
    use_tma = cfg.tma and tma_ok
    if mods.varlen:  # one launch over packed [1, total, H, D] views; each program finds its sequence
        q4, k4, v4, o4, lse3 = q[None], k[None], v[None], o[None], lse[None]
        check_int32_offsets(q=q4[:, : mods.max_seqlen_q], k=k4[:, : mods.max_seqlen_k], v=v4[:, : mods.max_seqlen_k],
                            o=o4[:, : mods.max_seqlen_q], lse=lse3)
        for seqs in batch_slices(mods.cu_seqlens_q.shape[0] - 1, hkv):
            _launch(q4, k4, v4, o4, lse3, scale, causal, cfg, use_tma, mods.batch_slice(seqs))
        return o, lse
    check_int32_offsets(q=q, o=o, lse=lse, **({} if use_tma else {"k": k, "v": v}))  # descriptors index K/V
    for batch in batch_slices(q.shape[0], hkv):
        if batch == slice(0, q.shape[0]):  # the whole batch: no views to make (each costs host time)
            keep = mods is PLAIN and launch_cache.enabled  # a plain call is kept for its repeats (_repeat)
            kept = _launch(q, k, v, o, lse, scale, causal, cfg, use_tma, mods, keep=keep)
            if keep:
                key = _step_key(q, k, v, o, lse, scale, causal, config)
                bounded_put(_STEPS, key, (cfg, use_tma, *kept), _MAX_STEPS)
        else:
            _launch(q[batch], k[batch], v[batch], o[batch], lse[batch], scale, causal, cfg, use_tma,
                    mods.batch_slice(batch))
    return o, lse


def variant_args(mods: Mods, causal: bool, scale: float, b: int, hq: int, sq: int, sk: int) -> dict:
    """The kernels' variant arguments for a launch over ``b`` batch entries: the flags, and the inputs each flag
    reads (None or 0 where unused, so the plain kernels compile as they always have)."""
    if mods is PLAIN:
        return _PLAIN_ARGS
    band = mods.band(causal)
    slopes, bias, stride_sb, bias_strides = mods.alibi_slopes, mods.attn_bias, 0, (0, 0, 0, 0)
    contiguous = lambda x: None if x is None else x.contiguous()  # the kernels index heads and offsets with stride 1
    slopes, sinks, cu_q, cu_k = (contiguous(x) for x in (slopes, mods.sinks, mods.cu_seqlens_q, mods.cu_seqlens_k))
    if slopes is not None and slopes.dim() == 2:
        stride_sb = slopes.stride(0)
    if bias is not None:  # a broadcast view of [B, Hq, Sq, Sk]: its zero strides repeat the broadcast dims
        bias = bias_4d(bias).expand(b, hq, sq, sk)
        bias_strides = bias.stride()
    softcap = mods.softcap
    return dict(
        CU_Q=cu_q, CU_K=cu_k, SLOPES=slopes, BIAS=bias, SINKS=sinks, RNG=mods.rng,
        stride_sb=stride_sb, stride_bb=bias_strides[0], stride_bh=bias_strides[1], stride_bi=bias_strides[2],
        stride_bj=bias_strides[3], window_left=band[0] if band else 0, window_right=band[1] if band else 0,
        softcap_in=mods.softcap_in(scale, FLOAT32_MAX), softcap_out=softcap * LOG2E, dropout_p=mods.dropout_p,
        batch0=mods.batch0, VARLEN=mods.varlen, WINDOW=band is not None, SOFTCAP=softcap > 0,
        ALIBI=slopes is not None, HAS_BIAS=bias is not None, SINK=mods.sinks is not None, DROPOUT=mods.dropout,
    )


_PLAIN_ARGS = {  # what variant_args gives without variants, built once: the plain launch pays no Python for them
    **{name: None for name in ("CU_Q", "CU_K", "SLOPES", "BIAS", "SINKS", "RNG")},
    **{name: 0 for name in ("stride_sb", "stride_bb", "stride_bh", "stride_bi", "stride_bj", "window_left",
                            "window_right", "batch0")},
    **{name: 0.0 for name in ("softcap_in", "softcap_out", "dropout_p")},
    **{name: False for name in ("VARLEN", "WINDOW", "SOFTCAP", "ALIBI", "HAS_BIAS", "SINK", "DROPOUT")},
}


def _launch(q, k, v, o, lse, scale: float, causal: bool, cfg, use_tma: bool, mods: Mods = PLAIN,
            keep: bool = False):
    """Launch the kernel over q ``[B, Sq, Hq, D]`` (varlen: packed ``[1, total, H, D]`` views). With ``keep``, returns
    ``(grid, Relaunch or None)`` of the launch."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))
    k_arg, v_arg = k, v
    if use_tma:
        k_arg, v_arg = _kv_descriptors(k, v, cfg)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2])
    if mods.varlen:  # the grid covers the longest sequence; batch strides are 0 (pointers move per sequence)
        b, sq, sk = mods.cu_seqlens_q.shape[0] - 1, mods.max_seqlen_q, mods.max_seqlen_k
        strides = tuple(x for t, n in ((q, 3), (k, 3), (v, 3), (o, 3), (lse, 2)) for x in (0, *t.stride()[1:n]))
    grid = (cdiv(sq * group, cfg.block_m), b * hkv)
    return grid, start(
        keep, attention_fwd_kernel, grid, 5, q, k_arg, v_arg, o, lse, *strides,
        sq, sk, hkv, scale * LOG2E,
        **variant_args(mods, causal, scale, b, hq, sq, sk),
        GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv,
        BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal and mods.band(causal) is None, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_TMA=use_tma, WARP_SPECIALIZE=cfg.warp_specialize, HEADS_PER_GROUP=cfg.heads_per_group,
        PIPELINE=cfg.pipeline, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------------------------
# Repeats. A plain whole-batch call keeps its tile choice and its launch per metadata; a repeat swaps the tensors in
# (``Relaunch``) with descriptors around them (K's and V's; the Gluon kernel's Q's and O's too, which
# ``forward_sm90.descriptor`` keeps by address, so only new memory builds one). Where the relaunch declines (a hook
# set, an alignment changed...), nothing is launched and the call takes the full path, which keeps a fresh launch.

_STEPS: dict = {}  # metadata -> (tile, descriptor use, grid, Relaunch or None)
_MAX_STEPS = 256  # shapes a process sees are few; past this the table starts over


def _step_key(q, k, v, o, lse, scale, causal, config):
    """What a plain whole-batch launch depends on besides the data: shapes, strides, dtypes, device, scalars (with
    their types), and the base alignment of Q, K, V and O (``tma_aligned`` reads it)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.shape, o.stride(), lse.shape,
            lse.stride(), q.dtype, k.dtype, v.dtype, o.dtype, lse.dtype, q.device, scale, type(scale), causal,
            type(causal), config, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, o.data_ptr() % 16)


def _repeat(q, k, v, o, lse, scale, causal, config) -> bool:
    """Launch a plain forward seen before through its kept launch; False (nothing launched) where there is none."""
    step = _STEPS.get(_step_key(q, k, v, o, lse, scale, causal, config))
    if step is None or step[3] is None:
        return False
    cfg, use_tma, grid, relaunch = step
    if cfg.gluon:  # the key holds all that routed it there (device, dtypes, alignment...)
        return relaunch(grid, (*forward_sm90.descriptors(q, k, v, o, cfg), lse))
    k_arg, v_arg = _kv_descriptors(k, v, cfg) if use_tma else (k, v)
    return relaunch(grid, (q, k_arg, v_arg, o, lse))


# ---------------------------------------------------------------------------------------------------------------
# torch.library registration, so the kernel composes with autograd and torch.compile.


def _attention_fwd(q, k, v, scale, causal, *mod_args):
    return forward(q, k, v, scale, causal, mods=Mods.from_op_args(mod_args))


attention_fwd = torch.library.custom_op("onlineattn::attention_fwd", _attention_fwd, mutates_args=(),
                                        schema=FWD_SCHEMA)
attention_fwd.register_fake(fake_forward)


def _backward_op(*args):
    from .backward import attention_bwd  # imported here: backward.py builds on this module's launcher helpers

    return attention_bwd(*args)


def _backward_direct(do, q, k, v, o, lse, dlse, scale, causal, mods, bias_grad, deterministic):
    from .backward import gradients

    return gradients(do, q, k, v, o, lse, scale, causal, dlse, mods=mods, bias_grad=bias_grad,
                     deterministic=deterministic)


_formula = autograd_formula(_backward_op, _backward_direct)
attention_fwd.register_autograd(_formula, setup_context=save_for_backward)


class _EagerAttention(torch.autograd.Function):
    """The op's autograd without the op, for plain eager calls: the same setup_context and backward formula, minus
    the dispatcher's redispatch and torch.library's per-call filling of this schema's defaults (~80 µs of host per
    training call on the CPU machine, more than the launches)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, *mod_args):  # ctx-style: apply() then skips binding a signature
        output = _attention_fwd(q, k, v, scale, causal, *mod_args)
        save_for_backward(ctx, (q, k, v, scale, causal, *mod_args), output)
        return output

    backward = staticmethod(_formula)


class _EagerAttentionAnyOrder(_EagerAttention):
    """``_EagerAttention`` for ``deterministic=False``: its backward may take a tile that sums dQ in no fixed order
    (``fused_dq``, backward.py)."""

    @staticmethod
    def forward(ctx, *args):
        ctx.deterministic = False
        return _EagerAttention.forward(ctx, *args)


def attention(q, k, v, scale: float, causal: bool, mods: Mods = PLAIN, deterministic: bool = True):
    """Fused attention on the Triton path: ``(o, lse)``, differentiable.

    Through the custom op when torch.compile, a functorch transform (vmap: its tensors have no storage to launch on)
    or a tensor subclass is involved. Otherwise the launcher runs directly (under ``_EagerAttention`` when autograd
    needs a graph), which saves the dispatcher's Python overhead (tens of microseconds, as long as a whole
    small-shape kernel). ``deterministic=False`` lets that eager backward sum dQ in no fixed order where it is
    faster (backward.py); through the custom op the backward stays deterministic.
    """
    tensors = (q, k, v, mods.attn_bias, mods.sinks)
    needs_graph = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    if needs_graph or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        args = (q, k, v, scale, causal) if mods is PLAIN else (q, k, v, scale, causal, *mods.op_args())
        if needs_graph and plain_eager(*tensors, mods.alibi_slopes, mods.rng, mods.cu_seqlens_q, mods.cu_seqlens_k):
            return (_EagerAttention if deterministic else _EagerAttentionAnyOrder).apply(*args)
        return attention_fwd(*args)
    return forward(q, k, v, scale, causal, mods=mods)
