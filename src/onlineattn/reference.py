"""The oracle: exact attention in NumPy float64, plus the comparison rule every test applies.

Layout follows flash-attn: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``; outputs
``o [B, Sq, Hq, Dv]`` and ``lse [B, Hq, Sq]`` (natural log). Semantics (ENGINEERING.md section 2):

- causal is aligned bottom-right: query i sees key j when ``j <= i + Sk - Sq``;
- a query row that sees no key gets ``o = 0`` and ``lse = -inf``;
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
    "online_attention",
    "online_softmax",
    "merge_states",
    "merge_states_list",
    "kvcache_attention",
    "visible_mask",
    "torch_math_attention",
    "error_bound",
    "assert_within_rule",
]


def _f64(x) -> np.ndarray:
    """Any array-like or torch tensor (bf16 included) as a float64 NumPy array."""
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def visible_mask(sq: int, sk: int, causal: bool) -> np.ndarray:
    """Boolean ``[Sq, Sk]``: True where query i may attend key j (bottom-right causal)."""
    if not causal:
        return np.ones((sq, sk), dtype=bool)
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def _heads_first(q, k, v):
    """``[B, S, H, D]`` -> ``[B, H, S, D]``, with k and v repeated to q's heads (GQA)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(0, 2, 1, 3)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    return qh, kh, vh, group


def _scale(softmax_scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def _masked_softmax(s: np.ndarray, mask: np.ndarray):
    """Row softmax of ``s`` over visible entries; returns (p, lse) with p = 0 and lse = -inf on empty rows."""
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return p, lse[..., 0]


def naive_attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """Textbook attention: materialise the ``[B, H, Sq, Sk]`` scores, softmax, multiply by V.

    >>> import numpy as np
    >>> q = np.ones((1, 2, 1, 4)); k = np.ones((1, 3, 1, 4)); v = np.arange(3.0).reshape(1, 3, 1, 1)
    >>> naive_attention(q, k, v, causal=True)[0, :, 0, 0]
    array([0.5, 1. ])
    """
    qh, kh, vh, _ = _heads_first(q, k, v)
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * _scale(softmax_scale, qh.shape[-1])
    p, lse = _masked_softmax(s, visible_mask(qh.shape[2], kh.shape[2], causal))
    o = np.einsum("bhij,bhjd->bhid", p, vh).transpose(0, 2, 1, 3)
    return (o, lse) if return_lse else o


def naive_attention_backward(q, k, v, do, *, causal=False, softmax_scale=None):
    """Exact float64 gradients ``(dq, dk, dv)`` of ``sum(naive_attention(q, k, v) * do)``.

    Written out by hand (P, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P))) so the oracle needs no autograd.
    GQA gradients of k and v are summed over the query heads of each group.
    """
    qh, kh, vh, group = _heads_first(q, k, v)
    doh = _f64(do).transpose(0, 2, 1, 3)
    scale = _scale(softmax_scale, qh.shape[-1])
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * scale
    p, _ = _masked_softmax(s, visible_mask(qh.shape[2], kh.shape[2], causal))
    dv = np.einsum("bhij,bhid->bhjd", p, doh)
    dp = np.einsum("bhid,bhjd->bhij", doh, vh)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhij,bhjd->bhid", ds, kh) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, qh) * scale

    def per_kv_head(g):  # [B, Hq, S, D] -> [B, S, Hkv, D], summed over each group
        b, hq, sl, d = g.shape
        return g.reshape(b, hq // group, group, sl, d).sum(axis=2).transpose(0, 2, 1, 3)

    return dq.transpose(0, 2, 1, 3), per_kv_head(dk), per_kv_head(dv)


def online_softmax(x, block: int = 64) -> np.ndarray:
    """Softmax of one row by the online recurrence: one pass over blocks for (m, l), one to normalise.

    >>> online_softmax(np.array([1.0, 2.0, 3.0]), block=2).round(4)
    array([0.09  , 0.2447, 0.6652])
    """
    x = _f64(x)
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


def torch_math_attention(q, k, v, *, causal=False, softmax_scale=None):
    """Textbook attention in torch, computed in the inputs' own dtype: the baseline of the error rule.

    Returns ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq])``, both in the input dtype. Differentiable.
    """
    import torch

    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * _scale(softmax_scale, q.shape[-1])
    mask = torch.as_tensor(visible_mask(q.shape[1], k.shape[1], causal), device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # empty rows: softmax gives NaN, the contract says 0
    return torch.matmul(p, vh).transpose(1, 2), lse


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
