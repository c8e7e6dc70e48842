"""The sinks' gradient kernel (ops/sink_grad.py) against the formula in float64, in the interpreter or on the GPU."""

import numpy as np
import pytest
import torch

from onlineattn.ops import sink_grad as SG
from onlineattn.ops.sink_grad import SINK_GRAD_ROWS, sink_grad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # CPU tensors: the kernel runs in the interpreter


def _exact(sinks, lse, delta) -> np.ndarray:
    s, lse, delta = (x.double().cpu().numpy() for x in (sinks, lse, delta))
    lse = np.where(lse == -np.inf, np.inf, lse)  # a row that saw no key has a sink of -inf: probability 0
    return -(np.exp(s[None, :, None] - lse) * delta).sum(axis=(0, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,rows", [(1, 5), (3, SINK_GRAD_ROWS + 37), (2, 0), (0, 7)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["kernel", "torch"])
def test_matches_the_formula(batch, rows, dtype, device, route, monkeypatch):
    """Rows past one block and not a multiple of it, a batch, no rows, no batch; delta through strides (as the
    backward's empty calls make it); a -inf sink over rows that saw no key (lse -inf); sinks stored in bfloat16;
    the kernel and the torch calls that run where they are faster (few heads over many rows)."""
    monkeypatch.setattr(SG, "kernel_is_faster", lambda *shape: route == "kernel")
    g = torch.Generator().manual_seed(batch * 1000 + rows)
    heads = 3
    sinks = torch.randn(heads, generator=g).to(dtype)
    sinks[2] = float("-inf")
    lse = (torch.randn(batch, heads, rows, generator=g) + 2).float()
    lse[:, 2, ::3] = float("-inf")
    delta = torch.randn(batch, rows, heads, generator=g).float().transpose(1, 2)  # [B, H, S], rows strided
    got = sink_grad(sinks.to(device), lse.to(device), delta.to(device))
    assert got.dtype == dtype and got.shape == (heads,)
    want = _exact(sinks, lse, delta)
    assert np.isfinite(got.float().cpu().numpy()).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.double().cpu().numpy(), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def test_without_sinks_and_bad_shapes():
    lse = torch.zeros(1, 2, 4, device=DEVICE)
    assert sink_grad(None, lse, lse) is None
    with pytest.raises(ValueError, match="sink_grad"):
        sink_grad(torch.zeros(3, device=DEVICE), lse, lse)
    with pytest.raises(ValueError, match="sink_grad"):
        sink_grad(torch.zeros(2, device=DEVICE), lse, lse[:, :, :3])


def test_the_fit_picks_the_faster_at_each_measured_shape():
    """sg43.py's five shapes (NOTES v35): the kernel at 1 · 16 · 4096, 1 · 64 · 131072 and 64 · 64 · 4096, the torch
    calls at 32 · 8 · 8192 and 16 · 8 · 131072."""
    picks = [SG.kernel_is_faster(b, h, s) for b, h, s in
             ((1, 16, 4096), (1, 64, 131072), (64, 64, 4096), (32, 8, 8192), (16, 8, 131072))]
    assert picks == [True, True, True, False, False]
