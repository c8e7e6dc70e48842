"""Split-KV decoding (flash-decoding) in Triton: attention of a few query tokens over a long KV cache.

Read top-down: the split kernel, then the launcher (append the new tokens, choose the splits, launch, merge).

Decoding reads every cached K/V byte once per step and does little arithmetic on it, so the kernel is built to keep
the memory system busy:

- GQA packing. A program owns one (sequence, kv head) and all the query rows of its group: row ``r`` is query token
  ``r // GROUP`` of head ``kv_head · GROUP + r % GROUP`` (as in ``forward.py``), so K and V are read once for the
  whole group. With many query tokens (chunked prefill) rows beyond ``BLOCK_M`` run as further programs.
- Split-KV. With few (sequence, kv head) pairs there are too few programs to fill the GPU, so the key range of each
  sequence is cut into ``num_splits`` chunks processed in parallel. Each writes a float32 partial state
  ``(o_partial [S, B, Sq, Hq, Dv], lse_partial [S, B, Hq, Sq])`` and ``merge.py`` combines them exactly. A sequence's
  chunks follow its own length (read on the device), so sequences of different lengths split evenly. With one split
  the kernel writes o and lse directly.
- Caches. Contiguous ``[B, L_max, Hkv, D]`` or paged ``[num_pages, page_size, Hkv, D]``: for a paged cache each key
  block gathers its page ids from the block table (``page_and_slot``), so a block may span pages and any page size
  that is a multiple of 16 works with any block size.

Causal masking is bottom-right over the ``cache_seqlens[b] + S_new`` visible keys: query i sees key j when
``j <= i + L_b − Sq``. Key blocks that every row of the program sees whole take the unmasked loop; the rest (the
diagonal and the end of the sequence) the masked one; blocks no row sees are never loaded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import cache, merge
from ._common import LOG2E, finalize_state, key_range, online_softmax_step, packed_rows, page_and_slot
from ._configs import INTERPRETER_SMS, decode_config, decode_num_splits
from .forward import KERNEL_DTYPES, MAX_GRID_Y, _last_dim_contiguous, check_int32_offsets


@triton.jit
def _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, pos, m_n, o_d, o_dv, m_d, m_dv,
                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE: tl.constexpr):
    """Keys at positions ``pos [BLOCK_N]`` as ``kᵀ [BLOCK_D, BLOCK_N]`` and values ``[BLOCK_N, BLOCK_DV]``; positions
    outside ``m_n`` read as zeros (their scores are masked by the caller)."""
    page, slot = page_and_slot(BLOCK_TABLE, off_bt, off_b, pos, m_n, PAGE_SIZE)
    p_kt = K + (page * stride_kp + slot * stride_ks + off_hkv * stride_kh)[None, :] + o_d[:, None]
    p_v = V + (page * stride_vp + slot * stride_vs + off_hkv * stride_vh)[:, None] + o_dv[None, :]
    b_kt = tl.load(p_kt, mask=m_d[:, None] & m_n[None, :], other=0.0)
    b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)
    return b_kt, b_v


@triton.jit
def decode_split_kernel(
    Q, K, V, CACHE_SEQLENS, BLOCK_TABLE, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb,
    stride_oz, stride_ob, stride_os, stride_oh,
    stride_lz, stride_lb, stride_lh,
    seqlen_q, seqlen_new, heads_kv, num_splits, qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = pid_bh % heads_kv
    off_bt = off_b * stride_btb
    seqlen_k = tl.load(CACHE_SEQLENS + off_b) + seqlen_new

    o_i, o_h, m_r = packed_rows(pid_m * BLOCK_M, off_hkv, seqlen_q, BLOCK_M, GROUP)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < HEAD_DIM
    m_dv = o_dv < HEAD_DIM_V

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
        b_kt, b_v = _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, pos, pos < seqlen_k, o_d, o_dv, m_d,
                                   m_dv, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=False)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    for start_n in range(full_hi, hi, BLOCK_N):
        pos = start_n + o_n
        m_n = pos < seqlen_k
        b_kt, b_v = _load_kv_block(K, V, BLOCK_TABLE, off_bt, off_b, off_hkv, pos, m_n, o_d, o_dv, m_d, m_dv,
                                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, PAGE_SIZE)
        qk = tl.dot(b_q, b_kt, input_precision=INPUT_PRECISION)
        visible = m_n[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= o_i[:, None] + diag)
        qk = tl.where(visible, qk, float("-inf"))
        p, m_i, l_i, acc = online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED=True)
        acc = tl.dot(p.to(b_v.dtype), b_v, acc, input_precision=INPUT_PRECISION)

    # Every program stores, even one whose chunk is empty (o = 0, lse = -inf): the merge reads every split.
    b_o, b_lse = finalize_state(m_i, l_i, acc)
    off_z = split.to(tl.int64)
    p_o = O + off_z * stride_oz + off_b * stride_ob + o_i[:, None] * stride_os + o_h[:, None] * stride_oh + o_dv[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_r[:, None] & m_dv[None, :])
    tl.store(LSE + off_z * stride_lz + off_b * stride_lb + o_h * stride_lh + o_i, b_lse, mask=m_r)


# ---------------------------------------------------------------------------------------------------------------
# Launcher.


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _alloc_partials(splits: int, b: int, sq: int, hq: int, dv: int, device):
    """Float32 partial states ``(o [S, B, Sq, Hq, Dv], lse [S, B, Hq, Sq])``; a function of its own so that tests can
    poison them."""
    return (torch.empty((splits, b, sq, hq, dv), dtype=torch.float32, device=device),
            torch.empty((splits, b, hq, sq), dtype=torch.float32, device=device))


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale: float, causal: bool,
                           num_splits: int, *, max_seqlen_k=None, out=None, lse_out=None, config=None):
    """Append ``k``/``v`` (if given) into the caches, then attend: ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32)``.

    ``q [B, Sq, Hq, D]``; caches ``[B, L_max, Hkv, D]`` or ``[num_pages, page_size, Hkv, D]`` with ``block_table
    [B, max_pages]`` int32; ``cache_seqlens`` int32 ``[B]``, on the device (validated by the caller, values included).
    ``num_splits = 0`` chooses with ``decode_num_splits`` from the grid, ``max_seqlen_k`` (if known, else the cache's
    capacity) and the SM count. ``out``/``lse_out`` let tests pass pre-poisoned buffers; ``config`` overrides the table.
    """
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32; q has dtype {q.dtype}")
    if k is not None:
        cache.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    q = _last_dim_contiguous(q)
    b, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    group = hq // hkv
    o = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if o.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("out and lse_out must be contiguous in their last dim")
    if b * sq * hq == 0:
        return o, lse

    cfg = config or decode_config(d, dv, q.dtype, q.device.type)
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(sq * group)))
    row_blocks = triton.cdiv(sq * group, block_m)
    if row_blocks > MAX_GRID_Y:
        raise ValueError(f"{sq} query tokens x {group} heads per kv head need {row_blocks} row blocks, beyond the "
                         f"decode kernel's limit of {MAX_GRID_Y}; use onlineattn.attention for long prefills")
    longest = capacity if max_seqlen_k is None else max_seqlen_k
    if num_splits == 0:
        num_splits = decode_num_splits(b * hkv * row_blocks, longest, _sm_count(q.device), cfg.block_n)
    num_splits = max(1, min(num_splits, triton.cdiv(longest, cfg.block_n)))  # more would only add empty chunks

    check_int32_offsets(q=q, o=o, lse=lse)
    if not paged:  # a contiguous cache is indexed in int32 within a batch entry (pages are indexed in int64)
        check_int32_offsets(k_cache=k_cache, v_cache=v_cache)
    if num_splits == 1:
        part_o, part_lse = o[None], lse[None]
    else:
        part_o, part_lse = _alloc_partials(num_splits, b, sq, hq, dv, q.device)
    decode_split_kernel[(b * hkv, row_blocks, num_splits)](
        q, k_cache, v_cache, cache_seqlens, block_table if paged else cache_seqlens, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0,
        *part_o.stride()[:4], *part_lse.stride()[:3],
        sq, 0 if k is None else k.shape[1], hkv, num_splits, scale * LOG2E,
        GROUP=group, HEAD_DIM=d, HEAD_DIM_V=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        PAGE_SIZE=page_size, CAUSAL=causal, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        merge.merge_states_list(part_o, part_lse, out=o, lse_out=lse)
    return o, lse
