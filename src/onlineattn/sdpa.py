"""``onlineattn.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

SDPA's layout is heads-first, ``[..., H, S, D]``; onlineattn's is flash-attn's ``[B, S, H, D]``. A transpose is a view,
so the layouts cost nothing to switch. Without a mask the call goes to ``onlineattn.attention`` (the Triton kernels on
CUDA, the blockwise torch path elsewhere). SDPA's ``is_causal`` is aligned to the top left (query i sees keys
``j <= i``) while ``attention``'s is aligned to the bottom right; the two agree when ``Sq == Sk``, and the other shapes
are reduced to that case (see ``_top_left_causal``). A mask becomes ``attention``'s additive ``attn_bias`` (a boolean mask
0 where True and -inf where False), read tile by tile by whichever backend runs, never expanded for 4-D inputs.
"""

from __future__ import annotations

import math

import torch

from . import _validate as V
from .api import attention


def _check_tensors(query, key, value, enable_gqa) -> None:
    V.check_bool("enable_gqa", enable_gqa)
    for name, x in (("query", query), ("key", key), ("value", value)):
        V.check_tensor(name, x)
        if x.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims [..., heads, seqlen, head_dim], got shape "
                             f"{tuple(x.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device} and "
                         f"{value.device}")
    if not (query.dim() == key.dim() == value.dim()) or not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise ValueError(f"query, key and value must share their batch dims (all but the last three), got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value must have the same heads and seqlen, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's head dim must equal query's: expected {query.shape[-1]}, got {key.shape[-1]}")
    hq, hkv = query.shape[-3], key.shape[-3]
    if hq != hkv and hkv != 1:  # SDPA broadcasts a single kv head even without enable_gqa
        if not enable_gqa:
            raise ValueError(f"key has {hkv} heads and query {hq}: pass enable_gqa=True for grouped-query attention")
        if hkv == 0 or hq % hkv:
            raise ValueError(f"key has {hkv} heads, which does not divide query's {hq} heads")


def _check_mask(attn_mask, query, key, want_shape) -> None:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = take part) or floating point (added to the scores), got "
                        f"{attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask must be on query's device {query.device}, got {attn_mask.device}")
    try:
        torch.broadcast_shapes(attn_mask.shape, want_shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (..., heads, L, S) = "
                         f"{tuple(want_shape)}") from None
    if torch.broadcast_shapes(attn_mask.shape, want_shape) != want_shape:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} would broadcast the output beyond "
                         f"{tuple(want_shape)}")


def mask_as_bias(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = take part) as an additive bias of the same shape: 0 where True, -inf where False, in
    float32 (float64 for float64 inputs). A float mask is returned as it is, so its gradient still reaches it."""
    if attn_mask.dtype != torch.bool:
        return attn_mask
    bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.zeros((), dtype=bias_dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))


def _as_bias(attn_mask, lead, hq: int, sq: int, sk: int, dtype) -> torch.Tensor:
    """SDPA's mask as ``attention``'s ``attn_bias``, broadcastable to ``[B, Hq, Sq, Sk]`` and never expanded where
    the leading dims allow (see ``mask_as_bias``)."""
    attn_mask = mask_as_bias(attn_mask, dtype)
    full = (*lead, hq, sq, sk)
    if len(lead) == 1 and attn_mask.dim() <= 4:
        return attn_mask  # already broadcastable to [B, Hq, Sq, Sk]
    return torch.broadcast_to(attn_mask, full).reshape(-1, hq, sq, sk)  # other leading dims: fold them into B


def _top_left_causal(q, k, v, scale: float, dropout_p: float, backend: str) -> torch.Tensor:
    """SDPA's causal mask on ``[B, S, H, D]`` tensors: query i sees keys ``j <= i``.

    With ``Sq <= Sk`` no query sees beyond key ``Sq − 1``, and on the square ``[:Sq, :Sq]`` top-left equals
    bottom-right. With ``Sq > Sk`` the first ``Sk`` queries form that square and every later query sees all keys.
    """
    sq, sk = q.shape[1], k.shape[1]
    if sq <= sk:
        return attention(q, k[:, :sq], v[:, :sq], causal=True, softmax_scale=scale, dropout_p=dropout_p,
                         backend=backend)
    square = attention(q[:, :sk], k, v, causal=True, softmax_scale=scale, dropout_p=dropout_p, backend=backend)
    rest = attention(q[:, sk:], k, v, causal=False, softmax_scale=scale, dropout_p=dropout_p, backend=backend)
    return torch.cat((square, rest), dim=1)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         backend="auto"):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by onlineattn.

    Args:
        query: ``[..., heads_q, L, E]`` (usually ``[B, Hq, L, E]``), float16, bfloat16, float32 or float64.
        key: ``[..., heads_kv, S, E]`` with the same leading dims.
        value: ``[..., heads_kv, S, Ev]``.
        attn_mask: None, or a tensor broadcastable to ``[..., heads_q, L, S]``: bool (True = the key takes part) or
            floating point (added to the scaled scores; ``-inf`` hides a key). A float mask that requires grad
            receives its gradient.
        dropout_p: ``attention``'s dropout (its own counter-based stream, reproducible from ``torch.manual_seed``).
        is_causal: top-left aligned, as in SDPA: query i sees key j when ``j <= i``. Not together with attn_mask.
        scale: defaults to ``1 / sqrt(E)``.
        enable_gqa: allow ``heads_kv`` to divide ``heads_q`` (query head h reads kv head ``h // (Hq / Hkv)``). A
            single kv head is broadcast without it, as SDPA's broadcasting does.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``, as in ``attention``; masks run on either.

    Returns:
        ``[..., heads_q, L, Ev]`` in query's dtype (a transposed view of a ``[B, L, Hq, Ev]`` buffer, like SDPA's
        flash backend). Differentiable with respect to query, key, value and a float mask.

    The one difference from PyTorch: a query whose keys are all masked (an all-False boolean row, or a float row all
    ``-inf``) gets output 0, never NaN. PyTorch's math backend does the same on recent versions; its documented
    reference formula and some fused backends give NaN.

    Example:
        >>> import torch, onlineattn
        >>> q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
        >>> mask = torch.ones(2, 1, 5, 7, dtype=torch.bool); mask[1, ..., 5:] = False   # padding in sequence 1
        >>> o = onlineattn.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        >>> o.shape, torch.allclose(o, ref, atol=1e-5)
        (torch.Size([2, 8, 5, 16]), True)
        >>> torch.allclose(onlineattn.sdpa(q, k, v, is_causal=True, enable_gqa=True),
        ...                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        ...                atol=1e-5)
        True
    """
    _check_tensors(query, key, value, enable_gqa)
    lead, hq, sq, d = query.shape[:-3], *query.shape[-3:]
    hkv, sk, dv = key.shape[-3], key.shape[-2], value.shape[-1]
    scale = V.check_scale(scale, d, name="scale")
    is_causal = V.check_bool("is_causal", is_causal)
    dropout_p = V.check_nonnegative_float("dropout_p", dropout_p, below_one=True)
    backend = V.check_backend(backend)
    batch = math.prod(lead)
    # [..., H, S, D] -> [B, S, H, D]: a view for 4-D inputs, a reshape of the leading dims otherwise
    q, k, v = (x.reshape(batch, *x.shape[-3:]).transpose(1, 2) for x in (query, key, value))
    if attn_mask is None:
        if is_causal:
            o = _top_left_causal(q, k, v, scale, dropout_p, backend)
        else:
            o = attention(q, k, v, causal=False, softmax_scale=scale, dropout_p=dropout_p, backend=backend)
    else:
        _check_mask(attn_mask, query, key, (*lead, hq, sq, sk))
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be combined (as in SDPA): fold the causal mask into "
                             "attn_mask")
        o = attention(q, k, v, attn_bias=_as_bias(attn_mask, lead, hq, sq, sk, query.dtype), softmax_scale=scale,
                      dropout_p=dropout_p, backend=backend)
    return o.transpose(1, 2).reshape(*lead, hq, sq, dv)
