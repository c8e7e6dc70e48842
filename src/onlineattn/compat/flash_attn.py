"""flash-attn 2's functional interface (``flash_attn.flash_attn_interface``), computed by onlineattn.

Same names, signatures, defaults and return conventions:

- ``out`` alone, or with ``return_attn_probs=True`` the triple ``(out, softmax_lse, None)``: onlineattn never forms
  the probabilities, so the third element, flash-attn's test-only ``S_dmask``, is None;
- ``softmax_lse`` is ``[batch, heads_q, seqlen_q]`` (varlen: as ``onlineattn.attention_varlen`` returns it), the
  natural log, float32 (float64 for float64 inputs);
- causal masks are aligned to the bottom right, and a query that sees no key gets 0, as in flash-attn.

A keyword is handed to onlineattn only where it differs from flash-attn's default, and only if the onlineattn function
behind it takes that keyword; otherwise the call raises ``NotImplementedError`` naming it. So features that onlineattn
gains later (issue #6: ``window_size``, ``softcap``, ``alibi_slopes``, ``dropout_p``, ``attention_varlen``) work here
without changes. Beyond flash-attn: any float dtype, any device, ``Dv != D``, head dims up to 256, page sizes that are
multiples of 16. ``deterministic`` keeps flash-attn's meaning and default (False: the backward may sum dQ in no
fixed order where that is faster; ``onlineattn.attention`` says where).
"""

from __future__ import annotations

import inspect

import torch

from .. import _validate as V
from .. import api


def _is_default(value, default) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False  # a tensor's == is elementwise; any tensor given for a None default is a real argument
    if isinstance(default, tuple) and isinstance(value, list):
        value = tuple(value)
    return type(value) in (type(default), int, float) and not isinstance(value, bool) and value == default


def _keywords(fn, **given) -> dict:
    """``given`` maps a flash-attn keyword to ``(value, flash-attn's default)``. Returns the keywords to pass to
    ``fn``: the non-default ones, each of which ``fn`` must accept."""
    accepted = inspect.signature(fn).parameters
    passed = {}
    for name, (value, default) in given.items():
        if _is_default(value, default):
            continue
        if name not in accepted:
            shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"{name}={shown} is not supported by onlineattn.{fn.__name__} (flash-attn "
                                      f"compat); pass its default {default!r}")
        passed[name] = value
    return passed


def _attention_keywords(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes):
    return dict(
        causal=causal, softmax_scale=softmax_scale,
        **_keywords(api.attention, dropout_p=(dropout_p, 0.0), window_size=(window_size, (-1, -1)),
                    softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None)),
    )


def _returned(out, return_attn_probs: bool):
    """``out`` or ``(out, softmax_lse, None)`` from an ``(o, lse)`` pair."""
    o, lse = out
    return (o, lse, None) if return_attn_probs else o


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: ``onlineattn.attention`` under flash-attn's signature.

    Args:
        q: ``[batch, seqlen_q, heads_q, head_dim]``; k: ``[batch, seqlen_k, heads_kv, head_dim]``;
            v: ``[batch, seqlen_k, heads_kv, head_dim_v]``; ``heads_q % heads_kv == 0``. Any float dtype.
        causal: bottom-right aligned. softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        dropout_p, window_size, softcap, alibi_slopes: passed on to ``attention`` when not at their defaults.
        return_attn_probs: also return ``softmax_lse [batch, heads_q, seqlen_q]`` and None.

    Returns:
        ``out [batch, seqlen_q, heads_q, head_dim_v]`` in q's dtype, or ``(out, softmax_lse, None)``.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> q, k, v = torch.randn(2, 6, 4, 32), torch.randn(2, 9, 2, 32), torch.randn(2, 9, 2, 32)
        >>> out, lse, probs = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        >>> out.shape, lse.shape, probs
        (torch.Size([2, 6, 4, 32]), torch.Size([2, 4, 6]), None)
    """
    return_attn_probs = V.check_bool("return_attn_probs", return_attn_probs)
    kwargs = _attention_keywords(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _returned(api.attention(q, k, v, deterministic=deterministic, return_lse=True, **kwargs), return_attn_probs)


def _unpack(name, packed, layout, ndim, dim, parts):
    """The ``parts`` views of a packed tensor (``layout``: ``ndim`` dims, ``parts`` of them along ``dim``)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[dim] != parts:
        raise ValueError(f"{name} must be {layout} ({parts} along dim {dim}), got shape {tuple(packed.shape)}")
    return packed.unbind(dim=dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv [batch, seqlen, 3, heads, head_dim]``; otherwise as
    ``flash_attn_func``. The gradient reaches ``qkv`` through its three views.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> qkv = torch.randn(2, 5, 3, 4, 16)
        >>> out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
        >>> torch.equal(out, flash_attn.flash_attn_func(*qkv.unbind(2), causal=True))
        True
    """
    q, k, v = _unpack("qkv", qkv, "[batch, seqlen, 3, heads, head_dim]", 5, 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_kvpacked_func``: ``q [batch, seqlen_q, heads_q, head_dim]``,
    ``kv [batch, seqlen_k, 2, heads_kv, head_dim]``; otherwise as ``flash_attn_func``.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> q, kv = torch.randn(1, 3, 4, 16), torch.randn(1, 7, 2, 2, 16)
        >>> flash_attn.flash_attn_kvpacked_func(q, kv).shape
        torch.Size([1, 3, 4, 16])
    """
    k, v = _unpack("kv", kv, "[batch, seqlen_k, 2, heads_kv, head_dim]", 5, 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def _attention_varlen():
    """``onlineattn.attention_varlen``, looked up at call time: it lands with issue #6."""
    varlen = getattr(api, "attention_varlen", None)
    if varlen is None:
        raise NotImplementedError("flash_attn_varlen_func needs onlineattn.attention_varlen, which is not available "
                                  "yet (tracked by issue #6)")
    return varlen


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's ``flash_attn_varlen_func``: sequences packed along dim 0, delimited by cumulative lengths.

    Args:
        q: ``[total_q, heads_q, head_dim]``; k: ``[total_k, heads_kv, head_dim]``; v: ``[total_k, heads_kv, head_dim_v]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]``, sequence b is rows ``cu[b]:cu[b + 1]``.
        max_seqlen_q, max_seqlen_k: ints, the longest sequence of each.
        block_table: a paged K/V (passed on if ``attention_varlen`` takes it).
        Others as in ``flash_attn_func``.

    Returns:
        ``out [total_q, heads_q, head_dim_v]``, or ``(out, softmax_lse, None)``.

    Raises:
        NotImplementedError: naming ``onlineattn.attention_varlen`` where it is missing (an older onlineattn).

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)          # two sequences: 3 and 7 tokens
        >>> q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
        >>> flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).shape
        torch.Size([10, 4, 16])
    """
    return_attn_probs = V.check_bool("return_attn_probs", return_attn_probs)
    varlen = _attention_varlen()
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, deterministic=deterministic, return_lse=True)
    kwargs |= _keywords(varlen, dropout_p=(dropout_p, 0.0), window_size=(window_size, (-1, -1)),
                        softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None), block_table=(block_table, None))
    out = varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
    return _returned(out, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv [total, 3, heads, head_dim]``; as
    ``flash_attn_varlen_func`` with one set of lengths.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> qkv, cu = torch.randn(10, 3, 4, 16), torch.tensor([0, 3, 10], dtype=torch.int32)
        >>> flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 7).shape
        torch.Size([10, 4, 16])
    """
    q, k, v = _unpack("qkv", qkv, "[total, 3, heads, head_dim]", 4, 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``kv [total_k, 2, heads_kv, head_dim]``; as
    ``flash_attn_varlen_func``.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> q, kv, cu = torch.randn(10, 4, 16), torch.randn(10, 2, 2, 16), torch.tensor([0, 3, 10], dtype=torch.int32)
        >>> flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7).shape
        torch.Size([10, 4, 16])
    """
    k, v = _unpack("kv", kv, "[total_k, 2, heads_kv, head_dim]", 4, 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache``: ``onlineattn.attention_with_kvcache`` under flash-attn's signature.

    Args:
        q: ``[batch, seqlen_q, heads_q, head_dim]``.
        k_cache, v_cache: ``[batch, seqlen_cache, heads_kv, head_dim(_v)]``, or with ``block_table`` page pools
            ``[num_pages, page_size, heads_kv, head_dim(_v)]``. Updated in place when k and v are given.
        k, v: new tokens ``[batch, seqlen_new, heads_kv, head_dim(_v)]``, written at ``cache_seqlens[b]``.
        cache_seqlens: int or int32 ``[batch]``: tokens already cached. None, as in flash-attn, means every cache
            slot holds a token (then k and v must be None: there is no room for them).
        block_table: int32 ``[batch, max_pages]``.
        causal: bottom-right aligned (flash-attn's default here is False, and so is this one's).
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, window_size, softcap, alibi_slopes: passed on when
            not at their defaults if ``attention_with_kvcache`` takes them, else NotImplementedError.
        return_softmax_lse: also return ``softmax_lse [batch, heads_q, seqlen_q]``.

    Returns:
        ``out [batch, seqlen_q, heads_q, head_dim_v]``, or ``(out, softmax_lse)``. Not differentiable.

    Example:
        >>> import torch
        >>> from onlineattn.compat import flash_attn
        >>> k_cache, v_cache = torch.zeros(2, 32, 2, 16), torch.zeros(2, 32, 2, 16)
        >>> q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
        >>> lens = torch.tensor([5, 0], dtype=torch.int32)
        >>> out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
        ...                                               causal=True, return_softmax_lse=True)
        >>> out.shape, lse.shape, torch.equal(k_cache[0, 5], k[0, 0])
        (torch.Size([2, 1, 4, 16]), torch.Size([2, 4, 1]), True)
    """
    extra = _keywords(api.attention_with_kvcache, rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                      cache_batch_idx=(cache_batch_idx, None), cache_leftpad=(cache_leftpad, None),
                      window_size=(window_size, (-1, -1)), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None))
    if rotary_cos is not None:
        extra.update(_keywords(api.attention_with_kvcache, rotary_interleaved=(rotary_interleaved, None)))
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens=None means the caches are full, so there is no room for new k and v: pass "
                             "cache_seqlens")
        V.check_tensor("k_cache", k_cache, ndim=4)  # read for the full length: checked before it is read
        if block_table is not None:
            V.check_tensor("block_table", block_table, ndim=2, dtypes=None)
        cache_seqlens = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    return api.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                                      causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                      return_lse=return_softmax_lse, **extra)
