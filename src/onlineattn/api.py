"""Public entry points: validate the arguments, then dispatch to a backend.

``backend="auto"`` uses the Triton kernels for CUDA tensors and the blockwise torch path for everything else;
``"torch"`` forces the torch path; ``"triton"`` forces the kernels (on CPU tensors they run under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch

from . import _validate as V
from . import dropout, torch_impl
from ._mods import PLAIN, Mods


@functools.cache
def _triton_forward_available() -> bool:
    """Whether the Triton kernels import (asked once: every eager call resolves its backend, NOTES v38)."""
    try:
        from .ops import forward  # noqa: F401
    except ImportError:
        return False
    return True


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _resolve_backend(backend: str, dots: bool = True, **tensors: torch.Tensor) -> str:
    """``auto``: Triton when the tensors are on CUDA in a kernel dtype, torch otherwise (float64 stays exact on the
    torch path). The first tensor decides the device; the names appear in the errors of a forced ``"triton"``.
    ``dots``: the kernels multiply matrices (not so merges and appends), which Triton's interpreter gets wrong in
    bfloat16."""
    backend = V.check_backend(backend)
    first = next(iter(tensors.values()))
    if backend == "auto":
        kernel_dtypes = all(x.dtype in KERNEL_DTYPES for x in tensors.values())
        return "triton" if first.is_cuda and kernel_dtypes and _triton_forward_available() else "torch"
    if backend == "triton":
        if not _triton_forward_available():
            raise ValueError("backend='triton' needs the triton package, which is not importable here")
        for name, x in tensors.items():
            if x.dtype == torch.float64:
                raise TypeError(f"backend='triton' takes float16, bfloat16 or float32; {name} has dtype float64 "
                                "(use 'torch')")
        if not first.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' with tensors on {first.device} needs TRITON_INTERPRET=1 set before triton is imported"
            )
        if dots and not first.is_cuda:  # Triton 3.6's interpreter computes bfloat16 dots wrongly: refuse, not garble
            for name, x in tensors.items():
                if x.dtype == torch.bfloat16:
                    raise TypeError(f"backend='triton' on {first.device} (Triton's interpreter) cannot compute "
                                    f"bfloat16: {name} has dtype bfloat16 (use float16, float32 or 'torch')")
    return backend


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    attn_bias=None,
    sinks=None,
    deterministic=True,
    return_lse=False,
    backend="auto",
    generator=None,
):
    """Exact softmax attention, ``softmax(q kᵀ · scale) v``, without materialising the scores.

    Args:
        q: ``[batch, seqlen_q, heads_q, head_dim]``, float16, bfloat16, float32 or float64.
        k: ``[batch, seqlen_k, heads_kv, head_dim]``; ``heads_q % heads_kv == 0`` (GQA/MQA).
        v: ``[batch, seqlen_k, heads_kv, head_dim_v]``.
        causal: bottom-right aligned: query i sees key j when ``j <= i + seqlen_k - seqlen_q``.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``; any sign, 0 included (README: Semantics).
        window_size: ``(left, right)``: query i sees keys ``i + Sk - Sq - left ... i + Sk - Sq + right``; -1 leaves a
            side unbounded; ``causal`` sets ``right = 0`` (flash-attn's meaning). Blocks outside are skipped.
        softcap: when > 0, scores become ``softcap · tanh(scores / softcap)`` (before ALiBi, bias and masking).
        alibi_slopes: ``[heads_q]`` or ``[batch, heads_q]``: adds ``-slope · |i + Sk - Sq - j|``. No gradient.
        dropout_p: probability of zeroing each attention probability (kept ones scaled by ``1 / (1 - p)``); the mask
            comes from a Philox stream seeded from ``generator`` or the default generator of q's device
            (``torch.manual_seed``), regenerated in the backward, never stored (``onlineattn.dropout``).
        attn_bias: added to the scores; broadcastable to ``[batch, heads_q, seqlen_q, seqlen_k]`` (for example
            ``[1, heads_q, seqlen_q, seqlen_k]`` or ``[batch, 1, 1, seqlen_k]``); read tile by tile, never expanded.
            It gets a gradient (summed over its broadcast dims) when it requires one.
        sinks: ``[heads_q]``: one logit per head that joins the softmax's normaliser with no value (gpt-oss). It gets
            a gradient; lse includes it.
        deterministic: with False, the backward may sum dQ in no fixed order where that is faster (plain calls on
            sm_90 in half precision from ``ops._configs.BWD_FUSED_DQ_MIN_KEYS``: the Hopper dK/dV kernel adds dQ
            too), as flash-attn's ``deterministic=False``. torch's ``use_deterministic_algorithms(True)``
            overrides it, and so do torch.compile, functorch transforms and tensor subclasses (their backward is
            the deterministic custom op's). ``attention_varlen`` is always deterministic.
        return_lse: also return the log-sum-exp of the scaled scores (natural log).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        generator: a ``torch.Generator`` for dropout's seed (on q's device type).

    Returns:
        ``o [batch, seqlen_q, heads_q, head_dim_v]`` in q's dtype, and with ``return_lse`` also
        ``lse [batch, heads_q, seqlen_q]`` in float32 (float64 for float64 inputs). A row that sees no key has
        ``o = 0`` and ``lse = -inf`` (``lse = sink`` with sinks). Differentiable with respect to q, k and v (and
        through lse), and attn_bias and sinks.

    Example:
        >>> import torch, onlineattn
        >>> q, k, v = (torch.randn(2, 5, 4, 16) for _ in range(3))
        >>> o, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True)
        >>> o.shape, lse.shape
        (torch.Size([2, 5, 4, 16]), torch.Size([2, 4, 5]))
        >>> onlineattn.attention(q, k, v, causal=True, window_size=(2, 0), softcap=30.0, sinks=torch.zeros(4)).shape
        torch.Size([2, 5, 4, 16])
    """
    dims = V.check_qkv(q, k, v)
    scale = V.check_scale(softmax_scale, dims.head_dim)
    causal = V.check_bool("causal", causal)
    return_lse = V.check_bool("return_lse", return_lse)
    deterministic = V.check_bool("deterministic", deterministic)
    backend = _resolve_backend(backend, q=q)
    mods = _mods(q, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k, window_size, softcap, alibi_slopes,
                 dropout_p, attn_bias, sinks, generator)
    return _dispatch(backend, q, k, v, scale, causal, mods, return_lse, deterministic)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    attn_bias=None,
    sinks=None,
    deterministic=True,
    return_lse=False,
    backend="auto",
    generator=None,
):
    """Attention over a batch of sequences of different lengths, packed without padding (flash-attn's varlen).

    Args:
        q: ``[total_q, heads_q, head_dim]``: the queries of every sequence, one after another.
        k: ``[total_k, heads_kv, head_dim]``; v: ``[total_k, heads_kv, head_dim_v]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device: sequence b holds rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``. They start at 0, never decrease and end at total_q / total_k; a
            sequence may be empty. Checked on the host (one device-to-host copy).
        max_seqlen_q, max_seqlen_k: at least the longest sequence (the kernels' grid is sized by them; a value past
            the packed length counts as that length).
        Other keywords: as ``attention``, each sequence attended on its own, bottom-right aligned with its own
        lengths (``alibi_slopes`` may be ``[batch, heads_q]``). ``attn_bias`` is not supported here.

    Returns:
        ``o [total_q, heads_q, head_dim_v]``, and with ``return_lse`` also ``lse [heads_q, total_q]``.

    Example:
        >>> import torch, onlineattn
        >>> cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # lengths 3, 0 and 5
        >>> q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
        >>> o = onlineattn.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
        >>> torch.allclose(o[3:], onlineattn.attention(q[None, 3:], k[None, 3:], v[None, 3:], causal=True)[0])
        True
    """
    vd = V.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # The kernels' grid is sized by the maxima: one past the packed length (2**31, say) would launch empty programs
    # by the billion. No sequence is longer than its packed tensor.
    max_seqlen_q, max_seqlen_k = min(max_seqlen_q, max(vd.total_q, 1)), min(max_seqlen_k, max(vd.total_k, 1))
    scale = V.check_scale(softmax_scale, vd.dims.head_dim)
    causal = V.check_bool("causal", causal)
    return_lse = V.check_bool("return_lse", return_lse)
    V.check_bool("deterministic", deterministic)
    if attn_bias is not None:
        raise NotImplementedError("attn_bias is not supported with attention_varlen: a bias over packed sequences "
                                  "has no single (B, H, Sq, Sk) layout; use attention() per sequence or ALiBi")
    backend = _resolve_backend(backend, q=q)
    mods = _mods(q, vd.batch, vd.dims.heads_q, max_seqlen_q, max_seqlen_k, window_size, softcap, alibi_slopes,
                 dropout_p, None, sinks, generator)
    mods = replace(mods, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k)
    return _dispatch(backend, q, k, v, scale, causal, mods, return_lse)


def _mods(q, batch, heads_q, seqlen_q, seqlen_k, window_size, softcap, alibi_slopes, dropout_p, attn_bias, sinks,
          generator) -> Mods:
    """Check the variant keywords and gather them (drawing dropout's seed) into a ``Mods``; PLAIN when unused."""
    left, right = V.check_window(window_size)
    softcap = V.check_softcap(softcap)
    dropout_p = V.check_nonnegative_float("dropout_p", dropout_p, below_one=True)
    if alibi_slopes is not None:
        V.check_alibi_slopes(alibi_slopes, batch, heads_q, q.device)
    if attn_bias is not None:
        V.check_attn_bias(attn_bias, batch, heads_q, seqlen_q, seqlen_k, q.device)
    if sinks is not None:
        V.check_sinks(sinks, heads_q, q.device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    rng = dropout.draw_rng_state(generator, q.device) if dropout_p > 0 else None
    tensors = (alibi_slopes, attn_bias, sinks, rng)
    if (left, right) == (-1, -1) and softcap == 0 and all(x is None for x in tensors):
        return PLAIN  # the plain path, exactly as before the variants
    return Mods(left, right, softcap, alibi_slopes, attn_bias, sinks, dropout_p, rng)


def _dispatch(backend, q, k, v, scale, causal, mods, return_lse, deterministic=True):
    if backend == "triton":
        from .ops import forward as triton_forward

        q, scale = V.positive_scale(q, scale)
        o, lse = triton_forward.attention(q, k, v, scale, causal, mods, deterministic)
    else:
        o, lse = torch_impl.attention(q, k, v, scale, causal, mods)
    return (o, lse) if return_lse else o


def _merge_backend(backend: str, **states: torch.Tensor) -> str:
    """The merge kernel has no backward: where autograd needs a graph, ``auto`` takes the (differentiable) torch
    path and a forced ``"triton"`` is refused rather than silently cutting the gradient."""
    resolved = _resolve_backend(backend, dots=False, **states)
    if resolved == "triton" and torch.is_grad_enabled() and any(x.requires_grad for x in states.values()):
        if backend == "triton":
            raise NotImplementedError("backend='triton' merges have no backward; use backend='auto' or 'torch' for "
                                      "states that require grad (or run under torch.no_grad())")
        return "torch"
    return resolved


def merge_states(o_a, lse_a, o_b, lse_b, *, backend="auto"):
    """Merge attention over two disjoint key sets into attention over their union, exactly.

    Args:
        o_a, o_b: ``[batch, seqlen, heads, head_dim]`` partial outputs, one dtype.
        lse_a, lse_b: ``[batch, heads, seqlen]`` their log-sum-exps (natural log); any entry may be ``-inf``.
        backend: ``"auto"`` (a Triton kernel for CUDA float16/bfloat16/float32 states that need no gradient, torch
            otherwise), ``"torch"`` or ``"triton"``. The torch path is differentiable; the kernel is not.

    Returns:
        ``(o, lse)``: o in o_a's dtype, computed in float32 (float64 for float64). An empty part (lse = -inf) is
        neutral; two empty parts give ``o = 0`` and ``lse = -inf``.

    Example:
        >>> import torch, onlineattn
        >>> q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
        >>> o1, l1 = onlineattn.attention(q, k[:, :4], v[:, :4], return_lse=True)
        >>> o2, l2 = onlineattn.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
        >>> o, lse = onlineattn.merge_states(o1, l1, o2, l2)
        >>> torch.allclose(o, onlineattn.attention(q, k, v), atol=1e-6)
        True
    """
    V.check_states(o_a, lse_a, o_b, lse_b)
    if _merge_backend(backend, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b) == "triton":
        from .ops import merge

        return merge.merge_states(o_a, lse_a, o_b, lse_b)
    return torch_impl.merge_states(o_a, lse_a, o_b, lse_b)


def merge_states_list(os, lses, *, backend="auto"):
    """Merge ``S`` partial states over disjoint key sets, stacked on a leading split dimension, exactly.

    Args:
        os: ``[splits, batch, seqlen, heads, head_dim]`` partial outputs (``splits >= 1``).
        lses: ``[splits, batch, heads, seqlen]`` their log-sum-exps (natural log); any entry may be ``-inf``.
        backend: as in ``merge_states``.

    Returns:
        ``(o [batch, seqlen, heads, head_dim], lse [batch, heads, seqlen])``: o in os' dtype, computed in float32
        (float64 for float64); lse float32 (float64 for float64). Rows empty in every part get o = 0, lse = -inf.

    Example:
        >>> import torch, onlineattn
        >>> q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
        >>> parts = [onlineattn.attention(q, k[:, a:a + 3], v[:, a:a + 3], return_lse=True) for a in (0, 3, 6)]
        >>> o, lse = onlineattn.merge_states_list(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        >>> torch.allclose(o, onlineattn.attention(q, k, v), atol=1e-6)
        True
    """
    V.check_states_list(os, lses)
    if _merge_backend(backend, os=os, lses=lses) == "triton":
        from .ops import merge

        return merge.merge_states_list(os, lses)
    return torch_impl.merge_states_list(os, lses)


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    block_table=None,
    causal=True,
    softmax_scale=None,
    num_splits=0,
    return_lse=False,
    check_indices=True,
    backend="auto",
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
):
    """Attention of new queries over a KV cache, appending new keys and values in place (flash-attn's
    ``flash_attn_with_kvcache``). Not differentiable: it is meant for inference.

    Args:
        q: ``[batch, seqlen_q, heads_q, head_dim]``; ``seqlen_q`` may exceed 1 (speculative decoding, chunked prefill).
        k_cache: contiguous ``[batch, max_seqlen, heads_kv, head_dim]``, or with ``block_table`` a page pool
            ``[num_pages, page_size, heads_kv, head_dim]`` (``page_size`` a multiple of 16). Its last dim must have
            stride 1, since it is written in place, and no two of its elements may share memory (no ``expand``);
            ``v_cache`` must be other memory, and ``k``/``v`` must not be views into the caches.
        v_cache: ``[batch, max_seqlen, heads_kv, head_dim_v]`` or ``[num_pages, page_size, heads_kv, head_dim_v]``.
        k, v: optional new tokens ``[batch, seqlen_new, heads_kv, head_dim(_v)]`` in the cache's dtype, written into
            the caches at positions ``cache_seqlens[b] + [0, seqlen_new)`` before attending.
        cache_seqlens: tokens already in each sequence's cache, an int or an int32 tensor ``[batch]``. It is not
            updated: the caller adds ``seqlen_new`` for the next call.
        block_table: int32 ``[batch, max_pages]``; token t of sequence b lives in page ``block_table[b, t // page_size]``
            at slot ``t % page_size``.
        causal: bottom-right aligned over the ``cache_seqlens[b] + seqlen_new`` visible tokens: query i sees token j
            when ``j <= i + cache_seqlens[b] + seqlen_new - seqlen_q``. With ``seqlen_q = 1`` it sees them all.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``; any sign, 0 included (README: Semantics).
        num_splits: key chunks per (sequence, kv head) processed in parallel and merged (split-KV); 0 chooses from the
            batch, the heads, the cache length and the GPU's SM count. The torch path computes without splitting.
        return_lse: also return the log-sum-exp (natural log).
        check_indices: check the values of ``cache_seqlens`` and of the block-table entries used before any kernel
            runs (one device-to-host copy). Pass False only where the caller guarantees them, as ``onlineattn.cache``
            does: an out-of-range value is then undefined behaviour.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        window_size, softcap, alibi_slopes: flash-attn's keywords, accepted only at their defaults here (decoding has
            no score variants yet); any other value raises ``NotImplementedError``.

    Returns:
        ``o [batch, seqlen_q, heads_q, head_dim_v]`` in q's dtype, and with ``return_lse`` also
        ``lse [batch, heads_q, seqlen_q]`` in float32 (float64 for float64). A query that sees no token gets
        ``o = 0`` and ``lse = -inf``.

    Example:
        >>> import torch, onlineattn
        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 16), torch.zeros(2, 64, 2, 16)
        >>> q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
        >>> lengths = torch.tensor([10, 3], dtype=torch.int32)
        >>> onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths).shape
        torch.Size([2, 1, 4, 16])
        >>> torch.equal(k_cache[0, 10], k[0, 0]) and torch.equal(k_cache[1, 3], k[1, 0])
        True
    """
    if not (type(window_size) is tuple and window_size == (-1, -1) and type(softcap) is float and softcap == 0.0
            and alibi_slopes is None):  # (off the decoding step's common path)
        _check_no_kvcache_variants(window_size, softcap, alibi_slopes)
    dims = V.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    scale, causal, return_lse, check_indices, num_splits, backend = _checked_kvcache_keywords(
        q, dims.meta_key, softmax_scale, causal, return_lse, check_indices, num_splits, backend)
    max_seqlen_k = V.check_kvcache_indices(cache_seqlens, block_table, dims) if check_indices else None
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((dims.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if backend == "triton":  # the kernel's outputs come from torch.empty: no graph to keep out
        meta_key = dims.meta_key
        if not scale > 0:  # where it changes q, its checked metadata no longer keys the launch
            q, scale = V.positive_scale(q, scale)
            meta_key = None
        o, lse = (_decode_op or _import_decode_op()).attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, num_splits,
            max_seqlen_k=max_seqlen_k, return_lse=return_lse, meta_key=meta_key,
        )
    else:
        with torch.no_grad():
            o, lse = torch_impl.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
                                                       causal)
    return (o, lse) if return_lse else o


def _check_no_kvcache_variants(window_size, softcap, alibi_slopes) -> None:
    """``attention_with_kvcache``'s score variants, accepted only at their defaults."""
    if not (type(window_size) is tuple and window_size == (-1, -1)):
        window_size = V.check_window(window_size)  # sides of 2^30 or more are unbounded too
    for name, value, default in (("window_size", window_size, (-1, -1)), ("softcap", softcap, 0.0),
                                 ("alibi_slopes", alibi_slopes, None)):
        V.check_unsupported(name, value, default, "by attention_with_kvcache (decoding has no score variants); "
                            "attention() takes it over the cached keys")


_decode_op = None  # ops.decode once imported: an import statement per eager decoding step costs ~0.5 µs


def _import_decode_op():
    global _decode_op
    from .ops import decode

    _decode_op = decode
    return decode


_CHECKED_KEYWORDS: dict = {}


def _checked_kvcache_keywords(q, meta_key, softmax_scale, causal, return_lse, check_indices, num_splits,
                              backend) -> tuple:
    """``kvcache_keywords``, looked up where these keywords passed it before with the same checked metadata
    (``CacheDims.meta_key``: it stands for q's head dim, dtype and device, all that the checks read of q): one
    dictionary lookup per decoding step in place of six checks. Each value keys with its type, so a value equal to
    an accepted one but of another type (``1`` for ``True``, a NumPy float for a float) is checked, and refused, as
    on a first call; an unhashable one is checked too. Off CUDA the backend's check also reads TRITON_INTERPRET,
    which may change between calls: its value keys there too."""
    key = None
    if meta_key is not None:
        env = None if q.is_cuda else os.environ.get("TRITON_INTERPRET")
        key = (meta_key, env, softmax_scale, type(softmax_scale), causal, type(causal), return_lse, type(return_lse),
               check_indices, type(check_indices), num_splits, type(num_splits), backend, type(backend))
        try:
            checked = _CHECKED_KEYWORDS.get(key)
        except TypeError:  # unhashable: the checks refuse it
            checked = key = None
        if checked is not None:
            return checked
    checked = kvcache_keywords(q, softmax_scale, causal, return_lse, check_indices, num_splits, backend)
    if key is not None:
        V.bounded_put(_CHECKED_KEYWORDS, key, checked, V.MAX_CHECKED)
    return checked


def kvcache_keywords(q, softmax_scale, causal, return_lse, check_indices, num_splits, backend) -> tuple:
    """``attention_with_kvcache``'s keywords, checked for ``q [B, Sq, Hq, D]`` (itself checked): (scale, causal,
    return_lse, check_indices, num_splits, backend). ``onlineattn.cache`` checks them before writing a token."""
    return (V.check_scale(softmax_scale, q.shape[-1]), V.check_bool("causal", causal),
            V.check_bool("return_lse", return_lse), V.check_bool("check_indices", check_indices),
            V.check_num_splits(num_splits), _resolve_backend(backend, q=q))


def _append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None, backend="auto") -> None:
    """Write new tokens into a cache in place without attending (for ``onlineattn.cache``, which owns and has checked
    every index): ``k [B, S_new, Hkv, D]`` at positions ``cache_seqlens[b] + [0, S_new)``, ``cache_seqlens`` int32
    ``[B]`` on the cache's device. Triton on CUDA, ``index_put_`` elsewhere."""
    if _resolve_backend(backend, dots=False, k=k) == "triton":
        from .ops import cache

        cache.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    else:
        torch_impl.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
