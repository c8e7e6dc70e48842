"""Blockwise attention in plain PyTorch: runs on any device, forward and backward in O(N) extra memory.

The forward streams key blocks through the online-softmax recurrence, vectorised over batch, heads and queries, so the
largest temporary is ``[B, Hkv, G, Sq, block]``. The backward is FlashAttention-2's: it keeps only q, k, v, o and lse and
recomputes each probability block from lse (``dS = P ∘ (dP − delta)``, ``delta = rowsum(dO ∘ O)``).

Internally q is viewed as ``[B, Hkv, G, Sq, D]`` (G = Hq / Hkv) so that a group of query heads shares its kv head
without copying K or V. Half-precision inputs are computed in float32; float64 stays float64.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 256  # keys per step: big enough to amortise Python overhead, small enough to keep temporaries O(N)


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


def _blocks(sq: int, sk: int, causal: bool, block: int):
    """Yield ``(j0, j1, i0, mask)`` per key block: keys ``[j0, j1)`` meet query rows ``[i0, Sq)``.

    With bottom-right causal masking, rows above ``i0`` see none of the block and are skipped, and ``mask`` (True =
    hidden, ``[Sq - i0, j1 - j0]``) is built only for blocks that cross the diagonal; otherwise it is None.
    """
    offset = sk - sq
    for j0 in range(0, sk, block):
        j1 = min(j0 + block, sk)
        if not causal:
            yield j0, j1, 0, None
            continue
        i0 = max(0, j0 - offset)
        if i0 >= sq:
            continue
        mask = None
        if j1 - 1 > i0 + offset:  # the block's last key is hidden from its first row: it crosses the diagonal
            rows = torch.arange(i0, sq)[:, None]
            cols = torch.arange(j0, j1)[None, :]
            mask = cols > rows + offset
        yield j0, j1, i0, mask


def forward(q, k, v, scale: float, causal: bool, block: int = DEFAULT_BLOCK):
    """Return ``o [B, Sq, Hq, Dv]`` in q's dtype and ``lse [B, Hq, Sq]`` in float32 (float64 for float64 inputs)."""
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * scale
    kg, vg = _grouped(k, hkv, cdt), _grouped(v, hkv, cdt)
    b, _, g, sq, _ = qs.shape
    m = torch.full((b, hkv, g, sq), float("-inf"), dtype=cdt, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros((b, hkv, g, sq, v.shape[-1]), dtype=cdt, device=q.device)
    for j0, j1, i0, mask in _blocks(sq, k.shape[1], causal, block):
        s = torch.matmul(qs[..., i0:, :], kg[..., j0:j1, :].transpose(-1, -2))
        if mask is not None:
            s.masked_fill_(mask.to(s.device), float("-inf"))
        m_old = m[..., i0:]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that has seen nothing keeps p = 0
        alpha = torch.exp(m_old - m_safe)
        p = s.sub_(m_safe[..., None]).exp_()
        l[..., i0:] = l[..., i0:] * alpha + p.sum(dim=-1)
        acc[..., i0:, :] = acc[..., i0:, :] * alpha[..., None] + torch.matmul(p, vg[..., j0:j1, :])
        m[..., i0:] = m_new
    empty = l == 0
    o = (acc / l.masked_fill(empty, 1.0)[..., None]).masked_fill(empty[..., None], 0.0)
    lse = (m + torch.log(l.masked_fill(empty, 1.0))).masked_fill(empty, float("-inf"))
    return _ungrouped(o).to(q.dtype), lse.reshape(b, hkv * g, sq)


def backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, block: int = DEFAULT_BLOCK):
    """Gradients ``(dq, dk, dv)`` by recomputation; ``dlse`` is the gradient flowing into lse, if any.

    Since d lse_i / d s_ij = p_ij, a gradient on lse adds ``P ∘ dlse`` to dS, which is folded into delta.
    """
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    qs = _grouped(q, hkv, cdt) * scale
    kg, vg = _grouped(k, hkv, cdt), _grouped(v, hkv, cdt)
    dog = _grouped(do, hkv, cdt)
    b, _, g, sq, _ = qs.shape
    delta = (dog * _grouped(o, hkv, cdt)).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.to(cdt).reshape(delta.shape)
    lse_g = lse.to(cdt).reshape(b, hkv, g, sq)
    lse_g = lse_g.masked_fill(lse_g == float("-inf"), float("inf"))  # empty rows: p = exp(s - inf) = 0
    dq = torch.zeros_like(qs)
    dk = torch.zeros_like(kg[:, :, 0])
    dv = torch.zeros_like(vg[:, :, 0])
    for j0, j1, i0, mask in _blocks(sq, k.shape[1], causal, block):
        kb, vb = kg[..., j0:j1, :], vg[..., j0:j1, :]
        s = torch.matmul(qs[..., i0:, :], kb.transpose(-1, -2))
        if mask is not None:
            s.masked_fill_(mask.to(s.device), float("-inf"))
        p = s.sub_(lse_g[..., i0:, None]).exp_()
        do_blk = dog[..., i0:, :]
        dv[:, :, j0:j1] = torch.einsum("bhgij,bhgid->bhjd", p, do_blk)
        dp = torch.matmul(do_blk, vb.transpose(-1, -2))
        ds = p.mul_(dp.sub_(delta[..., i0:, None]))
        dq[..., i0:, :] += torch.matmul(ds, kb)
        dk[:, :, j0:j1] = torch.einsum("bhgij,bhgid->bhjd", ds, qs[..., i0:, :])
    dq = _ungrouped(dq * scale).to(q.dtype)
    return dq, dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class BlockwiseAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and lse only, so training memory stays O(N)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        o, lse = forward(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal = scale, causal
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = backward(do, q, k, v, o, lse, ctx.scale, ctx.causal, dlse=dlse)
        return dq, dk, dv, None, None


def attention(q, k, v, scale: float, causal: bool):
    """Differentiable blockwise attention: ``(o, lse)``."""
    return BlockwiseAttention.apply(q, k, v, scale, causal)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Exact merge of two partial states; computed in float32 (float64 for float64), o returned in o_a's dtype."""
    cdt = torch.promote_types(_compute_dtype(o_a.dtype), lse_a.dtype)
    la, lb = lse_a.to(cdt), lse_b.to(cdt)
    m = torch.maximum(la, lb)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    w_a, w_b = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = w_a + w_b
    empty = total == 0
    total_safe = total.masked_fill(empty, 1.0)
    lse = (m_safe + torch.log(total_safe)).masked_fill(empty, float("-inf"))
    frac = lambda w: (w / total_safe).transpose(1, 2)[..., None]  # [B, H, S] -> [B, S, H, 1]
    o = frac(w_a) * o_a.to(cdt) + frac(w_b) * o_b.to(cdt)
    return o.to(o_a.dtype), lse
