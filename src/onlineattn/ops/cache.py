"""Appending new keys and values into a KV cache in place, in Triton: one program copies one new token's heads.

Caches are contiguous ``[B, L_max, Hkv, D]`` or paged ``[num_pages, page_size, Hkv, D]`` with a block table
``[B, max_pages]`` (``page_and_slot`` in ``_common.py`` maps a position to its page and slot). Token ``t`` of the new
``k [B, S_new, Hkv, D]`` lands at position ``cache_seqlens[b] + t``. The lengths are read on the device, so a decode
step needs no host synchronisation; the caller has checked that every position lies inside its sequence's pages.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import page_and_slot
from ._launch import next_power_of_2
from .forward import check_int32_offsets


@triton.jit
def append_kv_kernel(
    KNEW, VNEW, K, V, CACHE_SEQLENS, BLOCK_TABLE,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb,
    seqlen_new, heads_kv,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    off_b = (pid // seqlen_new).to(tl.int64)
    off_t = pid % seqlen_new
    pos = tl.load(CACHE_SEQLENS + off_b) + off_t
    # Every position written lies inside its sequence's pages (checked by the caller): the mask is all true.
    page, slot = page_and_slot(BLOCK_TABLE, off_b * stride_btb, off_b, pos, pos >= 0, PAGE_SIZE)

    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < heads_kv
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    m_k = m_h[:, None] & (o_d < HEAD_DIM)[None, :]
    m_v = m_h[:, None] & (o_dv < HEAD_DIM_V)[None, :]
    b_k = tl.load(KNEW + off_b * stride_knb + off_t * stride_kns + o_h[:, None] * stride_knh + o_d[None, :], mask=m_k)
    b_v = tl.load(VNEW + off_b * stride_vnb + off_t * stride_vns + o_h[:, None] * stride_vnh + o_dv[None, :], mask=m_v)
    tl.store(K + page * stride_kp + slot * stride_ks + o_h[:, None] * stride_kh + o_d[None, :], b_k, mask=m_k)
    tl.store(V + page * stride_vp + slot * stride_vs + o_h[:, None] * stride_vh + o_dv[None, :], b_v, mask=m_v)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write ``k [B, S_new, Hkv, D]`` and ``v [B, S_new, Hkv, Dv]`` into the caches in place at positions
    ``cache_seqlens[b] + [0, S_new)``; ``cache_seqlens`` is int32 ``[B]`` on the caches' device. Any strides, as long as
    the last dims are contiguous (the caller has checked the caches; new tokens are copied if they are not)."""
    b, new, hkv, d = k.shape
    dv = v.shape[3]
    if b * new == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    paged = block_table is not None
    check_int32_offsets(k=k, v=v)
    if not paged:  # a contiguous cache is indexed in int32 within a batch entry (pages are indexed in int64)
        check_int32_offsets(k_cache=k_cache, v_cache=v_cache)
    table = block_table if paged else cache_seqlens  # any int32 tensor stands in when the cache is contiguous
    append_kv_kernel[(b * new,)](
        k, v, k_cache, v_cache, cache_seqlens, table,
        *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0,
        new, hkv,
        HEAD_DIM=d, HEAD_DIM_V=dv,
        BLOCK_H=next_power_of_2(hkv), BLOCK_D=next_power_of_2(d), BLOCK_DV=next_power_of_2(dv),
        PAGE_SIZE=k_cache.shape[1] if paged else 0,
        num_warps=4,
    )
