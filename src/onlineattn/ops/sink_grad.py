"""The gradient of the sinks in Triton: one small kernel after the backward's kernels (and their delta).

A sink is one more logit per head in every row's softmax, with no value, so its probability in a row is
``exp(sink − lse)`` (lse includes it) and its gradient is ``dsink = −Σ_{batch, rows} exp(sink − lse) · delta``, with
``delta = rowsum(dO ∘ O) − dlse``. One program per head sums its rows in a fixed order: deterministic, no
atomics. It replaces about seven elementwise torch calls, whose host time (tens of µs each on the H200's host) came
to more than a small call's kernels (NOTES v35). A program reads its head's rows one block after another, so with
few heads over many rows those torch calls, which spread over the whole GPU, run instead (``kernel_is_faster``).

Read top-down: the kernel, then the launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch

# Device time, µs, do_bench median with L2 cleared (NOTES v35, sg43.py), this kernel at 1024 rows a block and 4 warps
# | 4096 and 8 warps | the torch calls: B · Hq · S = 1 · 16 · 4096 8.9 | 6.5 | 105.5; 1 · 64 · 131072 142.1 | 74.5 |
# 143.1; 64 · 64 · 4096 242.3 | 132.5 | 281.3; 32 · 8 · 8192 230.4 | 120.1 | 108.6; 16 · 8 · 131072 1811.5 | 925.6 |
# 276.6. The kernel's time follows the rows a head (B · S: its programs run side by side), the torch calls' the bytes
# of lse and delta (8 · B · Hq · S). Fitted to those five: kernel ≈ 5 + 4.5e-4 · B · S, torch ≈ 85 + 1.4e-6 · bytes,
# and the faster by that fit runs (the kernel at every Hq past ~40; at Hq = 8 up to ~220k rows a head).
SINK_GRAD_ROWS = 4096  # rows a program reads at once: 32 KiB of lse and delta
SINK_GRAD_KERNEL_US = (5.0, 4.5e-4)  # µs: a launch, a row of a head
SINK_GRAD_TORCH_US = (85.0, 1.4e-6)  # µs: the launches, a byte of lse and delta


@triton.jit
def sink_grad_kernel(
    LSE, DELTA, SINKS, DSINKS,
    stride_lb, stride_lh, stride_ls,
    stride_db, stride_dh, stride_ds,
    batch, rows,
    BLOCK: tl.constexpr,
):
    """Program h: ``DSINKS[h] = −Σ_{b, s} exp(SINKS[h] − LSE[b, h, s]) · DELTA[b, h, s]``. A row whose lse is
    −inf saw no key and has a sink of −inf: its probability is 0, as exp(−inf − inf), not exp(−inf + inf) = NaN."""
    h = tl.program_id(0)
    sink = tl.load(SINKS + h).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    lse_row, delta_row = LSE + h * stride_lh, DELTA + h * stride_dh
    for _ in range(batch):  # the pointers step a batch entry at a time (64-bit: no int32 product of b · stride)
        for start in range(0, rows, BLOCK):
            s = start + offs
            lse = tl.load(lse_row + s * stride_ls, mask=s < rows, other=float("inf"))
            delta = tl.load(delta_row + s * stride_ds, mask=s < rows, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
            acc += tl.exp(sink - lse) * delta
        lse_row += stride_lb
        delta_row += stride_db
    tl.store(DSINKS + h, (-tl.sum(acc, axis=0)).to(DSINKS.dtype.element_ty))


def sink_grad(sinks: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """``dsinks [Hq]`` in sinks' dtype from float32 ``lse`` and ``delta [B, Hq, S]`` (any strides); None without
    sinks."""
    if sinks is None:
        return None
    if lse.shape != delta.shape or lse.dim() != 3 or sinks.shape != (lse.shape[1],):
        raise ValueError(f"sink_grad: lse and delta [B, Hq, S] with sinks [Hq]; got {tuple(lse.shape)}, "
                         f"{tuple(delta.shape)}, {tuple(sinks.shape)}")
    if not kernel_is_faster(*lse.shape):
        p_sink = torch.exp(sinks.float()[None, :, None] - lse.masked_fill(lse == float("-inf"), float("inf")))
        return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
    dsinks = torch.empty(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    if dsinks.numel():
        launch(sink_grad_kernel, (sinks.shape[0],), lse, delta, sinks.contiguous(), dsinks, *lse.stride(),
               *delta.stride(), lse.shape[0], lse.shape[2], BLOCK=SINK_GRAD_ROWS, num_warps=8)
    return dsinks


def kernel_is_faster(batch: int, heads: int, rows: int) -> bool:
    """Whether the kernel beats the torch calls over ``[batch, heads, rows]`` by the fit above (device time)."""
    n = batch * rows
    return (SINK_GRAD_KERNEL_US[0] + SINK_GRAD_KERNEL_US[1] * n
            <= SINK_GRAD_TORCH_US[0] + SINK_GRAD_TORCH_US[1] * 8 * n * heads)
