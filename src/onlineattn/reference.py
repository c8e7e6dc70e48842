"""The oracle: exact attention in NumPy float64, plus the comparison rule every test applies.

Layout follows flash-attn: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``; outputs
``o [B, Sq, Hq, Dv]`` and ``lse [B, Hq, Sq]`` (natural log). Semantics (ENGINEERING.md section 2):

- causal is aligned bottom-right: query i sees key j when ``j <= i + Sk - Sq``;
- a query row that sees no key gets ``o = 0`` and ``lse = -inf``;
- the score variants (window, softcap, ALiBi, additive bias, sinks, dropout given its mask, packed varlen
  sequences) follow ``onlineattn._mods``;
- ``softmax_scale=None`` means ``1 / sqrt(D)``;
- GQA: query head h reads kv head ``h // (Hq // Hkv)``.

Inputs may be NumPy arrays or torch tensors of any float dtype; everything is computed in float64.
The torch helpers at the end (``torch_math_attention`` and ``assert_within_rule``) give the same-dtype baseline
and the error rule of ENGINEERING.md section 3. ``merge_states_list`` and ``kvcache_attention`` are the oracles of
the split-KV merge and of decoding against contiguous or paged KV caches.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "naive_attention",
    "naive_attention_backward",
    "naive_attention_grads",
    "naive_attention_varlen",
    "naive_attention_varlen_grads",
    "online_attention",
    "online_softmax",
    "merge_states",
    "merge_states_list",
    "kvcache_attention",
    "visible_mask",
    "torch_math_attention",
    "torch_math_attention_varlen",
    "error_bound",
    "assert_within_rule",
]


def _f64(x) -> np.ndarray:
    """Any array-like or torch tensor (bf16 included) as a float64 NumPy array."""
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def visible_mask(sq: int, sk: int, causal: bool, window_size=(-1, -1)) -> np.ndarray:
    """Boolean ``[Sq, Sk]``: True where query i may attend key j.

    Bottom-right aligned: with ``diag = Sk - Sq``, query i sees key j when ``i + diag - left <= j <= i + diag + right``
    for ``window_size = (left, right)``, where -1 leaves that side unbounded and ``causal`` sets ``right = 0``.
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(map(_is_int, window_size)):
        raise TypeError(f"window_size must be a pair of ints, got {window_size!r}")
    if min(window_size) < -1:
        raise ValueError(f"window_size's sides must be -1 (unbounded) or >= 0, got {window_size!r}")
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    visible = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        visible &= j <= i + (sk - sq) + right
    if left >= 0:
        visible &= j >= i + (sk - sq) - left
    return visible


def _heads_first(q, k, v):
    """``[B, S, H, D]`` -> ``[B, H, S, D]``, with k and v repeated to q's heads (GQA); their shapes checked."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if not q.ndim == k.ndim == v.ndim == 4:
        raise ValueError(f"q, k and v must be [B, S, H, D], got shapes {q.shape}, {k.shape} and {v.shape}")
    if (q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3] or k.shape[2] == 0
            or q.shape[2] % k.shape[2]):
        raise ValueError(f"q [B, Sq, Hq, D], k [B, Sk, Hkv, D] and v [B, Sk, Hkv, Dv] must agree (Hq a multiple of "
                         f"Hkv), got {q.shape}, {k.shape} and {v.shape}")
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(0, 2, 1, 3)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    return qh, kh, vh, group


def _scale(softmax_scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def _masked_softmax(s: np.ndarray, mask: np.ndarray, sinks=None):
    """Row softmax of ``s [B, H, Sq, Sk]`` over visible entries; returns (p, lse) with p = 0 and lse = -inf on empty
    rows. ``sinks [H]`` joins each row's normaliser with no value (then lse includes it and no row is empty)."""
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    sink = None if sinks is None else _f64(sinks).reshape(1, -1, 1, 1)
    if sink is not None:
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return p, lse[..., 0]


def _distance(sq: int, sk: int) -> np.ndarray:
    """ALiBi's ``|i + Sk - Sq - j|`` as ``[Sq, Sk]``: how far key j lies from query i's diagonal."""
    return np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :]).astype(np.float64)


def _alibi(slopes, h: int, sq: int, sk: int) -> np.ndarray:
    """``-slope · |i + Sk - Sq - j|`` as ``[B or 1, H, Sq, Sk]``; slopes ``[H]`` or ``[B, H]``."""
    slopes = _f64(slopes)
    return -slopes.reshape(-1 if slopes.ndim == 2 else 1, h)[:, :, None, None] * _distance(sq, sk)


def _logits(qh, kh, scale, softcap=0.0, alibi_slopes=None, attn_bias=None):
    """Logits ``[B, H, Sq, Sk]`` (natural log) and their derivative with respect to ``scale · q·k`` (softcap's
    ``1 - tanh²``, else 1). ALiBi and the bias are added after the softcap."""
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap}")
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * scale
    ds_dqk = 1.0
    if softcap > 0:
        t = np.tanh(s / softcap)
        s, ds_dqk = softcap * t, 1.0 - t * t
    if alibi_slopes is not None:
        s = s + _alibi(alibi_slopes, *s.shape[1:])
    if attn_bias is not None:
        s = s + _f64(attn_bias)
    return s, ds_dqk


def _dropped(p, dropout_p: float, dropout_mask):
    """``P ∘ Z / (1 - p)`` for the keep mask Z ``[B, H, Sq, Sk]`` (1 = kept); P itself without dropout."""
    if dropout_p == 0.0:
        return p
    if dropout_mask is None:
        raise ValueError("the oracle needs dropout_mask (onlineattn.dropout.dropout_mask) when dropout_p > 0")
    return p * _f64(dropout_mask) / (1.0 - dropout_p)


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, attn_bias=None, sinks=None, dropout_p=0.0, dropout_mask=None,
                    return_lse=False):
    """Textbook attention: materialise the ``[B, H, Sq, Sk]`` scores, softmax, multiply by V.

    The score variants follow ``onlineattn._mods``: ``softcap``, ``alibi_slopes`` (``[Hq]`` or ``[B, Hq]``),
    ``attn_bias`` (broadcastable to ``[B, Hq, Sq, Sk]``), ``window_size``, ``sinks [Hq]`` and dropout given its keep
    mask ``dropout_mask [B, Hq, Sq, Sk]``. lse is that of the undropped softmax and includes the sinks.

    >>> import numpy as np
    >>> q = np.ones((1, 2, 1, 4)); k = np.ones((1, 3, 1, 4)); v = np.arange(3.0).reshape(1, 3, 1, 1)
    >>> naive_attention(q, k, v, causal=True)[0, :, 0, 0]
    array([0.5, 1. ])
    """
    qh, kh, vh, _ = _heads_first(q, k, v)
    s, _ = _logits(qh, kh, _scale(softmax_scale, qh.shape[-1]), softcap, alibi_slopes, attn_bias)
    p, lse = _masked_softmax(s, visible_mask(qh.shape[2], kh.shape[2], causal, window_size), sinks)
    o = np.einsum("bhij,bhjd->bhid", _dropped(p, dropout_p, dropout_mask), vh).transpose(0, 2, 1, 3)
    return (o, lse) if return_lse else o


def _sum_to_shape(g: np.ndarray, shape) -> np.ndarray:
    """Sum ``g [B, H, Sq, Sk]`` over the dims a tensor of ``shape`` broadcasts, giving that shape."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(d for d in range(4) if shape4[d] == 1 and g.shape[d] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def naive_attention_grads(q, k, v, do, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                          alibi_slopes=None, attn_bias=None, sinks=None, dropout_p=0.0, dropout_mask=None,
                          dlse=None):
    """Exact float64 gradients of ``sum(o * do) + sum(lse * dlse)`` as a dict: ``dq``, ``dk``, ``dv`` and, when
    those inputs are given, ``dbias`` (summed over the dims the bias broadcasts) and ``dsinks``.

    Written out by hand: ``P``, ``dP = (dO Vᵀ) ∘ Z / (1 - p)`` with dropout, ``delta = rowsum(dO ∘ O) - dlse``,
    ``dS = P ∘ (dP - delta)`` (the logits' gradient, which is the bias's), then through the softcap
    (``1 - tanh²``) to q and k. A sink's gradient is ``-Σ_rows exp(sink - lse) · delta``. GQA gradients of k and v
    are summed over the query heads of each group.
    """
    qh, kh, vh, group = _heads_first(q, k, v)
    doh = _f64(do).transpose(0, 2, 1, 3)
    scale = _scale(softmax_scale, qh.shape[-1])
    s, ds_dqk = _logits(qh, kh, scale, softcap, alibi_slopes, attn_bias)
    p, lse = _masked_softmax(s, visible_mask(qh.shape[2], kh.shape[2], causal, window_size), sinks)
    dv = np.einsum("bhij,bhid->bhjd", _dropped(p, dropout_p, dropout_mask), doh)
    dp = _dropped(np.einsum("bhid,bhjd->bhij", doh, vh), dropout_p, dropout_mask)
    delta = (p * dp).sum(axis=-1, keepdims=True)  # = rowsum(dO ∘ O)
    if dlse is not None:
        delta = delta - _f64(dlse)[..., None]
    ds = p * (dp - delta)
    dqk = ds * ds_dqk
    dq = np.einsum("bhij,bhjd->bhid", dqk, kh) * scale
    dk = np.einsum("bhij,bhid->bhjd", dqk, qh) * scale

    def per_kv_head(g):  # [B, Hq, S, D] -> [B, S, Hkv, D], summed over each group
        b, hq, sl, d = g.shape
        return g.reshape(b, hq // group, group, sl, d).sum(axis=2).transpose(0, 2, 1, 3)

    grads = {"dq": dq.transpose(0, 2, 1, 3), "dk": per_kv_head(dk), "dv": per_kv_head(dv)}
    if attn_bias is not None:
        grads["dbias"] = _sum_to_shape(ds, tuple(attn_bias.shape))
    if sinks is not None:
        p_sink = np.exp(_f64(sinks)[None, :, None] - np.where(np.isneginf(lse), np.inf, lse))  # -inf sink, no key
        grads["dsinks"] = -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    return grads


def naive_attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, **mods):
    """Exact float64 gradients ``(dq, dk, dv)`` of ``sum(naive_attention(q, k, v) * do)`` (same keywords as
    ``naive_attention_grads``, which also gives the bias's and the sinks' gradients).

    Written out by hand (P, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P))) so the oracle needs no autograd.
    GQA gradients of k and v are summed over the query heads of each group.
    """
    grads = naive_attention_grads(q, k, v, do, causal=causal, softmax_scale=softmax_scale, **mods)
    return grads["dq"], grads["dk"], grads["dv"]


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """``(b, slice of q rows, slice of k rows)`` per sequence of a packed batch."""
    cu_q, cu_k = _ints(cu_seqlens_q), _ints(cu_seqlens_k)
    return [(b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _per_sequence(b, rows_q, rows_k, alibi_slopes, dropout_mask):
    """The keywords of sequence b: its ALiBi row and its corner of the padded dropout mask."""
    kw = {}
    if alibi_slopes is not None:
        slopes = _f64(alibi_slopes)
        kw["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
    if dropout_mask is not None:
        lq, lk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        kw["dropout_mask"] = _f64(dropout_mask)[b : b + 1, :, :lq, :lk]
    return kw


def naive_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_mask=None,
                           return_lse=False, **kw):
    """Packed sequences: ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv, Dv]``; sequence b holds
    rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` and is attended on its own (its own bottom-right diagonal).

    ``alibi_slopes`` is ``[Hq]`` or ``[n_seqs, Hq]``; ``dropout_mask`` is padded ``[n_seqs, Hq, max_q, max_k]``,
    each sequence using its top-left corner. Returns ``o [total_q, Hq, Dv]`` and ``lse [Hq, total_q]``, float64.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    o = np.zeros(q.shape[:2] + (v.shape[-1],))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        o_b, lse_b = naive_attention(q[None, rq], k[None, rk], v[None, rk], return_lse=True,
                                     **_per_sequence(b, rq, rk, alibi_slopes, dropout_mask), **kw)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return (o, lse) if return_lse else o


def naive_attention_varlen_grads(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_mask=None,
                                 dlse=None, **kw):
    """Gradients of ``naive_attention_varlen`` as ``naive_attention_grads`` gives them, over packed rows (``dlse``
    ``[Hq, total_q]``); ``dsinks`` is summed over every sequence."""
    q, k, v, do = _f64(q), _f64(k), _f64(v), _f64(do)
    grads = {"dq": np.zeros_like(q), "dk": np.zeros_like(k), "dv": np.zeros_like(v)}
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        g = naive_attention_grads(q[None, rq], k[None, rk], v[None, rk], do[None, rq],
                                  dlse=None if dlse is None else _f64(dlse)[None, :, rq],
                                  **_per_sequence(b, rq, rk, alibi_slopes, dropout_mask), **kw)
        grads["dq"][rq], grads["dk"][rk], grads["dv"][rk] = g["dq"][0], g["dk"][0], g["dv"][0]
        if "dsinks" in g:
            grads["dsinks"] = grads.get("dsinks", 0.0) + g["dsinks"]
    if kw.get("sinks") is not None and "dsinks" not in grads:
        grads["dsinks"] = np.zeros(_f64(kw["sinks"]).shape)
    return grads


def online_softmax(x, block: int = 64) -> np.ndarray:
    """Softmax of one row by the online recurrence: one pass over blocks for (m, l), one to normalise.

    >>> online_softmax(np.array([1.0, 2.0, 3.0]), block=2).round(4)
    array([0.09  , 0.2447, 0.6652])
    """
    x = _f64(x)
    if x.ndim != 1 or not _is_int(block) or block < 1:
        raise ValueError(f"online_softmax takes one row (1-D) and a block >= 1, got shape {x.shape} and block {block}")
    m, l = -np.inf, 0.0
    for start in range(0, x.shape[0], block):
        blk = x[start : start + block]
        m_new = max(m, blk.max())
        l = l * np.exp(m - m_new) + np.exp(blk - m_new).sum()
        m = m_new
    return np.exp(x - m) / l


def online_attention(q, k, v, *, causal=False, softmax_scale=None, block: int = 64, return_lse=False):
    """Attention by the online-softmax recurrence: loop over key blocks, vectorised over batch, heads and queries.

    Carries the running max ``m``, normaliser ``l`` and unnormalised output ``acc``; when a block raises the max,
    earlier partial sums are rescaled by ``exp(m_old - m_new)``. Equals ``naive_attention`` up to reassociation.
    """
    if not _is_int(block) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    qh, kh, vh, _ = _heads_first(q, k, v)
    b, h, sq, _ = qh.shape
    sk = kh.shape[2]
    scale = _scale(softmax_scale, qh.shape[-1])
    visible = visible_mask(sq, sk, causal)
    m = np.full((b, h, sq), -np.inf)
    l = np.zeros((b, h, sq))
    acc = np.zeros((b, h, sq, vh.shape[-1]))
    for start in range(0, sk, block):
        stop = min(start + block, sk)
        s = np.einsum("bhid,bhjd->bhij", qh, kh[:, :, start:stop]) * scale
        s = np.where(visible[:, start:stop], s, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1))
        m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # rows that have seen nothing stay at zero
        alpha = np.exp(m - m_safe)
        p = np.exp(s - m_safe[..., None])
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + np.einsum("bhij,bhjd->bhid", p, vh[:, :, start:stop])
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    o = o.transpose(0, 2, 1, 3)
    return (o, lse) if return_lse else o


def merge_states(o_a, lse_a, o_b, lse_b):
    """Exact merge of attention over two disjoint key sets: ``o [B, S, H, D]``, ``lse [B, H, S]``.

    Either lse may be -inf (an empty part is neutral, whatever its o holds); two empty parts give o = 0 and
    lse = -inf.
    """
    o_a, lse_a, o_b, lse_b = _f64(o_a), _f64(lse_a), _f64(o_b), _f64(lse_b)
    m = np.maximum(lse_a, lse_b)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w_a, w_b = np.exp(lse_a - m_safe), np.exp(lse_b - m_safe)
    total = w_a + w_b
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        frac_a = np.where(total > 0, w_a / np.where(total > 0, total, 1.0), 0.0)
        frac_b = np.where(total > 0, w_b / np.where(total > 0, total, 1.0), 0.0)
    to_o = lambda w: w.transpose(0, 2, 1)[..., None]  # [B, H, S] -> [B, S, H, 1]
    part = lambda frac, o: np.where(to_o(frac) > 0, to_o(frac) * o, 0.0)  # an empty part adds nothing, even NaN
    return part(frac_a, o_a) + part(frac_b, o_b), lse


def merge_states_list(os, lses):
    """Merge ``S`` partial states over disjoint key sets: ``os [S, B, Sq, H, Dv]``, ``lses [S, B, H, Sq]``.

    Folds ``merge_states`` over the split dimension, starting from the empty state (o = 0, lse = -inf), which every
    merge leaves unchanged. Returns float64 ``(o [B, Sq, H, Dv], lse [B, H, Sq])``.
    """
    os, lses = _f64(os), _f64(lses)
    o, lse = np.zeros(os.shape[1:]), np.full(lses.shape[1:], -np.inf)
    for o_s, lse_s in zip(os, lses):
        o, lse = merge_states(o, lse, o_s, lse_s)
    return o, lse


def _ints(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().to("cpu").numpy().astype(np.int64)
    return np.asarray(x, dtype=np.int64)


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None, causal=True,
                      softmax_scale=None):
    """Decoding against a KV cache, with flash-attn's ``flash_attn_with_kvcache`` semantics, in float64.

    Caches are contiguous ``[B, L_max, Hkv, D]`` or, with ``block_table [B, max_pages]``, paged
    ``[num_pages, page_size, Hkv, D]`` (token t of sequence b lives in page ``block_table[b, t // page_size]``, slot
    ``t % page_size``). The new tokens ``k [B, S_new, Hkv, D]``, ``v [B, S_new, Hkv, Dv]`` are written at positions
    ``cache_seqlens[b] + [0, S_new)``, then ``q [B, Sq, Hq, D]`` attends over the first ``cache_seqlens[b] + S_new``
    tokens (bottom-right causal). ``cache_seqlens`` is an int or a ``[B]`` array.

    Returns float64 ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq], k_cache, v_cache)``: the caches are copies with the new
    tokens written; the inputs are not modified.
    """
    q, k_cache, v_cache = _f64(q), _f64(k_cache).copy(), _f64(v_cache).copy()
    b, sq, hq, _ = q.shape
    lens = np.broadcast_to(_ints(cache_seqlens), (b,))
    table = None if block_table is None else _ints(block_table)
    new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    capacity = page_size * (1 if table is None else table.shape[1])
    if (lens < 0).any() or (lens + new > capacity).any():
        raise ValueError(f"cache_seqlens + the {new} new tokens must lie in [0, {capacity}], got {lens.tolist()}")
    for i in range(b if table is not None else 0):  # the pages a sequence reads or writes
        used = table[i, : -(-(lens[i] + new) // page_size)]
        if ((used < 0) | (used >= k_cache.shape[0])).any():
            raise ValueError(f"block_table[{i}]'s pages in use must lie in [0, {k_cache.shape[0]}), got "
                             f"{used.tolist()}")

    def where(i, positions):  # index of tokens ``positions`` of sequence i in the cache's first two dims
        if table is None:
            return i, positions
        return table[i, positions // page_size], positions % page_size

    for i in range(b if new else 0):  # every write lands before any read, as in one kernel call
        positions = where(i, lens[i] + np.arange(new))
        k_cache[positions], v_cache[positions] = _f64(k)[i], _f64(v)[i]
    o = np.zeros((b, sq, hq, v_cache.shape[-1]))
    lse = np.zeros((b, hq, sq))
    for i in range(b):
        visible = where(i, np.arange(lens[i] + new))
        o[i : i + 1], lse[i : i + 1] = naive_attention(
            q[i : i + 1], k_cache[visible][None], v_cache[visible][None], causal=causal,
            softmax_scale=softmax_scale, return_lse=True,
        )
    return o, lse, k_cache, v_cache


# ---------------------------------------------------------------------------------------------------------
# Same-dtype baseline and the error rule (ENGINEERING.md section 3). These need torch, imported lazily.


def torch_math_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, attn_bias=None, sinks=None, dropout_p=0.0, dropout_mask=None):
    """Textbook attention in torch, computed in the inputs' own dtype: the baseline of the error rule.

    Takes ``naive_attention``'s keywords (``alibi_slopes``, ``attn_bias`` and ``sinks`` are converted to q's dtype,
    so they get gradients in that dtype when they require them). Returns ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq])``,
    both in the input dtype. Differentiable.
    """
    import torch

    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    # Query head h reads kv head h // group. The products run per kv head over its group's rows ([B, Hkv, group · Sq,
    # D]), so K and V are never repeated per query head (a 128k-key GQA check would hold several GiB more per call).
    qg = q.transpose(1, 2).reshape(b, hkv, hq // hkv * sq, q.shape[-1])
    vh = v.transpose(1, 2)
    scale = _scale(softmax_scale, q.shape[-1])
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)).reshape(b, hq, sq, sk) * scale  # K as [B, Hkv, D, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        distance = torch.as_tensor(_distance(sq, sk), device=q.device).to(q.dtype)
        slopes = alibi_slopes.to(q.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, q.shape[2], 1, 1)
        s = s - slopes * distance
    if attn_bias is not None:
        s = s + attn_bias.to(q.dtype)
    mask = torch.as_tensor(visible_mask(sq, sk, causal, window_size), device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column that joins the normaliser and is dropped from P
        s = torch.cat([s, sinks.to(q.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    # Rows with no finite logit (masked, or hidden by a -inf bias) get lse = -inf and P = 0; they are zeroed before
    # logsumexp and softmax so that no NaN reaches the gradients through them.
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    if sinks is not None:
        p = p[..., :-1]
    if dropout_p > 0:
        p = p * torch.as_tensor(dropout_mask, device=q.device).to(q.dtype) / (1.0 - dropout_p)
    o = torch.matmul(p.reshape(b, hkv, hq // hkv * sq, sk), vh).reshape(b, hq, sq, vh.shape[-1])
    return o.transpose(1, 2), lse


def torch_math_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_mask=None, **kw):
    """``torch_math_attention`` over packed sequences, as ``naive_attention_varlen``: ``(o [total_q, Hq, Dv],
    lse [Hq, total_q])`` in the inputs' dtype, differentiable."""
    import torch

    os, lses = [], []
    for b, rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        per = {}
        if alibi_slopes is not None:
            per["alibi_slopes"] = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        if dropout_mask is not None:
            lq, lk = rq.stop - rq.start, rk.stop - rk.start
            per["dropout_mask"] = torch.as_tensor(dropout_mask)[b : b + 1, :, :lq, :lk]
        o, lse = torch_math_attention(q[None, rq], k[None, rk], v[None, rk], **per, **kw)
        os.append(o[0])
        lses.append(lse[0])
    return torch.cat(os), torch.cat(lses, dim=-1)


_QUANTUM = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def error_bound(exact, baseline, dtype_name: str) -> float:
    """Largest max-abs error allowed: 2 × the same-dtype baseline's error + 2 × the output's rounding quantum.

    float32 and float64 are held to a relative bound instead (1e-5 and 1e-12 of max|exact|).
    """
    exact = _f64(exact)
    finite = np.isfinite(exact)
    scale = float(np.abs(exact[finite]).max()) if finite.any() else 0.0
    if dtype_name == "float64":
        return 1e-12 * max(scale, 1.0)
    if dtype_name == "float32":
        return 1e-5 * max(scale, 1.0)
    if dtype_name not in _QUANTUM:
        raise ValueError(f"no error rule for dtype {dtype_name!r}; expected one of {sorted(_QUANTUM)}")
    if baseline is None:
        raise ValueError(f"the {dtype_name} rule needs the same-dtype baseline (torch_math_attention's result)")
    base = _f64(baseline)[finite]
    if not np.isfinite(base).all():
        # An overflowing baseline would make the bound infinite and let anything pass.
        raise ValueError(f"the {dtype_name} baseline is not finite where the exact result is; pick other inputs")
    base_err = float(np.abs(base - exact[finite]).max()) if finite.any() else 0.0
    return 2.0 * base_err + 2.0 * _QUANTUM[dtype_name] * max(scale, 1.0)


def assert_within_rule(name: str, ours, exact, baseline=None, dtype_name: str | None = None) -> None:
    """Raise AssertionError unless ``ours`` is within ``error_bound`` of ``exact``.

    Non-finite entries of ``exact`` (the -inf lse of empty rows) must be matched exactly; NaN never passes.
    ``dtype_name`` defaults to ours' dtype; ``baseline`` (same-dtype torch math result) is needed below float32.
    """
    if dtype_name is None:
        dtype_name = str(getattr(ours, "dtype", "float64")).replace("torch.", "")
    got, exact64 = _f64(ours), _f64(exact)
    if got.shape != exact64.shape:
        raise AssertionError(f"{name}: shape {got.shape} != expected {exact64.shape}")
    if np.isnan(got).any():
        raise AssertionError(f"{name}: {int(np.isnan(got).sum())} NaN values")
    finite = np.isfinite(exact64)
    if not np.array_equal(got[~finite], exact64[~finite]):
        raise AssertionError(f"{name}: non-finite entries (masked rows) differ from the oracle")
    if not np.isfinite(got[finite]).all():
        raise AssertionError(f"{name}: infinite values where the oracle is finite")
    err = float(np.abs(got[finite] - exact64[finite]).max()) if finite.any() else 0.0
    bound = error_bound(exact64, baseline, dtype_name)
    if err > bound:
        raise AssertionError(f"{name}: max error {err:.3e} exceeds the bound {bound:.3e} ({dtype_name})")
