"""Blockwise attention with an arbitrary mask, in plain PyTorch: the path of ``onlineattn.sdpa``'s ``attn_mask``.

``attention()`` has no ``attn_bias`` yet (issue #6 adds it to the kernels), so a mask given to ``sdpa`` runs here,
on any device. The recurrence is the one of ``torch_impl``: query chunks outer, key blocks inner, a running max ``m``
and sum ``l`` per row in base 2, and an unnormalised output; the backward recomputes each probability tile from lse
(``dS = P ∘ (dP − delta)``). The only difference is that every score tile gets its tile of the mask: a boolean mask
hides the scores where it is False, a float mask is added to them (after the scale, as in SDPA).

The mask is read as a broadcast view ``[B, Hkv, G, Sq, Sk]`` (G = Hq / Hkv), so a ``[B, 1, Sq, Sk]`` padding mask is
never copied per head. A float mask that requires grad gets its gradient, ``dS`` summed back to the mask's shape;
that gradient is ``[B, H, Sq, Sk]`` before the sum, as large as the mask itself.

Memory: beyond the inputs, the mask and the outputs, one ``[B, Hkv, G, chunk, block]`` tile (two in the backward).
"""

from __future__ import annotations

import torch

from .torch_impl import BACKWARD_CHUNK, DEFAULT_BLOCK, FORWARD_CHUNK, LOG2E, _compute_dtype, _grouped, _ungrouped


def grouped_mask(mask: torch.Tensor, batch: int, heads_q: int, heads_kv: int, sq: int, sk: int) -> torch.Tensor:
    """A mask broadcastable to ``[B, Hq, Sq, Sk]`` as a ``[B, Hkv, G, Sq, Sk]`` view (no copy: stride 0 where it was
    broadcast). Query head h = kv head ``h // G``, position ``h % G``, as in ``torch_impl._grouped``."""
    full = torch.broadcast_to(mask, (batch, heads_q, sq, sk))
    return full.view(batch, heads_kv, heads_q // heads_kv, sq, sk)


def _scores(qs, kt, mask_g, i0, i1, j0, j1, out):
    """One base-2 score tile ``[B, Hkv, G, i1 - i0, j1 - j0]`` into ``out``, with its tile of the mask applied."""
    s = torch.matmul(qs[..., i0:i1, :], kt[..., j0:j1], out=out)
    tile = mask_g[..., i0:i1, j0:j1]
    if tile.dtype == torch.bool:
        return s.masked_fill_(~tile, float("-inf"))
    bias = tile.to(s.dtype) * LOG2E  # the mask is in natural-log units, the scores in base 2
    # A finite value below finfo.min / log2(e) (transformers' min-dtype masks) overflows to -inf in base 2. SDPA keeps
    # it finite, so a row of only such values still averages its keys: clamp those to the lowest finite value.
    bias = torch.where(bias.isneginf() & tile.isfinite(), torch.finfo(s.dtype).min, bias)
    return s.add_(bias)


def forward(q, k, v, mask, scale: float, block: int = DEFAULT_BLOCK):
    """``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``, mask broadcastable to ``[B, Hq, Sq, Sk]``
    (bool: True = visible; float: added to the scaled scores). Returns ``o [B, Sq, Hq, Dv]`` in q's dtype and
    ``lse [B, Hq, Sq]`` in float32 (float64 for float64). Rows with no visible key get ``o = 0``, ``lse = -inf``."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * (scale * LOG2E)
    kt, vg = _grouped(k, hkv, cdt).transpose(-1, -2), _grouped(v, hkv, cdt)
    mask_g = grouped_mask(mask, b, hq, hkv, sq, sk)
    g = hq // hkv
    o = torch.zeros((b, hkv, g, sq, v.shape[-1]), dtype=cdt, device=q.device)
    # lowest finite, not -inf, so that 2^(m_old - m_new) is never 2^(-inf + inf) on rows that saw only hidden keys
    m = torch.full((b, hkv, g, sq), torch.finfo(cdt).min, dtype=cdt, device=q.device)
    l = torch.zeros_like(m)
    buf = torch.empty(b * hq * min(FORWARD_CHUNK, sq) * min(block, sk), dtype=cdt, device=q.device)
    for i0 in range(0, sq, FORWARD_CHUNK):
        i1 = min(i0 + FORWARD_CHUNK, sq)
        for j0 in range(0, sk, block):
            j1 = min(j0 + block, sk)
            out = buf[: b * hq * (i1 - i0) * (j1 - j0)].view(b, hkv, g, i1 - i0, j1 - j0)
            s = _scores(qs, kt, mask_g, i0, i1, j0, j1, out)
            m_old = m[..., i0:i1]
            # a float mask may push every score of a row to -inf; clamping keeps m finite, so p = 2^(-inf) = 0
            m_new = torch.maximum(m_old, s.amax(dim=-1))
            alpha = m_old.sub_(m_new).exp2_()
            p = s.sub_(m_new[..., None]).exp2_()
            l[..., i0:i1].mul_(alpha).add_(p.sum(dim=-1))
            o[..., i0:i1, :].mul_(alpha[..., None]).add_(torch.matmul(p, vg[..., j0:j1, :]))
            m_old.copy_(m_new)
    seen = l > 0
    o.div_(torch.where(seen, l, 1.0)[..., None])
    lse = torch.where(seen, (m + torch.log2(l)) / LOG2E, float("-inf"))
    return _ungrouped(o).to(q.dtype), lse.reshape(b, hq, sq)


def backward(do, q, k, v, mask, o, lse, scale: float, dlse=None, mask_grad: bool = False, block: int = DEFAULT_BLOCK):
    """Gradients ``(dq, dk, dv, dmask)`` by recomputation; ``dmask`` is None unless ``mask_grad`` (float masks only),
    and then has the mask's own shape (summed over the dims it was broadcast along)."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * (scale * LOG2E)
    kg, vg, dog = _grouped(k, hkv, cdt), _grouped(v, hkv, cdt), _grouped(do, hkv, cdt)
    mask_g = grouped_mask(mask, b, hq, hkv, sq, sk)
    delta = (dog * _grouped(o, hkv, cdt)).sum(dim=-1)
    if dlse is not None:  # d lse_i / d s_ij = p_ij: a gradient on lse folds into delta
        delta = delta - dlse.to(cdt).reshape(delta.shape)
    lse2 = lse.to(cdt).reshape(b, hkv, g, sq) * LOG2E
    lse2 = lse2.masked_fill(lse2 == float("-inf"), float("inf"))  # empty rows: p = 2^(s - inf) = 0
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(kg[:, :, 0]), torch.zeros_like(vg[:, :, 0])
    dmask = torch.zeros((b, hkv, g, sq, sk), dtype=cdt, device=q.device) if mask_grad else None
    tile = b * hq * min(BACKWARD_CHUNK, sq) * min(block, sk)
    s_buf, dp_buf = torch.empty((2, tile), dtype=cdt, device=q.device)
    for j0 in range(0, sk, block):
        j1 = min(j0 + block, sk)
        kb, vb = kg[..., j0:j1, :], vg[..., j0:j1, :]
        for i0 in range(0, sq, BACKWARD_CHUNK):
            i1 = min(i0 + BACKWARD_CHUNK, sq)
            shape = (b, hkv, g, i1 - i0, j1 - j0)
            n = b * hq * (i1 - i0) * (j1 - j0)
            s = _scores(qs, kg.transpose(-1, -2), mask_g, i0, i1, j0, j1, s_buf[:n].view(shape))
            p = s.sub_(lse2[..., i0:i1, None]).exp2_()
            dob = dog[..., i0:i1, :]
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob).sum(dim=2)
            dp = torch.matmul(dob, vb.transpose(-1, -2), out=dp_buf[:n].view(shape))
            ds = p.mul_(dp.sub_(delta[..., i0:i1, None]))  # d loss / d (natural-log score)
            if dmask is not None:
                dmask[..., i0:i1, j0:j1] = ds
            dq[..., i0:i1, :] += torch.matmul(ds, kb)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qs[..., i0:i1, :]).sum(dim=2)
    dq = _ungrouped(dq.mul_(scale)).to(q.dtype)
    dk = dk.div_(LOG2E).transpose(1, 2).to(k.dtype)  # it summed dS against q scaled for base 2
    if dmask is not None:
        dmask = _sum_to_shape(dmask.reshape(b, hq, sq, sk), mask.shape).to(mask.dtype)
    return dq, dk, dv.transpose(1, 2).to(v.dtype), dmask


def _sum_to_shape(x: torch.Tensor, shape) -> torch.Tensor:
    """Sum a ``[B, H, Sq, Sk]`` gradient back to the shape it was broadcast from (fewer dims, or size-1 dims)."""
    lead = x.dim() - len(shape)
    x = x.sum(dim=tuple(range(lead))) if lead else x
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return (x.sum(dim=dims, keepdim=True) if dims else x).reshape(shape)


class MaskedAttention(torch.autograd.Function):
    """Differentiable masked attention: saves q, k, v, the mask, o and lse only; the backward recomputes."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float):
        o, lse = forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, mask, o, lse)
        ctx.scale = scale
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward fills buffers in place: no double backward
    def backward(ctx, do, dlse):
        q, k, v, mask, o, lse = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dmask = backward(do, q, k, v, mask, o, lse, ctx.scale, dlse=dlse, mask_grad=mask_grad)
        return dq, dk, dv, dmask, None


# torch.compile runs this eagerly (a graph break): dynamo's trace of an in-place tile loop inside an autograd.Function
# gave wrong gradients on torch 2.11 (see torch_impl), and a break is slower but never wrong.
@torch.compiler.disable
def attention(q, k, v, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable masked attention in the flash layout: ``(o [B, Sq, Hq, Dv], lse [B, Hq, Sq])``."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, mask)):
        return MaskedAttention.apply(q, k, v, mask, scale)
    return forward(q, k, v, mask, scale)

