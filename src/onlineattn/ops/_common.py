"""Triton helpers shared by the kernels: the online-softmax step, the epilogue that turns (m, l, acc) into (o, lse), the
merge of partial states (natural log) and the page lookup of the KV caches.

Scores are kept in the log2 domain: ``x = s · scale · log2(e)``, so ``exp`` becomes ``exp2`` and the scale costs one
multiply folded into the max. ``m`` is the running max of x, ``l`` the running sum of ``2^(x − m)``.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One key block of the recurrence. ``qk`` holds raw scores ``[BLOCK_M, BLOCK_N]`` in float32 (hidden entries
    already ``-inf`` when ``MASKED``). Returns ``(p, m_new, l_new, acc_rescaled)``; the caller adds ``p @ v`` to acc.

    Only a masked block can leave a row with no visible key so far (``m_new = -inf``); there the max is replaced by 0
    so that ``2^(-inf - 0) = 0`` rather than NaN. Unmasked blocks skip that select.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_new, acc * alpha[:, None]


@triton.jit
def finalize_state(m_i, l_i, acc):
    """``o = acc / l`` and natural-log ``lse = (m + log2 l) · ln 2``; a row that saw nothing gets o = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return o, lse


@triton.jit
def packed_rows(start_r, off_hkv, seqlen_q, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``[start_r, start_r + BLOCK_M)`` of one kv head's packed GQA rows: row ``r`` is query ``r // GROUP`` of head
    ``off_hkv · GROUP + r % GROUP``, so a group's query heads share each K/V read. Returns (query, head, in range)."""
    o_r = start_r + tl.arange(0, BLOCK_M)
    return o_r // GROUP, off_hkv * GROUP + o_r % GROUP, o_r < seqlen_q * GROUP


@triton.jit
def key_range(start_r, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
              CAUSAL: tl.constexpr):
    """Keys a tile of packed rows visits: ``[0, full_hi)`` in whole blocks every row sees (no mask work), then
    ``[full_hi, hi)`` with the mask (the causal diagonal and the end of the keys). Keys past ``hi`` are hidden from
    every row of the tile and never loaded. Query i sees key j when ``j <= i + seqlen_k - seqlen_q`` (bottom right)."""
    hi = seqlen_k
    full_hi = seqlen_k
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        first_q = start_r // GROUP
        last_q = tl.minimum((start_r + BLOCK_M - 1) // GROUP, seqlen_q - 1)
        hi = tl.maximum(tl.minimum(seqlen_k, last_q + diag + 1), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, first_q + diag + 1), 0)
    return (full_hi // BLOCK_N) * BLOCK_N, hi


@triton.jit
def merge_state_step(m, l, acc, lse, o):
    """Fold one partial state into a running merge: ``lse [R]`` (natural log) and ``o [R, DV]``, both float32.

    The running state is ``m`` (largest lse so far), ``l = Σ exp(lse_s − m)`` and ``acc = Σ exp(lse_s − m) · o_s``; it
    starts at ``(-inf, 0, 0)``. An empty part (lse = -inf) adds nothing, even where its o holds garbage, and a max that
    is still -inf is replaced by 0 so that ``exp(-inf − m)`` is 0 rather than NaN.
    """
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse - m_safe)
    acc = acc * alpha[:, None] + tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0)
    return m_new, l * alpha + w, acc


@triton.jit
def finalize_merge(m, l, acc):
    """``o = acc / l`` and ``lse = m + ln l`` of a merge; where every part was empty, o = 0 and lse = -inf.

    A single non-empty part comes back bit for bit: its weight is ``exp(0) = 1``.
    """
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), m + tl.log(l_safe))


@triton.jit
def page_and_slot(BLOCK_TABLE, off_bt, off_b, pos, mask, PAGE_SIZE: tl.constexpr):
    """Where key position ``pos`` (a block or a scalar) of batch entry ``off_b`` lives in a KV cache.

    Paged (``PAGE_SIZE > 0``): the page id from row ``off_bt`` of the block table (as int64: a page pool may span more
    than 2^31 elements) and the slot within that page. Contiguous (``PAGE_SIZE == 0``): the cache is one page per batch
    entry, so the page is ``off_b`` and the slot is ``pos``. The element offset is ``page · stride_page + slot ·
    stride_slot``; ``mask`` keeps the block-table read inside the sequence.
    """
    if PAGE_SIZE > 0:
        page = tl.load(BLOCK_TABLE + off_bt + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
    else:
        page = off_b
        slot = pos
    return page, slot
