"""The score variants of issue #6 as one value that every backend takes: ``Mods``.

The logit of query i and key j (indices within their sequence; ``diag = Sk − Sq``) is

    x_ij = softcap · tanh(scale · q_i·k_j / softcap)        (just scale · q_i·k_j when softcap = 0)
           − slope_h · |i + diag − j|                        (ALiBi)
           + attn_bias[b, h, i, j]                           (additive bias, broadcast)

and it is hidden (−inf) outside the band ``i + diag − left ≤ j ≤ i + diag + right`` of ``window_size = (left,
right)`` (−1: unbounded on that side; causal sets right = 0, as in flash-attn). A sink adds ``exp(sink_h)`` to each
row's normaliser, with no value; lse includes it, so ``P = exp(x − lse)`` holds in the backward as in the plain
case. Dropout zeroes probabilities after the normaliser (lse is not affected) and scales the kept ones by
``1 / (1 − p)``.

``Mods.op_args()`` flattens a value into the trailing arguments of the custom ops' schemas (``MOD_SCHEMA``), and
``Mods.from_op_args`` rebuilds it, so the torch path and the Triton path share one signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch

UNBOUNDED = 2**30  # a window side of -1 becomes this in the kernels: farther than any index can reach

MOD_SCHEMA = (
    "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? attn_bias=None, "
    "Tensor? sinks=None, float dropout_p=0.0, Tensor? rng=None, Tensor? cu_seqlens_q=None, "
    "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0"
)


@dataclass(frozen=True, eq=False)  # tensors inside: identity, not elementwise ==
class Mods:
    """Everything ``attention`` does beyond plain (causal) softmax attention. The defaults change nothing.

    Shapes (B = batch, or number of sequences for varlen): ``alibi_slopes [Hq]`` or ``[B, Hq]``; ``attn_bias``
    broadcastable to ``[B, Hq, Sq, Sk]``; ``sinks [Hq]``; ``rng`` int64 ``[3]`` (see ``onlineattn.dropout``);
    ``cu_seqlens_q [B + 1]``, ``cu_seqlens_k [B + 1]`` int32 for packed ``(total, H, D)`` inputs.
    """

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    attn_bias: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    rng: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    batch0: int = field(default=0, compare=False)  # a launch over a slice of the batch: its first entry

    def op_args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "batch0")

    @classmethod
    def from_op_args(cls, args) -> "Mods":
        """The inverse of ``op_args``. The dispatcher passes an op's arguments positionally up to the last one given,
        so trailing defaults may be missing; they take the field defaults. Defaults alone give ``PLAIN`` itself,
        whose launches skip every variant's Python (``mods is PLAIN``)."""
        return cls(*args).canonical() if args else PLAIN

    def canonical(self) -> "Mods":
        """``PLAIN`` when every field has its default (a plain call rebuilt from saved state), else ``self``."""
        plain = self.window_left == -1 and self.window_right == -1 and self.sinks is None and self.window_sinks_only
        return PLAIN if plain else self

    def softcap_in(self, scale: float, largest: float) -> float:
        """The factor inside the softcap's tanh, ``scale / softcap`` (0 without softcap), at most ``largest`` (the
        compute dtype's): past it the factor is inf, and a score of 0 gives 0 · inf = NaN; tanh saturated long before.
        Applied to the raw ``q·k``, so no scale the API takes overflows before the tanh bounds it."""
        return min(scale / self.softcap, largest) if self.softcap > 0 else 0.0

    @property
    def window_sinks_only(self) -> bool:
        """Every variant is a sliding window or sinks (one batch launch, not varlen): what the Hopper forward runs
        (true of ``PLAIN`` too)."""
        return (self.softcap == 0.0 and self.dropout_p == 0.0 and self.max_seqlen_q == 0 and self.max_seqlen_k == 0
                and self.batch0 == 0 and all(getattr(self, name) is None for name in _TENSOR_FIELDS if name != "sinks"))

    @classmethod
    def from_bwd_args(cls, args) -> tuple["Mods", bool]:
        """The variants and ``bias_grad`` from the trailing arguments of a backward op."""
        n = len(fields(cls)) - 1  # batch0 is not an op argument
        return cls.from_op_args(args[:n]), bool(args[n]) if len(args) > n else False

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    def band(self, causal: bool) -> Optional[tuple[int, int]]:
        """``(left, right)`` of a sliding window with unbounded sides as ``UNBOUNDED`` and causal folded in
        (right = 0); None without a window, where plain causal masking applies."""
        if (self.window_left, self.window_right) == (-1, -1):
            return None
        left = UNBOUNDED if self.window_left < 0 else self.window_left
        right = 0 if causal else (UNBOUNDED if self.window_right < 0 else self.window_right)
        return left, right

    def batch_slice(self, batch: slice) -> "Mods":
        """The mods of batch entries ``batch`` launched on their own (CUDA's grid limit): their ALiBi rows and bias
        entries, and ``batch0`` so that dropout still counts entries from the call's first."""
        if self is PLAIN or batch == slice(None):
            return self
        slopes, bias = self.alibi_slopes, self.attn_bias
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[batch]
        if bias is not None and bias_4d(bias).shape[0] != 1:
            bias = bias_4d(bias)[batch]
        cu_q, cu_k = self.cu_seqlens_q, self.cu_seqlens_k
        if self.varlen:  # the slice's offsets (still absolute into the packed tensors)
            cu_q, cu_k = cu_q[batch.start : batch.stop + 1], cu_k[batch.start : batch.stop + 1]
        return replace(self, alibi_slopes=slopes, attn_bias=bias, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       batch0=batch.start or 0)

    def sequence(self, b: int) -> "Mods":
        """The mods of varlen sequence ``b`` as one batch entry (its ALiBi row; bias is not supported with varlen)."""
        slopes = self.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b : b + 1]
        return replace(self, alibi_slopes=slopes, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                       max_seqlen_k=0)


PLAIN = Mods()
_TENSOR_FIELDS = ("alibi_slopes", "attn_bias", "sinks", "rng", "cu_seqlens_q", "cu_seqlens_k")


def bias_4d(bias: torch.Tensor) -> torch.Tensor:
    """``attn_bias`` viewed with 4 dims (leading 1s added), so each dim is 1 (broadcast) or the full size."""
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


def reduce_to_bias(grad: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sum a ``[B, Hq, Sq, Sk]`` gradient over the dims that ``bias`` broadcasts, into ``bias``'s shape."""
    shape4 = bias_4d(bias).shape
    dims = [d for d in range(4) if shape4[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(bias.shape)
