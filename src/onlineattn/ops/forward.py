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

from ..torch_impl import save_for_backward
from ._common import LOG2E, finalize_state, key_range, online_softmax_step, packed_rows
from ._configs import fwd_config


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_kv, qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # Causal tiles near the bottom have the most key blocks: launch them first so the tail of the grid is short.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // heads_kv  # int32 coordinate for tensor descriptors
    off_b = pid_b.to(tl.int64)  # int64 for pointer arithmetic: B·S·H·D may pass 2^31
    off_hkv = pid_bh % heads_kv

    o_i, o_h, m_r = packed_rows(pid_m * BLOCK_M, off_hkv, seqlen_q, BLOCK_M, GROUP)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

    p_q = Q + off_b * stride_qb + o_i[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    if not USE_TMA:
        p_kt = K + off_b * stride_kb + off_hkv * stride_kh + o_n[None, :] * stride_ks + o_d[:, None]
        p_v = V + off_b * stride_vb + off_hkv * stride_vh + o_n[:, None] * stride_vs + o_dv[None, :]

    full_hi, hi = key_range(pid_m * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, GROUP, CAUSAL)
    diag = seqlen_k - seqlen_q  # query i sees key j when j <= i + diag

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for start_n in tl.range(0, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        if USE_TMA:  # K and V are [B, Sk, Hkv, D] tensor descriptors; the copy engine zero-fills past the end
            b_kt = tl.trans(K.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            b_kt = tl.load(p_kt + start_n * stride_ks, mask=m_d[:, None], other=0.0)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=False)
        if USE_TMA:
            b_v = V.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            b_v = tl.load(p_v + start_n * stride_vs, mask=m_dv[None, :], other=0.0)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    for start_n in range(full_hi, hi, BLOCK_N):
        m_n = (start_n + o_n) < seqlen_k
        if USE_TMA:
            b_kt = tl.trans(K.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            b_kt = tl.load(p_kt + start_n * stride_ks, mask=m_d[:, None] & m_n[None, :], other=0.0)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        visible = m_n[None, :]
        if CAUSAL:
            visible = visible & ((start_n + o_n)[None, :] <= o_i[:, None] + diag)
        qk = tl.where(visible, qk, float("-inf"))
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=True)
        if USE_TMA:
            b_v = V.load([pid_b, start_n, off_hkv, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            b_v = tl.load(p_v + start_n * stride_vs, mask=m_n[:, None] & m_dv[None, :], other=0.0)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    b_o, b_lse = finalize_state(m_i, l_i, acc)
    p_o = O + off_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh + o_dv[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    tl.store(LSE + off_b * stride_lb + o_h * stride_lh + o_i, b_lse, mask=m_r)


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _tma_ok(*tensors) -> bool:
    """The copy engine needs a 16-byte aligned base and 16-byte multiples for the outer strides (Triton's interpreter
    emulates descriptors on CPU tensors, so tests reach this path there too)."""
    return all(
        x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
        for x in tensors
    )


# CUDA caps the grid's second axis (one program column per (batch, kv head)); larger batches launch in slices.
MAX_GRID_Y = 65535
INT32_LIMIT = 2**31


def check_int32_offsets(**tensors) -> None:
    """The kernels add offsets within one batch entry in int32 (the batch offset is int64): the largest must fit."""
    for name, x in tensors.items():
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


def forward(q, k, v, scale: float, causal: bool, *, out=None, lse_out=None, config=None):
    """Launch the kernel: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` (validated by the caller)
    -> ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)``. ``out``/``lse_out`` let tests pass pre-poisoned buffers;
    ``config`` (a ``FwdConfig``) overrides the table, for the tile sweep.
    """
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    o = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if o.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("out and lse_out must be contiguous in their last dim")
    if b * sq * hq == 0:
        return o, lse
    if k.shape[1] == 0:  # no key at all: every row is empty (and a descriptor cannot have a zero-sized dim)
        return o.zero_(), lse.fill_(float("-inf"))
    cfg = config or fwd_config(q.shape[3], dv, q.dtype, causal, q.device.type)
    use_tma = cfg.tma and _tma_ok(k, v)
    check_int32_offsets(q=q, o=o, lse=lse, **({} if use_tma else {"k": k, "v": v}))  # descriptors index K/V
    for rows in batch_slices(b, hkv):
        _launch(q[rows], k[rows], v[rows], o[rows], lse[rows], scale, causal, cfg, use_tma)
    return o, lse


def _launch(q, k, v, o, lse, scale: float, causal: bool, cfg, use_tma: bool) -> None:
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    k_arg, v_arg = k, v
    if use_tma:
        k_arg = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, cfg.block_n, 1, block_d])
        v_arg = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, cfg.block_n, 1, block_dv])
    grid = (triton.cdiv(sq * group, cfg.block_m), b * hkv)
    attention_fwd_kernel[grid](
        q, k_arg, v_arg, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        sq, sk, hkv, scale * LOG2E,
        GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv,
        BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_TMA=use_tma, WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------------------------
# torch.library registration, so the kernel composes with autograd and torch.compile.


@torch.library.custom_op("onlineattn::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[
    torch.Tensor, torch.Tensor
]:
    return forward(q, k, v, scale, causal)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, scale, causal):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


def _backward(ctx, do, dlse):
    from .backward import attention_bwd  # imported here: backward.py builds on this module's launcher helpers

    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, dlse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


attention_fwd.register_autograd(_backward, setup_context=save_for_backward)


def attention(q, k, v, scale: float, causal: bool):
    """Fused attention on the Triton path: ``(o, lse)``, differentiable.

    Through the custom op when autograd or torch.compile needs it; otherwise the launcher is called directly, which
    saves the dispatcher's Python overhead (tens of microseconds, as long as a whole small-shape kernel).
    """
    needs_graph = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_graph or torch.compiler.is_compiling():
        return attention_fwd(q, k, v, scale, causal)
    return forward(q, k, v, scale, causal)
