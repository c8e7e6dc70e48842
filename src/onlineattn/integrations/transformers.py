"""Hugging Face transformers integration: ``attn_implementation="onlineattn"``.

``register()`` adds ``attention_forward`` to transformers' ``AttentionInterface`` (transformers >= 4.48), after which

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="onlineattn")

runs every attention layer of a model that dispatches through that interface (Llama, Mistral, Qwen, BERT, ...) with
onlineattn. The function follows transformers' own SDPA integration (``integrations/sdpa_attention.py``) and calls
``onlineattn.sdpa``, so it takes the same masks: a padding or custom mask arrives as a 4-D boolean (or, in older
versions, additive float) ``[batch, 1 or heads, q_len, kv_len]`` tensor; without one the layer's ``is_causal`` applies.
From transformers 4.53 on, the masks themselves are built per implementation (``AttentionMaskInterface``);
``register()`` gives "onlineattn" SDPA's mask builder there, which returns None when plain causal masking suffices, so
unpadded batches reach onlineattn's kernels and padded ones the masked torch path.
"""

from __future__ import annotations

import torch

from .. import _validate as V
from ..api import attention
from ..sdpa import mask_as_bias, sdpa

NAME = "onlineattn"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An attention function in transformers' interface.

    Args:
        module: the attention layer; its ``is_causal`` (default True) applies when no mask is given.
        query: ``[batch, heads_q, q_len, head_dim]``; key, value: ``[batch, heads_kv, kv_len, head_dim]`` (GQA when
            ``heads_kv < heads_q``). Any float dtype.
        attention_mask: None or a mask broadcastable to ``[batch, heads_q, q_len, kv_len]``: bool (True = attend) or
            float (added to the scores). A query row with no visible key gives 0 (padding rows, which nothing reads).
        dropout: attention dropout probability (``attention``'s own counter-based stream).
        scaling: softmax scale, default ``1 / sqrt(head_dim)``.
        is_causal: overrides ``module.is_causal``.
        kwargs: other keywords of the interface. ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's per-head sinks,
            ``[heads_q]``) go to ``attention``; the rest (``sliding_window``, already part of the mask;
            ``position_ids``; ...) are ignored as SDPA's integration ignores them.

    Returns:
        ``(attn_output [batch, q_len, heads_q, head_dim] contiguous, None)``: no attention weights.

    Example:
        >>> import torch
        >>> from onlineattn.integrations.transformers import attention_forward
        >>> layer = torch.nn.Module(); layer.is_causal = True
        >>> q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
        >>> out, weights = attention_forward(layer, q, k, v, attention_mask=None)
        >>> out.shape, weights
        (torch.Size([1, 6, 4, 16]), None)
    """
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    dropout = V.check_nonnegative_float("dropout", dropout, below_one=True)  # the interface's name, not dropout_p
    q_len = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As transformers' SDPA integration: causal only without a mask (a mask already holds causality) and with more
    # than one query (one new token sees the whole cache). SDPA's top-left alignment is what transformers expects.
    causal = bool(is_causal) and attention_mask is None and q_len > 1
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]  # older versions build masks for the whole static cache
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if sinks is not None:  # named as transformers passes it
        V.check_sinks(sinks, query.shape[1], query.device, name="s_aux")
    if softcap or sinks is not None:
        return _with_score_variants(query, key, value, attention_mask, causal, scaling, dropout, softcap, sinks), None
    out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
               enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _with_score_variants(query, key, value, attention_mask, causal: bool, scaling, dropout: float, softcap, sinks):
    """Softcap or sinks: ``attention`` directly, the mask as ``attn_bias``. Causal without a mask needs
    ``q_len == kv_len``, where SDPA's top-left alignment and ``attention``'s bottom-right one agree."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, S, D] -> [B, S, H, D], views
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"softcap/s_aux with a causal layer and no mask need q_len == kv_len, got "
                                  f"{q.shape[1]} and {k.shape[1]}")
    bias = None if attention_mask is None else mask_as_bias(attention_mask, query.dtype)
    out = attention(q, k, v, causal=causal, softmax_scale=scaling, softcap=float(softcap or 0.0), attn_bias=bias,
                    sinks=sinks, dropout_p=dropout)
    return out.contiguous()


def register(name: str = NAME) -> str:
    """Register onlineattn with transformers under ``name``, so ``attn_implementation=name`` selects it.

    Idempotent. Needs transformers >= 4.48 (``AttentionInterface``). Returns ``name``.

    Example:
        >>> from onlineattn.integrations import transformers as oa_transformers
        >>> oa_transformers.register()  # doctest: +SKIP
        'onlineattn'
        >>> # then: AutoModel.from_pretrained(path, attn_implementation="onlineattn")
    """
    try:
        from transformers import AttentionInterface
    except ImportError as err:
        raise ImportError("onlineattn's transformers integration needs transformers >= 4.48 (AttentionInterface): "
                          "pip install 'onlineattn[transformers]'") from err
    AttentionInterface.register(name, attention_forward)
    try:  # transformers >= 4.53 builds each implementation's masks through this interface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older versions hand a custom implementation the eager 4-D float mask, which sdpa takes
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
