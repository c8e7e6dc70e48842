"""Triton helpers shared by the kernels: the online-softmax step, the epilogue that turns (m, l, acc) into (o, lse), the
merge of partial states (natural log) and the page lookup of the KV caches; and whether tensors suit the copy engine
(``tma_aligned``).

Scores are kept in the log2 domain: ``x = s · scale · log2(e)``, so ``exp`` becomes ``exp2`` and the scale costs one
multiply folded into the max. ``m`` is the running max of x, ``l`` the running sum of ``2^(x − m)``.
"""

import triton
import triton.language as tl

from .._validate import LOG2E  # noqa: F401 (the launchers fold it into the scale)

LN2 = 0.6931471805599453


def tma_aligned(*tensors) -> bool:
    """The copy engine needs a 16-byte aligned base and 16-byte multiples for the outer strides (Triton's interpreter
    emulates descriptors on CPU tensors, so tests reach this path there too)."""
    for x in tensors:
        size = x.element_size()
        if x.data_ptr() % 16 or any(s * size % 16 for s in x.stride()[:-1]):
            return False
    return True


@triton.jit
def online_softmax_step(qk, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One key block of the recurrence. ``qk`` holds raw scores ``[BLOCK_M, BLOCK_N]`` in float32 (hidden entries
    already ``-inf`` when ``MASKED``). Returns ``(p, m_new, l_new, acc_rescaled)``; the caller adds ``p @ v`` to acc.

    Only a masked block can leave a row with no visible key so far (``m_new = -inf``); there 0 is subtracted in the
    max's place, so that ``2^(-inf - 0) = 0`` rather than NaN, and the max stays -inf. Unmasked blocks skip that
    select, so a row may enter one with ``m_i = -inf`` only because every row sees a key there (finite scores, since
    a bias makes every block masked): ``alpha = 2^(-inf - m) = 0`` scales an accumulator that is still 0.
    """
    p, m_new, l_new, alpha = softmax_probs(qk, m_i, l_i, qk_scale, MASKED)
    return p, m_new, l_new, acc * alpha[:, None]


@triton.jit
def softmax_probs(qk, m_i, l_i, qk_scale, MASKED: tl.constexpr):
    """``online_softmax_step`` without touching the accumulator: ``(p, m_new, l_new, alpha)``, where the caller owes
    ``acc * alpha`` before adding ``p @ v``. Lets a kernel defer that rescale (see the forward's pipelined loop)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = m_new
    if MASKED:
        # The 0 stands in for the subtraction only: kept as the running max, it would outlast the empty block and
        # hold a later max of all-negative scores at 0 (p = 2^s, flushed to 0 below s = -126: o = 0, lse = -inf).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_new, alpha


@triton.jit
def finalize_state(m_i, l_i, acc):
    """``o = acc / l`` and natural-log ``lse = (m + log2 l) · ln 2``; a row that saw nothing gets o = 0, lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return o, lse


@triton.jit
def tile_order(heads_per_group):
    """``(pid_m, pid_bh)`` of this program in a longest-first order over a grid ``(row tiles, batch · kv heads)``.

    The GPU hands out programs in launch order (``program_id(0)`` fastest). Taken in that order, the (batch, kv head)
    columns go by in groups of ``heads_per_group`` (a constexpr or a runtime int); within a group the row tiles run
    from the last (under causal masking, the one with the most key blocks) to the first, each across the group's
    heads. So the heaviest tiles of the last group start early and the grid ends on light ones, while the K/V being
    read at any moment belong to one group of heads and stay in L2. ``heads_per_group = 1`` is the plain order:
    each head's tiles, last to first. (The backward's kernels take it too, their tiles being key blocks for dK/dV.)
    """
    num_m = tl.num_programs(0)
    pid = tl.program_id(1).to(tl.int64) * num_m + tl.program_id(0)
    return tile_of(pid, num_m, tl.num_programs(1), heads_per_group)


@triton.jit
def tile_of(pid, num_m, num_bh, heads_per_group):
    """``tile_order`` of linear program (or persistent tile) index ``pid`` over ``num_m`` tiles of ``num_bh`` (batch,
    kv head) columns."""
    per_group = heads_per_group * num_m
    first_bh = pid // per_group * heads_per_group
    heads = tl.minimum(num_bh - first_bh, heads_per_group)  # the last group may be short
    r = pid % per_group
    return (num_m - 1 - r // heads).to(tl.int32), (first_bh + r % heads).to(tl.int32)


@triton.jit
def packed_rows(start_r, off_hkv, seqlen_q, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``[start_r, start_r + BLOCK_M)`` of one kv head's packed GQA rows: row ``r`` is query ``r // GROUP`` of head
    ``off_hkv · GROUP + r % GROUP``, so a group's query heads share each K/V read. Returns (query, head, in range)."""
    o_r = start_r + tl.arange(0, BLOCK_M)
    return o_r // GROUP, off_hkv * GROUP + o_r % GROUP, o_r < seqlen_q * GROUP


@triton.jit
def row_tile(start_r, off_hkv, seqlen_q, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The indices a kernel owning packed rows ``[start_r, start_r + BLOCK_M)`` works with: the rows' (query, head,
    in range) from ``packed_rows``, the head-dim offsets of q/k and v with their masks (dims padded to powers of
    two), and the key offsets of one block: ``(o_i, o_h, m_r, o_d, o_dv, o_n, m_d, m_dv)``."""
    o_i, o_h, m_r = packed_rows(start_r, off_hkv, seqlen_q, BLOCK_M, GROUP)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    return o_i, o_h, m_r, o_d, o_dv, tl.arange(0, BLOCK_N), o_d < HEAD_DIM, o_dv < HEAD_DIM_V


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
def merge_splits(p_o, p_lse, split_stride_o, split_stride_lse, num_splits, m_r, m_dv,
                 BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_STAGES: tl.constexpr):
    """Merge the ``num_splits`` partial states of one program's rows (``p_o [BLOCK_M, BLOCK_DV]`` and ``p_lse
    [BLOCK_M]``: split 0's pointers, the others ``split_stride_*`` elements on), always in split order 0, 1, ..., so
    the result does not depend on which split finished last (split-KV decoding; the Hopper forward's split tail).
    With ``MERGE_STAGES > 1`` the loop is software-pipelined: the partials of the next splits are on their way
    (``cp.async`` into shared memory) while one is folded in, rather than one L2 round trip per split.

    Ordering, in decoding: the caller's acq_rel counter orders these loads after the other splits' stores (in SASS
    the atomic is followed by an L1 invalidation and a barrier before the first load). The ``.cg`` hint is kept where
    Triton can: 4-byte ``cp.async`` copies (the lse loads of the pipelined loop) only exist as ``.ca``, which the
    acquire makes safe all the same."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s in tl.range(0, num_splits, num_stages=MERGE_STAGES):
        lse_s = tl.load(p_lse + s * split_stride_lse, mask=m_r, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(p_o + s * split_stride_o, mask=m_r[:, None] & m_dv[None, :], other=0.0, cache_modifier=".cg")
        m, l, acc = merge_state_step(m, l, acc, lse_s, o_s)
    return finalize_merge(m, l, acc)


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


# ---- score variants (issue #6; onlineattn._mods has their definitions) ---------------------------------------------
# Index arguments ``i`` (query), ``j`` (key) and ``h`` (query head) are blocks that broadcast against the score tile,
# so the same helper serves a tile ``[rows, keys]`` and its transpose ``[keys, rows]`` (the dK/dV kernel's).
# The kernels pass the variants' runtime arguments as one tuple ``vargs``, read only under their constexpr flags:
#   (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_q, window_left, window_right,
#    softcap_in, softcap_out, dropout_p, batch0)
# built as a tuple literal in each kernel (a jit function cannot return the None that unused pointers are).


@triton.jit
def tanh(x):
    """tanh in float32 to a few ulps: a Taylor series near 0, where ``(1 − e) / (1 + e)`` with ``e = exp(−2|x|)``
    loses digits to cancellation, that ratio elsewhere. (libdevice's tanh has no interpreter implementation.)"""
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(ax < 0.125, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def sequence_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``(q_start, k_start, seqlen_q, seqlen_k)`` of batch entry ``pid_b``: a packed sequence's offsets and lengths
    from ``cu_seqlens`` with ``VARLEN``, else offsets 0 and the lengths given."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_Q + pid_b)
        k_start = tl.load(CU_K + pid_b)
        seqlen_q = tl.load(CU_Q + pid_b + 1) - q_start
        seqlen_k = tl.load(CU_K + pid_b + 1) - k_start
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def _split_range(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Order a visited range ``[lo, hi)`` (``lo`` block aligned) around its whole-block part ``[full_lo, full_hi)``
    so that ``lo <= full_lo <= full_hi <= hi``: an empty whole part collapses onto ``full_lo``."""
    lo = (lo // BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_key_range(start_r, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Keys a tile of packed rows visits under a sliding window (query i sees key j when ``i + diag − left <= j <=
    i + diag + right``): masked ``[lo, full_lo)``, whole ``[full_lo, full_hi)``, masked ``[full_hi, hi)``. Blocks
    outside ``[lo, hi)`` are hidden from every row of the tile and never loaded, so a tile costs O(window)."""
    diag = seqlen_k - seqlen_q
    first_q = start_r // GROUP
    last_q = tl.minimum((start_r + BLOCK_M - 1) // GROUP, seqlen_q - 1)
    lo = tl.maximum(first_q + diag - window_left, 0)
    hi = tl.maximum(tl.minimum(last_q + diag + window_right + 1, seqlen_k), 0)
    full_lo = tl.cdiv(tl.maximum(last_q + diag - window_left, 0), BLOCK_N) * BLOCK_N
    full_hi = (tl.minimum(first_q + diag + window_right + 1, seqlen_k) // BLOCK_N) * BLOCK_N
    return _split_range(lo, full_lo, full_hi, hi, BLOCK_N)


@triton.jit
def band_row_range(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """Packed query rows a block of keys ``[start_n, start_n + BLOCK_N)`` visits under a sliding window, split as
    ``band_key_range``'s keys: query i sees key j when ``j − diag − right <= i <= j − diag + left``."""
    diag = seqlen_k - seqlen_q
    end_n = start_n + BLOCK_N - 1
    # Clamp queries to [0, seqlen_q] before scaling by GROUP: an unbounded side is 2^30 and must not overflow.
    i_lo = tl.minimum(tl.maximum(start_n - diag - window_right, 0), seqlen_q)
    i_hi = tl.minimum(tl.maximum(end_n - diag + window_left + 1, 0), seqlen_q)
    i_full_lo = tl.minimum(tl.maximum(end_n - diag - window_right, 0), seqlen_q)
    i_full_hi = tl.minimum(tl.maximum(start_n - diag + window_left + 1, 0), seqlen_q)
    return _split_range(i_lo * GROUP, tl.cdiv(i_full_lo * GROUP, BLOCK_M) * BLOCK_M,
                        (i_full_hi * GROUP // BLOCK_M) * BLOCK_M, i_hi * GROUP, BLOCK_M)


@triton.jit
def visible(i, j, m_j, diag, vargs, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """True where query i sees key j: ``m_j`` (j inside the keys), then bottom-right causal or inside the window."""
    (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_q, window_left, window_right,
     softcap_in, softcap_out, dropout_p, batch0) = vargs
    vis = m_j
    if CAUSAL:
        vis = vis & (j <= i + diag)
    if WINDOW:
        vis = vis & (j <= i + diag + window_right) & (j >= i + diag - window_left)
    return vis


@triton.jit
def score_mod(qk, i, j, h, b, m_ij, diag, qk_scale, vargs, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """Raw scores ``q·k`` -> logits in the log2 domain: ``softcap · tanh(scale · q·k / softcap)``, minus ALiBi's
    ``slope_h · |i + diag − j|``, plus ``attn_bias[b, h, i, j]`` (read where ``m_ij``), all times log2 e
    (``softcap_in = scale / softcap``, ``softcap_out = softcap · log2 e``). Returns the logits and the softcap's tanh
    (its derivative is ``1 − tanh²``; the raw scores without a softcap)."""
    (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_q, window_left, window_right,
     softcap_in, softcap_out, dropout_p, batch0) = vargs
    th = qk
    if SOFTCAP:
        th = tanh(qk * softcap_in)
        x = th * softcap_out
    else:
        x = qk * qk_scale
    if ALIBI:
        slope = tl.load(SLOPES + b * stride_sb + h).to(tl.float32) * 1.4426950408889634
        x -= slope * tl.abs(i + diag - j).to(tl.float32)
    if HAS_BIAS:
        p_bias = BIAS + b * stride_bb + h.to(tl.int64) * stride_bh + i.to(tl.int64) * stride_bi + j * stride_bj
        x += tl.load(p_bias, mask=m_ij, other=0.0).to(tl.float32) * 1.4426950408889634
    return x, th


@triton.jit
def dropout_keep(RNG, i, j, h, b, heads_q, dropout_p):
    """Dropout's keep decision for elements ``(b, h, i, j)``: ``u > p`` for the first word of Philox-4x32-10 with key
    ``(seed_lo, seed_hi)`` and counter ``(j, i, b·Hq + h, offset)``, ``RNG`` holding ``(seed_lo, seed_hi, offset)``
    (int64). ``onlineattn.dropout`` draws the same words in torch."""
    seed = (tl.load(RNG + 1) << 32) | tl.load(RNG)
    zero = (i + j) * 0
    c0 = (j + zero).to(tl.int32)
    c1 = (i + zero).to(tl.int32)
    c2 = (b * heads_q + h + zero).to(tl.int32)
    c3 = (tl.load(RNG + 2) + zero).to(tl.int32)
    word, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(word) > dropout_p


@triton.jit
def keep_scale(i, j, h, b, vargs):
    """Dropout's ``Z / (1 − p)``: ``1 / (1 − p)`` where ``dropout_keep`` keeps an element, 0 where it drops it."""
    (SLOPES, BIAS, RNG, stride_sb, stride_bb, stride_bh, stride_bi, stride_bj, heads_q, window_left, window_right,
     softcap_in, softcap_out, dropout_p, batch0) = vargs
    keep = dropout_keep(RNG, i, j, h, batch0 + b, heads_q, dropout_p)
    return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def bwd_probs(s, i, j, h, b, m_ij, lse, seqlen_k, diag, qk_scale, vargs, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
              DROPOUT: tl.constexpr):
    """The backward's recomputed probabilities ``P = 2^(x − lse)`` of a score tile ``s`` (or its transpose; ``lse``
    in the log2 domain, broadcast along the keys) with the variants and, when ``MASKED``, the visibility mask.
    Returns ``(P, tanh, keep)``: the softcap's tanh for its derivative ``1 − tanh²``, and dropout's ``Z / (1 − p)``
    (``1 / (1 − p)`` where kept, 0 where dropped); each is a placeholder where its variant is off."""
    th = s
    if SOFTCAP or ALIBI or HAS_BIAS:
        x, th = score_mod(s, i, j, h, b, m_ij, diag, qk_scale, vargs, SOFTCAP, ALIBI, HAS_BIAS)
    else:
        x = s * qk_scale
    if MASKED:
        x = tl.where(visible(i, j, j < seqlen_k, diag, vargs, CAUSAL, WINDOW), x, float("-inf"))
    p = tl.math.exp2(x - lse)
    keep = p
    if DROPOUT:
        keep = keep_scale(i, j, h, b, vargs)
    return p, th, keep
