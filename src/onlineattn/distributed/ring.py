"""Ring attention (context parallelism) over ``torch.distributed``: each rank holds a shard of one long sequence.

Forward. Every rank keeps its query shard and passes its K/V shard to the next rank, ``world − 1`` times, so after
``world`` steps each query shard has met every key shard. Each step computes the visible blocks with onlineattn's own
kernels (``layout.step_blocks`` says which) and folds their ``(o, lse)`` into a running state with the exact merge
(``torch_impl.merge_states``), accumulated in float32 (float64 for float64 inputs). The transfer for step t + 1 is
started before step t's attention and awaited after it, so communication hides behind compute.

Backward (FlashAttention-2's, per block). It needs only the global o and lse of the forward: each block's
probabilities are recomputed from the global lse, so block gradients simply add up. K/V travel around the ring again,
and with each K/V shard travels its float32 dK/dV accumulator; every rank adds its contribution and passes it on,
and after ``world`` transfers the accumulator is back with its owner. dQ accumulates locally.

Transport: ``batch_isend_irecv`` to the next rank and from the previous one, NCCL for CUDA tensors and gloo for CPU
tensors. Every rank of the group must make the same call (and, when training, run the backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import _validate as V
from .. import torch_impl
from ..api import _resolve_backend
from .layout import LAYOUTS, check_layout, step_blocks


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch_impl._compute_dtype(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Transport


class _Transfer:
    """Tensors on their way from the previous rank; ``wait()`` returns them once they have arrived."""

    def __init__(self, received: list[torch.Tensor], requests: list):
        self.received, self.requests = received, requests

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        self.requests = []
        return self.received


class _Ring:
    """This rank's place in ``group``, and the ring's one move: send to the next rank, receive from the previous."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        whole = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(whole, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.world)

    def shift(self, tensors) -> _Transfer:
        """Start sending ``tensors`` (contiguous) to the next rank and receiving the previous rank's into new buffers.

        With one rank the next rank is this one, so the tensors themselves are what "arrives".
        """
        if self.world == 1:
            return _Transfer(list(tensors), [])
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return _Transfer(received, dist.batch_isend_irecv(ops))


# ---------------------------------------------------------------------------------------------------------------
# One block: onlineattn's kernels, outputs left in the accumulation dtype so that nothing is rounded before the merge


def _use_triton(q: torch.Tensor) -> bool:
    """Triton for CUDA tensors of a kernel dtype, the torch path otherwise: ``attention``'s ``backend="auto"`` rule."""
    return _resolve_backend("auto", q=q) == "triton"


def _block_forward(q, k, v, scale: float, causal: bool):
    """``q [B, m, Hq, D]`` against ``k [B, l, Hkv, D]``, ``v [B, l, Hkv, Dv]`` -> ``o [B, m, Hq, Dv]`` and
    ``lse [B, Hq, m]``, both float32 (float64 for float64 inputs)."""
    if _use_triton(q):
        from ..ops import forward as triton_forward

        o = torch.empty((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
        return triton_forward.forward(q, k, v, scale, causal, out=o)
    cdt = _accum_dtype(q.dtype)  # the torch path computes in cdt anyway; converting first keeps its output there
    return torch_impl.forward(q.to(cdt), k.to(cdt), v.to(cdt), scale, causal)


def _block_backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse):
    """One block's ``(dq, dk, dv)``, in float32 (float64 for float64), from the GLOBAL o ``[B, m, Hq, Dv]`` and
    lse ``[B, Hq, m]`` of these query rows; ``dlse`` (or None) is the gradient flowing into that lse."""
    if _use_triton(q):
        from ..ops import backward as triton_backward

        out = tuple(torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
        return triton_backward.backward(do, q, k, v, o, lse, scale, causal, dlse, out=out)
    cdt = _accum_dtype(q.dtype)
    return torch_impl.backward(*(x.to(cdt) for x in (do, q, k, v, o)), lse, scale, causal, dlse=dlse)


# ---------------------------------------------------------------------------------------------------------------
# The two rings


def _ring_forward(q, k, v, scale: float, causal: bool, layout: str, ring: _Ring, overlap: bool):
    """Local ``o [B, n, Hq, Dv]`` in q's dtype and ``lse [B, Hq, n]`` (float32, float64 for float64)."""
    b, n, hq, _ = q.shape
    cdt = _accum_dtype(q.dtype)
    o = torch.zeros((b, n, hq, v.shape[3]), dtype=cdt, device=q.device)
    lse = torch.full((b, hq, n), float("-inf"), dtype=cdt, device=q.device)  # the empty state: merging is exact
    kv = (k, v)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world  # whose K/V this rank holds now
        incoming = ring.shift(kv) if step + 1 < ring.world else None
        if incoming is not None and not overlap:
            incoming.wait()
        for blk in step_blocks(layout, causal, ring.rank, src, n):
            o_b, lse_b = _block_forward(q[:, blk.rows], kv[0][:, blk.cols], kv[1][:, blk.cols], scale, blk.causal)
            o[:, blk.rows], lse[:, :, blk.rows] = torch_impl.merge_states(
                o[:, blk.rows], lse[:, :, blk.rows], o_b, lse_b
            )
        if incoming is not None:
            kv = tuple(incoming.wait())
    return o.to(q.dtype), lse


def _ring_backward(do, dlse, q, k, v, o, lse, scale: float, causal: bool, layout: str, ring: _Ring, overlap: bool):
    """Local ``(dq, dk, dv)`` in the inputs' dtypes; ``dlse`` may be None."""
    cdt = _accum_dtype(q.dtype)
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    kv = (k, v)
    travelling = None  # dK/dV of the K/V shard this rank holds, summed over the ranks it has visited
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        incoming = ring.shift(kv) if step + 1 < ring.world else None
        if incoming is not None and not overlap:
            incoming.wait()
        contributions = []
        for blk in step_blocks(layout, causal, ring.rank, src, n):
            rows = blk.rows
            dq_b, dk_b, dv_b = _block_backward(
                do[:, rows], q[:, rows], kv[0][:, blk.cols], kv[1][:, blk.cols], o[:, rows], lse[:, :, rows],
                scale, blk.causal, None if dlse is None else dlse[:, :, rows],
            )
            dq[:, rows] += dq_b
            contributions.append((blk.cols, dk_b, dv_b))
        # Only now wait for the accumulator: its transfer ran while this step's blocks computed.
        if travelling is None:
            dk, dv = torch.zeros(k.shape, dtype=cdt, device=k.device), torch.zeros(v.shape, dtype=cdt, device=v.device)
        else:
            dk, dv = travelling.wait()
        for cols, dk_b, dv_b in contributions:
            dk[:, cols] += dk_b
            dv[:, cols] += dv_b
        travelling = ring.shift((dk, dv))  # after the last step this carries every shard's dK/dV home
        if not overlap:
            travelling.wait()
        if incoming is not None:
            kv = tuple(incoming.wait())
    dk, dv = travelling.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Saves q, k, v and the local o and lse only; the backward is the second ring."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, ring, overlap):
        o, lse = _ring_forward(q, k, v, scale, causal, layout, ring, overlap)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, causal, layout, ring, overlap)
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not a tensor of zeros
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only lse was used
            do = torch.zeros_like(o)
        dq, dk, dv = _ring_backward(do, dlse, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Validation: local checks raise before any communication; one small all_gather then checks that the ranks agree.

_AGREED = ("batch", "q_local length", "q heads", "kv heads", "head dim", "v head dim", "dtype", "layout", "causal",
           "softmax_scale")


def _check_group(group) -> _Ring:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group (NCCL for CUDA tensors, gloo for CPU tensors) on every rank first"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group does not contain this rank; call ring_attention only on the group's members")
    return _Ring(group)


def _check_transport(ring: _Ring, q) -> None:
    """NCCL carries CUDA tensors and gloo CPU tensors; refuse a pairing that would fail inside the ring."""
    if ring.world == 1:
        return  # nothing travels
    backend = str(dist.get_backend(ring.group))
    if ("nccl" if q.is_cuda else "gloo") not in backend:
        raise ValueError(
            f"q_local is on {q.device}, which the group's backend {backend!r} does not carry between ranks: "
            "use NCCL for CUDA tensors and gloo for CPU tensors"
        )
    if q.is_cuda and q.device.index != torch.cuda.current_device():  # NCCL works on the current device
        raise ValueError(
            f"q_local is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
            "call torch.cuda.set_device on each rank before initialising NCCL"
        )


def _check_agreement(ring: _Ring, values: tuple) -> None:
    """All-gather every rank's ``_AGREED`` values (one small float64 tensor) and raise on every rank if they differ."""
    if ring.world == 1:
        return
    mine = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend(ring.group) == "nccl":  # NCCL moves CUDA tensors only
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(gathered, mine, group=ring.group)
    table = torch.stack(gathered).cpu()
    differ = [i for i in range(len(_AGREED)) if not torch.all(table[:, i] == table[0, i])]
    if differ:
        def shown(i, x):
            if _AGREED[i] == "dtype":
                return str(V.FLOAT_DTYPES[int(x)]).replace("torch.", "")
            if _AGREED[i] == "layout":
                return LAYOUTS[int(x)]
            return float(x) if _AGREED[i] == "softmax_scale" else int(x)

        per_rank = "; ".join(
            f"rank {r}: " + ", ".join(f"{_AGREED[i]} {shown(i, table[r, i])}" for i in differ)
            for r in range(ring.world)
        )
        raise ValueError(
            f"ring_attention's arguments must agree across ranks, but {', '.join(_AGREED[i] for i in differ)} "
            f"differ (q_local, k_local, v_local shapes, dtype, layout, causal, softmax_scale): {per_rank}"
        )


def ring_attention(
    q_local,
    k_local,
    v_local,
    *,
    causal=False,
    layout="contiguous",
    softmax_scale=None,
    group=None,
    return_lse=False,
    _overlap=True,
):
    """Exact attention over a sequence sharded across the ranks of ``group``; returns this rank's output shard.

    Args:
        q_local: ``[batch, n, heads_q, head_dim]``, this rank's n query tokens (``shard_sequence`` of the full q).
        k_local: ``[batch, n, heads_kv, head_dim]``, the same tokens' keys; ``heads_q % heads_kv == 0`` (GQA/MQA).
        v_local: ``[batch, n, heads_kv, head_dim_v]``.
        causal: causal over GLOBAL positions (the full sequence has Sq = Sk, so top-left = bottom-right).
        layout: how the shards were cut, ``"contiguous"`` or ``"zigzag"`` (n must then be even); see ``layout.py``.
            With causal masking, zigzag gives every rank the same work at every step and skips hidden blocks.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        group: the process group forming the ring (default: the whole world). Rank order is ring order.
        return_lse: also return the local lse shard.
        _overlap: internal, for benchmarks only: False waits for each transfer before computing (no overlap).

    Returns:
        ``o_local [batch, n, heads_q, head_dim_v]`` in q's dtype; with ``return_lse`` also
        ``lse_local [batch, heads_q, n]`` (natural log, float32; float64 for float64 inputs). Differentiable with
        respect to all three inputs, through o and lse; every rank must then run the backward, as for any collective.

    Raises, before any communication: ``RuntimeError`` without an initialised process group, ``TypeError`` /
    ``ValueError`` for bad local arguments (unknown layout, ``q_local`` and ``k_local`` of different lengths, odd n with
    zigzag, a device the backend cannot carry). Then one all_gather of the shapes and keywords: ``ValueError`` on every
    rank if the ranks disagree. Per-block compute is Triton for CUDA fp16/bf16/fp32 tensors, the torch path otherwise.

    Example (a ring of one process; with torchrun every rank runs the same lines on its own shard):
        >>> import tempfile, torch, torch.distributed as dist
        >>> from onlineattn import attention
        >>> from onlineattn.distributed import ring_attention
        >>> store = tempfile.NamedTemporaryFile(delete=False).name
        >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        >>> q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float64) for _ in range(3))
        >>> o = ring_attention(q, k, v, causal=True, layout="zigzag")
        >>> torch.allclose(o, attention(q, k, v, causal=True), atol=1e-12)
        True
        >>> dist.destroy_process_group()
    """
    ring = _check_group(group)
    dims = V.check_qkv(q_local, k_local, v_local)
    if dims.seqlen_q != dims.seqlen_k:
        raise ValueError(f"q_local and k_local must hold the same tokens (equal shard lengths), got q_local "
                         f"{dims.seqlen_q} and k_local {dims.seqlen_k}")
    if dims.seqlen_q == 0:
        raise ValueError("q_local must hold at least one token, got 0")
    layout = check_layout(layout)
    if layout == "zigzag" and dims.seqlen_q % 2:
        raise ValueError(f"zigzag shards hold two equal chunks, so q_local's length must be even, got {dims.seqlen_q}")
    scale = V.check_scale(softmax_scale, dims.head_dim)
    causal = V.check_bool("causal", causal)
    return_lse = V.check_bool("return_lse", return_lse)
    _check_transport(ring, q_local)
    _check_agreement(ring, (dims.batch, dims.seqlen_q, dims.heads_q, dims.heads_kv, dims.head_dim, dims.head_dim_v,
                            V.FLOAT_DTYPES.index(q_local.dtype), LAYOUTS.index(layout), causal, scale))
    # Contiguous K/V: they are sent as they are. The copy (if any) is part of the autograd graph.
    q_local, scale = V.positive_scale(q_local, scale)  # the kernels' need, on every rank alike
    o, lse = _RingAttention.apply(q_local, k_local.contiguous(), v_local.contiguous(), scale, causal, layout, ring,
                                  bool(_overlap))
    return (o, lse) if return_lse else o
