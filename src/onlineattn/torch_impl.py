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
import torch

from . import dropout
from ._mods import MOD_SCHEMA, PLAIN, UNBOUNDED, Mods, bias_4d
from ._validate import LOG2E

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


def _tiles(sq: int, sk: int, band, chunk: int, block: int, keys_outer: bool, device):
    """Yield ``(i0, i1, j0, j1, mask)`` per tile of query rows ``[i0, i1)`` and keys ``[j0, j1)`` that some row sees.

    Tiles lie on a fixed grid, query chunks outer unless ``keys_outer``. ``band = (left, right)`` keeps key j for
    query i when ``i + diag - left <= j <= i + diag + right`` (``diag = Sk - Sq``; causal is ``(UNBOUNDED, 0)``);
    None keeps every key. Tiles wholly outside the band are skipped, and ``mask`` (True = hidden) is built only for
    tiles that cross an edge of it; otherwise it is None.
    """
    diag = sk - sq
    rows = [(i0, min(i0 + chunk, sq)) for i0 in range(0, sq, chunk)]
    cols = [(j0, min(j0 + block, sk)) for j0 in range(0, sk, block)]
    pairs = ((r, c) for c in cols for r in rows) if keys_outer else ((r, c) for r in rows for c in cols)
    masks = {}  # on a regular grid most edge tiles share one mask
    for (i0, i1), (j0, j1) in pairs:
        if band is None:
            yield i0, i1, j0, j1, None
            continue
        lo, hi = diag - band[0], diag + band[1]  # the band's range of j - i
        if j0 - (i1 - 1) > hi or (j1 - 1) - i0 < lo:  # the tile's range of j - i misses the band
            continue
        mask = None
        if (j1 - 1) - i0 > hi or j0 - (i1 - 1) < lo:
            key = (j0 - i0, i1 - i0, j1 - j0)
            if key not in masks:
                d = torch.arange(j1 - j0, device=device)[None, :] - torch.arange(i1 - i0, device=device)[:, None]
                d += key[0]
                masks[key] = (d > hi) | (d < lo)
            mask = masks[key]
        yield i0, i1, j0, j1, mask


class _TileMods:
    """The score variants (``onlineattn._mods``) on the torch path's tiles ``[B, Hkv, G, rows, keys]``, whose scores
    are in the log2 domain (``x = logit · log2 e``). ``seq_index`` is the varlen sequence a one-entry batch is."""

    def __init__(self, mods: Mods, q, k, cdt, scale: float, seq_index=None):
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        self.shape, self.cdt, self.diag, self.device = (b, hkv, hq // hkv), cdt, sk - sq, q.device
        self.softcap, self.dropout_p, self.rng = mods.softcap, mods.dropout_p, mods.rng
        # Under softcap q enters QKᵀ unscaled (``q_factor``) and the scale joins inside the tanh (``softcap_in``).
        self.q_factor = 1.0 if mods.softcap > 0 else scale * LOG2E
        self.softcap_in = mods.softcap_in(scale, torch.finfo(cdt).max)
        self.slopes = self.bias = None
        if mods.alibi_slopes is not None:  # [B or 1, Hkv, G, 1, 1], in the log2 domain
            self.slopes = (mods.alibi_slopes.to(cdt) * LOG2E).reshape(-1, hkv, hq // hkv)[..., None, None]
        if mods.attn_bias is not None:  # a broadcast view, never materialised
            self.bias = bias_4d(mods.attn_bias).expand(b, hq, sq, sk).reshape(b, hkv, hq // hkv, sq, sk)
        first = 0 if seq_index is None else seq_index
        self.batch = torch.arange(first, first + b, device=q.device)[:, None, None, None, None]
        self.heads = torch.arange(hq, device=q.device).reshape(1, hkv, hq // hkv, 1, 1)
        self.heads_q = hq

    def apply(self, s, i0, i1, j0, j1):
        """Softcap, ALiBi and bias on the scores ``s`` of tile ``[i0, i1) × [j0, j1)``, in place. Returns the
        softcap's ``tanh`` (its derivative is ``1 - tanh²``), or None."""
        th = None
        if self.softcap > 0:
            th = torch.tanh(s * self.softcap_in)
            torch.mul(th, self.softcap * LOG2E, out=s)
        if self.slopes is not None:
            i = torch.arange(i0, i1, device=self.device)[:, None]
            distance = (i + self.diag - torch.arange(j0, j1, device=self.device)[None, :]).abs().to(self.cdt)
            s.sub_(self.slopes * distance)
        if self.bias is not None:
            s.add_(self.bias[..., i0:i1, j0:j1].to(self.cdt), alpha=LOG2E)
        return th

    def keep_scale(self, i0, i1, j0, j1):
        """Dropout's ``Z / (1 - p)`` on the tile (the Philox stream of ``onlineattn.dropout``), or None."""
        if self.dropout_p == 0.0:
            return None
        i = torch.arange(i0, i1, device=self.device)[:, None]
        j = torch.arange(j0, j1, device=self.device)[None, :]
        keep = dropout.keep_mask(self.rng, self.batch, self.heads, self.heads_q, i, j, self.dropout_p)
        return keep.to(self.cdt) / (1.0 - self.dropout_p)


def _band(mods: Mods, causal: bool):
    band = mods.band(causal)
    return (UNBOUNDED, 0) if band is None and causal else band


def _grouped_heads(x: torch.Tensor, b: int, hkv: int, g: int, s: int) -> torch.Tensor:
    """A per-head vector ``[Hq]`` as ``[B, Hkv, G, S]`` (a broadcast view)."""
    return x.reshape(1, hkv, g, 1).expand(b, hkv, g, s)


def forward(q, k, v, scale: float, causal: bool, mods: Mods = PLAIN, block: int = DEFAULT_BLOCK, *, seq_index=None):
    """Return ``o [B, Sq, Hq, Dv]`` in q's dtype and ``lse [B, Hq, Sq]`` in float32 (float64 for float64 inputs).

    ``mods`` holds the score variants (not varlen: ``forward_varlen`` calls this per sequence, with ``seq_index``).
    Not differentiable by itself (it fills buffers in place); ``attention`` is the differentiable entry.
    """
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    tm = _TileMods(mods, q, k, cdt, scale, seq_index)
    qs = _grouped(q, hkv, cdt) * tm.q_factor
    kt, vg = _grouped(k, hkv, cdt).transpose(-1, -2), _grouped(v, hkv, cdt)
    b, _, g, sq, _ = qs.shape
    o = torch.zeros((b, hkv, g, sq, v.shape[-1]), dtype=cdt, device=q.device)  # unnormalised until the end
    # The running max starts at the lowest finite value, not -inf, so that 2^(m_old - m_new) is never 2^(-inf + inf):
    # a row that has seen only masked keys keeps l = 0.
    m = torch.full((b, hkv, g, sq), torch.finfo(cdt).min, dtype=cdt, device=q.device)
    l = torch.zeros_like(m)
    if mods.sinks is not None:  # the sink is the first "key": a logit with no value
        sink = _grouped_heads(mods.sinks.to(cdt) * LOG2E, b, hkv, g, sq)
        m = torch.maximum(m, sink)
        l = torch.exp2(sink - m)
    buf = torch.empty(b * hkv * g * min(FORWARD_CHUNK, sq) * min(block, k.shape[1]), dtype=cdt, device=q.device)
    for i0, i1, j0, j1, mask in _tiles(sq, k.shape[1], _band(mods, causal), FORWARD_CHUNK, block, False, q.device):
        s = buf[: b * hkv * g * (i1 - i0) * (j1 - j0)].view(b, hkv, g, i1 - i0, j1 - j0)
        torch.matmul(qs[..., i0:i1, :], kt[..., j0:j1], out=s)
        tm.apply(s, i0, i1, j0, j1)
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        m_old = m[..., i0:i1]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        alpha = m_old.sub_(m_new).exp2_()
        p = s.sub_(m_new[..., None]).exp2_()
        l[..., i0:i1].mul_(alpha).add_(p.sum(dim=-1))
        keep = tm.keep_scale(i0, i1, j0, j1)
        p_v = p if keep is None else p * keep
        o[..., i0:i1, :].mul_(alpha[..., None]).add_(torch.matmul(p_v, vg[..., j0:j1, :]))
        m_old.copy_(m_new)
    seen = l > 0  # rows that saw no key keep o = 0 and lse = -inf
    o.div_(torch.where(seen, l, 1.0)[..., None])
    lse = torch.where(seen, (m + torch.log2(l)) / LOG2E, float("-inf"))
    return _ungrouped(o).to(q.dtype), lse.reshape(b, hkv * g, sq)


def backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, block: int = DEFAULT_BLOCK):
    """Gradients ``(dq, dk, dv)`` of the plain path by recomputation; ``dlse`` is the gradient flowing into lse."""
    return gradients(do, q, k, v, o, lse, scale, causal, dlse, block=block)[:3]


def gradients(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, mods: Mods = PLAIN,
              block: int = DEFAULT_BLOCK, *, bias_grad: bool = False, seq_index=None):
    """``(dq, dk, dv, dbias, dsinks)`` by recomputation; ``dbias`` (in attn_bias's shape, only with ``bias_grad``)
    and ``dsinks [Hq]`` (only with sinks) are None otherwise.

    Since d lse_i / d s_ij = p_ij, a gradient on lse adds ``P ∘ dlse`` to dS, which is folded into delta. The bias's
    gradient is dS itself (summed over the dims it broadcasts); the softcap's ``1 - tanh²`` follows, on the way to q
    and k. It works in place on its own buffers, so it is not itself differentiable (no double backward).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (do, q, k, v)):
        raise NotImplementedError("onlineattn's attention backward is not differentiable: double backward "
                                  "(create_graph=True) is not supported")
    hkv = k.shape[2]
    cdt = _compute_dtype(q.dtype)
    tm = _TileMods(mods, q, k, cdt, scale, seq_index)
    qs = _grouped(q, hkv, cdt) * tm.q_factor
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
    dbias = _BiasGrad(mods.attn_bias, cdt) if bias_grad else None
    tile = b * hkv * g * min(BACKWARD_CHUNK, sq) * min(block, k.shape[1])
    s_buf, dp_buf = torch.empty((2, tile), dtype=cdt, device=q.device)
    for i0, i1, j0, j1, mask in _tiles(sq, k.shape[1], _band(mods, causal), BACKWARD_CHUNK, block, True, q.device):
        kb, vb, qb, dob = kg[..., j0:j1, :], vg[..., j0:j1, :], qs[..., i0:i1, :], dog[..., i0:i1, :]
        shape = (b, hkv, g, i1 - i0, j1 - j0)
        s = torch.matmul(qb, kb.transpose(-1, -2), out=s_buf[: math.prod(shape)].view(shape))
        th = tm.apply(s, i0, i1, j0, j1)
        if mask is not None:
            s.masked_fill_(mask, float("-inf"))
        p = s.sub_(lse_g[..., i0:i1, None]).exp2_()
        keep = tm.keep_scale(i0, i1, j0, j1)
        dv[:, :, j0:j1] += torch.matmul((p if keep is None else p * keep).transpose(-1, -2), dob).sum(dim=2)
        dp = torch.matmul(dob, vb.transpose(-1, -2), out=dp_buf[: math.prod(shape)].view(shape))
        if keep is not None:
            dp.mul_(keep)
        ds = p.mul_(dp.sub_(delta[..., i0:i1, None]))
        if dbias is not None:
            dbias.add(ds, i0, i1, j0, j1)
        if th is not None:
            ds.mul_(1.0 - th * th)
        dq[..., i0:i1, :] += torch.matmul(ds, kb)
        dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb).sum(dim=2)
    dq = _ungrouped(dq.mul_(scale)).to(q.dtype)
    dk = (dk.mul_(scale) if tm.softcap > 0 else dk.div_(LOG2E)).transpose(1, 2)  # dS was summed against q · q_factor
    dsinks = None
    if mods.sinks is not None:  # d sink = -Σ_rows P_sink · delta
        p_sink = torch.exp2(_grouped_heads(mods.sinks.to(cdt) * LOG2E, b, hkv, g, sq) - lse_g)
        dsinks = -(p_sink * delta).sum(dim=(0, 3)).reshape(-1).to(mods.sinks.dtype)
    return (dq, dk.to(k.dtype), dv.transpose(1, 2).to(v.dtype), None if dbias is None else dbias.result(),
            dsinks)


class _BiasGrad:
    """The bias's gradient, accumulated tile by tile into its own (broadcast) shape: a tile's dS
    ``[B, Hkv, G, rows, keys]`` is summed over the dims the bias broadcasts before it is added."""

    def __init__(self, bias, cdt):
        self.bias = bias
        self.acc = torch.zeros(bias_4d(bias).shape, dtype=cdt, device=bias.device)

    def add(self, ds, i0, i1, j0, j1) -> None:
        b, hkv, g, r, c = ds.shape
        ds = ds.reshape(b, hkv * g, r, c)
        dims = [d for d in range(4) if self.acc.shape[d] == 1 and ds.shape[d] != 1]
        if dims:
            ds = ds.sum(dim=dims, keepdim=True)
        rows = slice(i0, i1) if self.acc.shape[2] != 1 else slice(0, 1)
        cols = slice(j0, j1) if self.acc.shape[3] != 1 else slice(0, 1)
        self.acc[:, :, rows, cols] += ds

    def result(self) -> torch.Tensor:
        return self.acc.reshape(self.bias.shape).to(self.bias.dtype)


def _sequence_bounds(mods: Mods):
    """``(b, q rows, k rows)`` per packed sequence (reads cu_seqlens on the host)."""
    cu_q, cu_k = mods.cu_seqlens_q.tolist(), mods.cu_seqlens_k.tolist()
    return [(b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def forward_varlen(q, k, v, scale: float, causal: bool, mods: Mods):
    """Packed ``q [total_q, Hq, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv, Dv]`` -> ``o [total_q, Hq, Dv]``
    and ``lse [Hq, total_q]``: ``forward`` on each sequence in turn."""
    o = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_compute_dtype(q.dtype), device=q.device)
    for b, rq, rk in _sequence_bounds(mods):
        o_b, lse_b = forward(q[None, rq], k[None, rk], v[None, rk], scale, causal, mods.sequence(b), seq_index=b)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return o, lse


def gradients_varlen(do, q, k, v, o, lse, scale: float, causal: bool, dlse, mods: Mods):
    """``gradients`` over packed sequences: ``(dq, dk, dv, None, dsinks)`` in the packed layouts."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if mods.sinks is None else torch.zeros_like(mods.sinks)
    for b, rq, rk in _sequence_bounds(mods):
        grads = gradients(do[None, rq], q[None, rq], k[None, rk], v[None, rk], o[None, rq], lse[None, :, rq], scale,
                          causal, None if dlse is None else dlse[None, :, rq], mods.sequence(b), seq_index=b)
        dq[rq], dk[rk], dv[rk] = grads[0][0], grads[1][0], grads[2][0]
        if dsinks is not None:
            dsinks += grads[4]
    return dq, dk, dv, None, dsinks


# ---------------------------------------------------------------------------------------------------------------
# torch.library custom ops, so torch.compile treats each pass as one opaque call instead of tracing the tile loop
# (dynamo's trace of the in-place loop inside an autograd.Function gave wrong gradients on torch 2.11).


# Both paths' ops share one signature: the plain arguments, then the score variants (``_mods.MOD_SCHEMA``, all with
# defaults, so a plain call passes five arguments). The backward returns the bias's and the sinks' gradients too,
# as empty tensors where there are none (an op's outputs cannot be None).
FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, float scale, bool causal, {MOD_SCHEMA}) -> (Tensor, Tensor)"
BWD_SCHEMA = ("(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? dlse, float scale, "
              f"bool causal, {MOD_SCHEMA}, bool bias_grad=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_BIAS_INPUT, _SINKS_INPUT = 9, 10  # positions of attn_bias and sinks among the forward op's inputs


def fake_forward(q, k, v, scale, causal, *mod_args):
    """Output shapes of either forward op: ``o [B, Sq, Hq, Dv]``, ``lse [B, Hq, Sq]`` (varlen: ``o [total_q, Hq,
    Dv]``, ``lse [Hq, total_q]``), lse in float32 (float64 for float64)."""
    lse_dtype = _compute_dtype(q.dtype)
    if Mods.from_op_args(mod_args).varlen:
        total, hq, _ = q.shape
        return q.new_empty((total, hq, v.shape[-1])), q.new_empty((hq, total), dtype=lse_dtype)
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=lse_dtype)


def fake_backward(do, q, k, v, o, lse, dlse, scale, causal, *mod_args):
    mods, bias_grad = Mods.from_bwd_args(mod_args)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(mods.attn_bias) if bias_grad else q.new_empty(0),
            q.new_empty(0) if mods.sinks is None else torch.empty_like(mods.sinks))


def op_outputs(grads, q):
    """``(dq, dk, dv, dbias, dsinks)`` with None as an empty tensor, contiguous, as the backward ops return them."""
    return tuple(q.new_empty(0) if g is None else g.contiguous() for g in grads)


def _blockwise_fwd(q, k, v, scale, causal, *mod_args):
    mods = Mods.from_op_args(mod_args)
    o, lse = forward_varlen(q, k, v, scale, causal, mods) if mods.varlen else forward(q, k, v, scale, causal, mods)
    return o.contiguous(), lse


def _blockwise_grads(do, q, k, v, o, lse, dlse, scale, causal, mods: Mods, bias_grad: bool, deterministic=True):
    """The blockwise gradients (always deterministic: ``deterministic`` is the Triton path's choice)."""
    if mods.varlen:
        return gradients_varlen(do, q, k, v, o, lse, scale, causal, dlse, mods)
    return gradients(do, q, k, v, o, lse, scale, causal, dlse, mods, bias_grad=bias_grad)


def _blockwise_bwd(do, q, k, v, o, lse, dlse, scale, causal, *mod_args):
    return op_outputs(_blockwise_grads(do, q, k, v, o, lse, dlse, scale, causal, *Mods.from_bwd_args(mod_args)), q)


blockwise_fwd = torch.library.custom_op("onlineattn::blockwise_fwd", _blockwise_fwd, mutates_args=(), schema=FWD_SCHEMA)
blockwise_bwd = torch.library.custom_op("onlineattn::blockwise_bwd", _blockwise_bwd, mutates_args=(), schema=BWD_SCHEMA)
blockwise_fwd.register_fake(fake_forward)
blockwise_bwd.register_fake(fake_backward)


def save_for_backward(ctx, inputs, output):
    """``setup_context`` shared by both paths' forward ops: keep q, k, v, o, lse and the variants' small tensors
    (O(N) training memory; attn_bias is the caller's own tensor, referenced, not copied)."""
    q, k, v, scale, causal, *mod_args = inputs
    mods = Mods.from_op_args(mod_args)
    ctx.save_for_backward(q, k, v, *output, mods.alibi_slopes, mods.attn_bias, mods.sinks, mods.rng,
                          mods.cu_seqlens_q, mods.cu_seqlens_k)
    ctx.scale, ctx.causal = scale, causal
    ctx.set_materialize_grads(False)  # an unused lse (the usual case) reaches the backward as None, not zeros
    ctx.mod_scalars = (mods.window_left, mods.window_right, mods.softcap, mods.dropout_p, mods.max_seqlen_q,
                       mods.max_seqlen_k)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # a Parameter's __torch_function__ is the plain one


def plain_eager(*tensors) -> bool:
    """No torch.compile or functorch tracing, no TorchDispatchMode (selective checkpointing, make_fx, FLOP counters:
    they must see the op), and every tensor given (None skipped) a plain ``torch.Tensor`` or ``Parameter`` (no fake,
    functional or other subclass): a call that may skip its custom op and run the implementation directly."""
    return (not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and not torch._C._len_torch_dispatch_stack()
            and all(x is None or type(x) in _PLAIN_TYPES for x in tensors))


def _eager(*tensors) -> bool:
    """True in a plain eager backward: ``plain_eager`` and no graph being built over it (double backward must reach
    the op, which refuses it)."""
    return not torch.is_grad_enabled() and plain_eager(*tensors)


def autograd_formula(backward_op, direct):
    """The forward op's backward: call ``backward_op`` (the same path's backward custom op) with the saved tensors
    and hand each input its gradient (q, k, v, and attn_bias and sinks where they require it). In a plain eager
    backward, ``direct(do, q, k, v, o, lse, dlse, scale, causal, mods, bias_grad, deterministic)`` (the op's
    implementation, returning None for absent gradients) runs instead: the dispatcher's Python costs as much as a
    small kernel. ``deterministic`` is False only where the forward's eager Function set ``ctx.deterministic``
    (ops/forward.py); the ops' schemas have no such argument, so their backward is always deterministic."""

    def formula(ctx, do, dlse):
        q, k, v, o, lse, slopes, bias, sinks, rng, cu_q, cu_k = ctx.saved_tensors
        left, right, softcap, p, max_q, max_k = ctx.mod_scalars
        mods = Mods(left, right, softcap, slopes, bias, sinks, p, rng, cu_q, cu_k, max_q, max_k).canonical()
        bias_grad = bias is not None and ctx.needs_input_grad[_BIAS_INPUT]
        if do is None:  # only lse was used (grads are not materialised: an unused lse costs no zero-filled tensor)
            do = torch.zeros_like(o)
        args = (do, q, k, v, o, lse, dlse, ctx.scale, ctx.causal)
        if _eager(do, q):
            dq, dk, dv, dbias, dsinks = direct(*args, mods, bias_grad, getattr(ctx, "deterministic", True))
        elif mods is PLAIN:  # only the plain arguments: each further one costs the dispatcher time
            dq, dk, dv, dbias, dsinks = backward_op(*args)
        else:
            dq, dk, dv, dbias, dsinks = backward_op(*args, *mods.op_args(), bias_grad)
        grads = [dq, dk, dv] + [None] * (len(ctx.needs_input_grad) - 3)
        if bias_grad:
            grads[_BIAS_INPUT] = dbias
        if sinks is not None and ctx.needs_input_grad[_SINKS_INPUT]:
            grads[_SINKS_INPUT] = dsinks
        return tuple(grads)

    return formula


def refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        "onlineattn.attention is differentiable once: double backward (gradients of its gradients) is not supported"
    )


blockwise_fwd.register_autograd(autograd_formula(blockwise_bwd, _blockwise_grads), setup_context=save_for_backward)
blockwise_bwd.register_autograd(refuse_double_backward)


def attention(q, k, v, scale: float, causal: bool, mods: Mods = PLAIN):
    """Differentiable blockwise attention: ``(o, lse)``; with varlen mods, over packed sequences."""
    if mods is PLAIN:
        return blockwise_fwd(q, k, v, scale, causal)
    return blockwise_fwd(q, k, v, scale, causal, *mods.op_args())


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
