"""Merging partial attention states in Triton: two states (``merge_states``) or ``S`` along a leading split dimension
(``merge_states_list``, the second half of split-KV decoding).

Read top-down: the state load, the kernel, then the launchers.

A state over a set of keys is ``(o, lse)``: ``o [B, Sq, H, Dv]`` normalised output, ``lse [B, H, Sq]`` natural
log-sum-exp. Parts over disjoint key sets merge exactly: with weights ``w_s = exp(lse_s − max lse)``,
``o = Σ w_s o_s / Σ w_s`` and ``lse = max lse + ln Σ w_s``. Everything is float32 inside (``merge_state_step`` and
``finalize_merge`` in ``_common.py``); an empty part (lse = -inf) is neutral and all-empty rows give o = 0, lse = -inf.

A program owns ``BLOCK_R`` rows of one batch entry: row ``r`` is query ``r // H`` of head ``r % H``, so for decoding
(Sq = 1) one program covers a block of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import finalize_merge, merge_state_step
from ._configs import merge_config
from .forward import KERNEL_DTYPES, _last_dim_contiguous, batch_slices, check_int32_offsets


@triton.jit
def _load_state(p_o, p_lse, m_r, m_dv):
    """One part's ``(lse [BLOCK_R], o [BLOCK_R, BLOCK_DV])`` in float32; rows outside the tensor read as empty."""
    lse = tl.load(p_lse, mask=m_r, other=float("-inf")).to(tl.float32)
    o = tl.load(p_o, mask=m_r[:, None] & m_dv[None, :], other=0.0).to(tl.float32)
    return lse, o


@triton.jit
def merge_states_kernel(
    OS, LSES, OB, LSEB, O, LSE,
    stride_osz, stride_osb, stride_oss, stride_osh,
    stride_lsz, stride_lsb, stride_lsh, stride_lss,
    stride_obb, stride_obs, stride_obh,
    stride_lbb, stride_lbh, stride_lbs,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    num_splits, seqlen, heads,
    HAS_B: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge ``num_splits`` states stacked in ``OS [S, B, Sq, H, Dv]``, ``LSES [S, B, H, Sq]`` and, with ``HAS_B``, one
    more state ``OB [B, Sq, H, Dv]``, ``LSEB [B, H, Sq]`` (the pairwise merge is one stacked state plus B)."""
    pid_r = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    o_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_i, o_h, m_r = o_r // heads, o_r % heads, o_r < seqlen * heads
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < HEAD_DIM_V

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    p_o = OS + off_b * stride_osb + o_i[:, None] * stride_oss + o_h[:, None] * stride_osh + o_dv[None, :]
    p_lse = LSES + off_b * stride_lsb + o_h * stride_lsh + o_i * stride_lss
    for _ in range(num_splits):  # pointers advance split by split, in 64 bits: S·B·Sq·H·Dv may pass 2^31
        lse_s, o_s = _load_state(p_o, p_lse, m_r, m_dv)
        m, l, acc = merge_state_step(m, l, acc, lse_s, o_s)
        p_o += stride_osz
        p_lse += stride_lsz
    if HAS_B:
        lse_s, o_s = _load_state(
            OB + off_b * stride_obb + o_i[:, None] * stride_obs + o_h[:, None] * stride_obh + o_dv[None, :],
            LSEB + off_b * stride_lbb + o_h * stride_lbh + o_i * stride_lbs, m_r, m_dv,
        )
        m, l, acc = merge_state_step(m, l, acc, lse_s, o_s)

    b_o, b_lse = finalize_merge(m, l, acc)
    p_out = O + off_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh + o_dv[None, :]
    tl.store(p_out, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    tl.store(LSE + off_b * stride_lb + o_h * stride_lh + o_i * stride_ls, b_lse, mask=m_r)


# ---------------------------------------------------------------------------------------------------------------
# Launchers. Shapes and dtypes are validated by the caller (api.py); these only adapt strides and pick the tile.


def _outputs(o_like: torch.Tensor, lse_shape, out, lse_out):
    """``out`` (default: o_like's shape and dtype) and ``lse_out`` (default: float32), both stride 1 in the last dim."""
    o = torch.empty_like(o_like, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty(lse_shape, dtype=torch.float32, device=o_like.device) if lse_out is None else lse_out
    if o.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dim")
    return o, lse


def _launch(os, lses, o_b, lse_b, o, lse) -> None:
    """``os [S, B, Sq, H, Dv]``, ``lses [S, B, H, Sq]``, optionally one more state ``o_b``/``lse_b``, into o and lse."""
    splits, b, sq, h, dv = os.shape
    if b * sq * h == 0:
        return
    check_int32_offsets(os=os[0], lses=lses[0], o=o, lse=lse)  # offsets within one (split, batch entry)
    has_b = o_b is not None
    if has_b:
        check_int32_offsets(o_b=o_b, lse_b=lse_b)
    cfg = merge_config(os.device.type)
    for rows in batch_slices(b, 1):
        part_b = (o_b[rows], lse_b[rows]) if has_b else (o[rows], lse[rows])  # placeholders when there is no B
        part_o, part_lse, oo, lo = os[:, rows], lses[:, rows], o[rows], lse[rows]
        merge_states_kernel[(triton.cdiv(sq * h, cfg.block_rows), rows.stop - rows.start)](
            part_o, part_lse, *part_b, oo, lo,
            *part_o.stride()[:4], *part_lse.stride(),
            *part_b[0].stride()[:3], *part_b[1].stride(),
            *oo.stride()[:3], *lo.stride(),
            splits, sq, h,
            HAS_B=has_b, HEAD_DIM_V=dv, BLOCK_R=cfg.block_rows, BLOCK_DV=max(16, triton.next_power_of_2(dv)),
            num_warps=cfg.num_warps,
        )


def merge_states(o_a, lse_a, o_b, lse_b, *, out=None, lse_out=None):
    """``o_a, o_b [B, Sq, H, Dv]`` and ``lse_a, lse_b [B, H, Sq]`` -> ``(o [B, Sq, H, Dv], lse [B, H, Sq] float32)``,
    o in o_a's dtype unless ``out`` says otherwise. Any strides; o's last dim is copied if it is not contiguous."""
    if o_a.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton merge takes float16, bfloat16 or float32 states; o_a has dtype {o_a.dtype}")
    o_a, o_b = _last_dim_contiguous(o_a), _last_dim_contiguous(o_b)
    b, sq, h, _ = o_a.shape
    o, lse = _outputs(o_a, (b, h, sq), out, lse_out)
    _launch(o_a[None], lse_a[None], o_b, lse_b, o, lse)
    return o, lse


def merge_states_list(os, lses, *, out=None, lse_out=None):
    """``os [S, B, Sq, H, Dv]`` and ``lses [S, B, H, Sq]`` (S >= 1) -> ``(o [B, Sq, H, Dv], lse [B, H, Sq] float32)``,
    o in os' dtype unless ``out`` says otherwise (split-KV decoding merges float32 partials into q's dtype)."""
    if os.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton merge takes float16, bfloat16 or float32 states; os has dtype {os.dtype}")
    os = _last_dim_contiguous(os)
    _, b, sq, h, _ = os.shape
    o, lse = _outputs(os[0], (b, h, sq), out, lse_out)
    _launch(os, lses, None, None, o, lse)
    return o, lse
