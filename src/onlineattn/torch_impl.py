"""Blockwise attention in plain PyTorch: runs on any device, forward and backward in O(N) extra memory.

Both passes walk one grid of tiles, ``chunk`` query rows by ``block`` keys (``_tiles``), vectorised over batch and
heads, so the largest temporary is ``[B, Hkv, G, chunk, block]`` and stays in cache; the score tiles live in buffers
allocated once per call. With causal masking, tiles wholly above the diagonal are skipped and only tiles that cross
it are masked. Scores are kept in base 2 (q is scaled by log2 e), since exp2 is ~3x faster than exp on the CPU.

The forward takes query chunks outer and key blocks inner, updating the online-softmax state (running max m, sum l,
unnormalised output) in place. The backward is FlashAttention-2's, key blocks outer: it keeps only q, k, v, o and
lse and recomputes each probability tile from lse (``dS = P ∘ (dP − delta)``, ``delta = rowsum(dO ∘ O)``).

Internally q is viewed as ``[B, Hkv, G, Sq, D]`` (G = Hq / Hkv) so that a group of query heads shares its kv head
without copying K or V. Half-precision inputs are computed in float32; float64 stays float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

LOG2E = math.log2(math.e)
DEFAULT_BLOCK = 256  # keys per tile: big enough to amortise Python overhead, small enough to keep temporaries O(N)
# Query rows per tile, tuned on a 2-core CPU against SDPA: larger tiles waste more work on the causal diagonal,
# smaller ones pay more per-call overhead. The backward holds two tiles (P and dP) but runs more matmuls per tile.
FORWARD_CHUNK = 256
BACKWARD_CHUNK = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, H, D]`` -> ``[B, Hkv, H / Hkv, S, D]`` in the compute dtype (a view when nothing needs converting)."""
    b, s, h, d = x.shape
    return x.to(dtype).transpose(1, 2).reshape(b, heads_kv, h // heads_kv, s, d)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, S, D]`` -> ``[B, S, Hkv * G, D]``."""
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).transpose(1, 2)


def _tiles(sq: int, sk: int, causal: bool, chunk: int, block: int, keys_outer: bool, device):
    """Yield ``(i0, i1, j0, j1, mask)`` per tile of query rows ``[i0, i1)`` and keys ``[j0, j1)`` that some row sees.

    Tiles lie on a fixed grid, query chunks outer unless ``keys_outer``. With bottom-right causal masking (row i sees
    keys j <= i + Sk - Sq) tiles wholly above the diagonal are skipped, and ``mask`` (True = hidden) is built only
    for tiles that cross it; otherwise it is None.
    """
    offset = sk - sq
    rows = [(i0, min(i0 + chunk, sq)) for i0 in range(0, sq, chunk)]
    cols = [(j0, min(j0 + block, sk)) for j0 in range(0, sk, block)]
    pairs = ((r, c) for c in cols for r in rows) if keys_outer else ((r, c) for r in rows for c in cols)
    masks = {}  # on a regular grid most diagonal tiles share one mask
    for (i0, i1), (j0, j1) in pairs:
        if not causal:
            yield i0, i1, j0, j1, None
        elif j0 <= i1 - 1 + offset:  # the last row sees the first key
            mask = None
            if j1 - 1 > i0 + offset:  # the first row misses the last key
                key = (j0 - i0 - offset, i1 - i0, j1 - j0)
                if key not in masks:
                    r = torch.arange(i1 - i0, device=device)[:, None]
                    masks[key] = torch.arange(j1 - j0, device=device)[None, :] > r - key[0]
                mask = masks[key]
            yield i0, i1, j0, j1, mask


def forward(q, k, v, scale: float, causal: bool, block: int = DEFAULT_BLOCK):
    """Return ``o [B, Sq, Hq, Dv]`` in q's dtype and ``lse [B, Hq, Sq]`` in float32 (float64 for float64 inputs).

    Not differentiable by itself (it fills buffers in place); ``attention`` is the differentiable entry.
    """
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * (scale * LOG2E)
    kt, vg = _grouped(k, hkv, cdt).transpose(-1, -2), _grouped(v, hkv, cdt)
    b, _, g, sq, _ = qs.shape
    o = torch.zeros((b, hkv, g, sq, v.shape[-1]), dtype=cdt, device=q.device)  # unnormalised until the end
    # The running max starts at the lowest finite value, not -inf, so that 2^(m_old - m_new) is never 2^(-inf + inf):
    # a row that has seen only masked keys keeps l = 0.
    m = torch.full((b, hkv, g, sq), torch.finfo(cdt).min, dtype=cdt, device=q.device)
    l = torch.zeros_like(m)
    buf = torch.empty(b * hkv * g * min(FORWARD_CHUNK, sq) * min(block, k.shape[1]), dtype=cdt, device=q.device)
    for i0, i1, j0, j1, mask in _tiles(sq, k.shape[1], causal, FORWARD_CHUNK, block, False, q.device):
        s = buf[: b * hkv * g * (i1 - i0) * (j1 - j0)].view(b, hkv, g, i1 - i0, j1 - j0)
        torch.matmul(qs[..., i0:i1, :], kt[..., j0:j1], out=s)
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        m_old = m[..., i0:i1]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        alpha = m_old.sub_(m_new).exp2_()
        p = s.sub_(m_new[..., None]).exp2_()
        l[..., i0:i1].mul_(alpha).add_(p.sum(dim=-1))
        o[..., i0:i1, :].mul_(alpha[..., None]).add_(torch.matmul(p, vg[..., j0:j1, :]))
        m_old.copy_(m_new)
    seen = l > 0  # rows that saw no key keep o = 0 and lse = -inf
    o.div_(torch.where(seen, l, 1.0)[..., None])
    lse = torch.where(seen, (m + torch.log2(l)) / LOG2E, float("-inf"))
    return _ungrouped(o).to(q.dtype), lse.reshape(b, hkv * g, sq)


def backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, block: int = DEFAULT_BLOCK):
    """Gradients ``(dq, dk, dv)`` by recomputation; ``dlse`` is the gradient flowing into lse, if any.

    Since d lse_i / d s_ij = p_ij, a gradient on lse adds ``P ∘ dlse`` to dS, which is folded into delta.
    It works in place on its own buffers, so it is not itself differentiable (no double backward).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (do, q, k, v)):
        raise NotImplementedError("onlineattn's attention backward is not differentiable: double backward "
                                  "(create_graph=True) is not supported")
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * (scale * LOG2E)
    kg, vg = _grouped(k, hkv, cdt), _grouped(v, hkv, cdt)
    dog = _grouped(do, hkv, cdt)
    b, _, g, sq, _ = qs.shape
    delta = (dog * _grouped(o, hkv, cdt)).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.to(cdt).reshape(delta.shape)
    lse_g = lse.to(cdt).reshape(b, hkv, g, sq) * LOG2E
    lse_g = lse_g.masked_fill(lse_g == float("-inf"), float("inf"))  # empty rows: p = 2^(s - inf) = 0
    dq = torch.zeros_like(qs)
    dk = torch.zeros_like(kg[:, :, 0])
    dv = torch.zeros_like(vg[:, :, 0])
    tile = b * hkv * g * min(BACKWARD_CHUNK, sq) * min(block, k.shape[1])
    s_buf, dp_buf = torch.empty((2, tile), dtype=cdt, device=q.device)
    for i0, i1, j0, j1, mask in _tiles(sq, k.shape[1], causal, BACKWARD_CHUNK, block, True, q.device):
        kb, vb, qb, dob = kg[..., j0:j1, :], vg[..., j0:j1, :], qs[..., i0:i1, :], dog[..., i0:i1, :]
        shape = (b, hkv, g, i1 - i0, j1 - j0)
        s = torch.matmul(qb, kb.transpose(-1, -2), out=s_buf[: math.prod(shape)].view(shape))
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        p = s.sub_(lse_g[..., i0:i1, None]).exp2_()
        dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob).sum(dim=2)
        dp = torch.matmul(dob, vb.transpose(-1, -2), out=dp_buf[: math.prod(shape)].view(shape))
        ds = p.mul_(dp.sub_(delta[..., i0:i1, None]))
        dq[..., i0:i1, :] += torch.matmul(ds, kb)
        dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb).sum(dim=2)
    dq = _ungrouped(dq.mul_(scale)).to(q.dtype)
    dk = dk.div_(LOG2E).transpose(1, 2)  # it summed dS against q scaled for base 2
    return dq, dk.to(k.dtype), dv.transpose(1, 2).to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------
# torch.library custom ops, so torch.compile treats each pass as one opaque call instead of tracing the tile loop
# (dynamo's trace of the in-place loop inside an autograd.Function gave wrong gradients on torch 2.11).


@torch.library.custom_op("onlineattn::blockwise_fwd", mutates_args=())
def blockwise_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[
    torch.Tensor, torch.Tensor
]:
    o, lse = forward(q, k, v, scale, causal)
    return o.contiguous(), lse


@blockwise_fwd.register_fake
def _blockwise_fwd_fake(q, k, v, scale, causal):
    b, sq, hq, _ = q.shape
    lse_dtype = _compute_dtype(q.dtype)
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=lse_dtype)


@torch.library.custom_op("onlineattn::blockwise_bwd", mutates_args=())
def blockwise_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: Optional[torch.Tensor], scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.contiguous() for x in backward(do, q, k, v, o, lse, scale, causal, dlse=dlse))


@blockwise_bwd.register_fake
def _blockwise_bwd_fake(do, q, k, v, o, lse, dlse, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def save_for_backward(ctx, inputs, output):
    """``setup_context`` shared by both paths' forward ops: keep q, k, v, o and lse only (O(N) training memory)."""
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.causal = scale, causal


def refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        "onlineattn.attention is differentiable once: double backward (gradients of its gradients) is not supported"
    )


def _blockwise_fwd_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*blockwise_bwd(do, q, k, v, o, lse, dlse, ctx.scale, ctx.causal), None, None)


blockwise_fwd.register_autograd(_blockwise_fwd_backward, setup_context=save_for_backward)
blockwise_bwd.register_autograd(refuse_double_backward)


def attention(q, k, v, scale: float, causal: bool):
    """Differentiable blockwise attention: ``(o, lse)``."""
    return blockwise_fwd(q, k, v, scale, causal)


def merge_states_list(os, lses):
    """Exact merge of ``S`` partial states over disjoint key sets: ``os [S, B, Sq, H, Dv]``, ``lses [S, B, H, Sq]``
    -> ``(o [B, Sq, H, Dv] in os' dtype, lse [B, H, Sq])``, computed in float32 (float64 for float64 inputs).

    Weights are ``exp(lse_s − max lse)``; an empty part (lse = -inf) has weight 0 and contributes nothing, even if its
    o is not finite. Where every part is empty, o = 0 and lse = -inf.
    """
    cdt = torch.promote_types(_compute_dtype(os.dtype), lses.dtype)
    lse_s = lses.to(cdt)
    m = lse_s.amax(dim=0)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    w = torch.exp(lse_s - m_safe)
    total = w.sum(dim=0)
    empty = total == 0
    total_safe = total.masked_fill(empty, 1.0)
    lse = (m_safe + torch.log(total_safe)).masked_fill(empty, float("-inf"))
    frac = (w / total_safe).transpose(-1, -2)[..., None]  # [S, B, H, Sq] -> [S, B, Sq, H, 1]
    o = torch.where(frac > 0, frac * os.to(cdt), 0.0).sum(dim=0)
    return o.to(os.dtype), lse


def merge_states(o_a, lse_a, o_b, lse_b):
    """Exact merge of two partial states; computed in float32 (float64 for float64), o returned in o_a's dtype."""
    return merge_states_list(torch.stack((o_a, o_b)), torch.stack((lse_a, lse_b)))


# ---------------------------------------------------------------------------------------------------------
# KV caches: contiguous [B, L_max, Hkv, D] or paged [num_pages, page_size, Hkv, D] with block_table [B, max_pages].


def _cache_index(positions: torch.Tensor, block_table, page_size: int):
    """Index of token ``positions [B, N]`` of each sequence into a cache's first two dims (for ``index_put_``)."""
    if block_table is None:
        batch = torch.arange(positions.shape[0], device=positions.device)[:, None]
        return batch.expand_as(positions), positions
    return block_table.long().gather(1, positions // page_size), positions % page_size


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write ``k [B, S_new, Hkv, D]`` and ``v [B, S_new, Hkv, Dv]`` into the caches in place, at positions
    ``cache_seqlens[b] + [0, S_new)`` (``cache_seqlens``: int32 ``[B]`` on the caches' device). Device ops only: no
    host synchronisation. The caller has checked that every position lies inside its sequence's pages."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)
    index = _cache_index(positions, block_table, k_cache.shape[1])
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale: float, causal: bool):
    """Decoding on the torch path: append the new tokens, then per sequence gather its visible keys (the first
    ``cache_seqlens[b] + S_new``) and run the blockwise ``forward``. Reads the lengths on the host (one sync).

    Returns ``o [B, Sq, Hq, Dv]`` in q's dtype and ``lse [B, Hq, Sq]`` in float32 (float64 for float64).
    """
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    new = 0 if k is None else k.shape[1]
    b, sq, hq, _ = q.shape
    o = q.new_empty((b, sq, hq, v_cache.shape[-1]))
    lse = torch.empty((b, hq, sq), dtype=_compute_dtype(q.dtype), device=q.device)
    for i, length in enumerate((cache_seqlens + new).tolist()):
        if block_table is None:  # a view: the first ``length`` tokens of sequence i
            keys, values = k_cache[i : i + 1, :length], v_cache[i : i + 1, :length]
        else:  # a gather from the sequence's pages: [1, length, Hkv, D]
            index = _cache_index(torch.arange(length, device=q.device)[None], block_table[i : i + 1], k_cache.shape[1])
            keys, values = k_cache[index], v_cache[index]
        o[i : i + 1], lse[i : i + 1] = forward(q[i : i + 1], keys, values, scale, causal)
    return o, lse
