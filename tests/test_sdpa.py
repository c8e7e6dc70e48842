"""``onlineattn.sdpa`` against ``F.scaled_dot_product_attention``'s math backend, under the rule of ENGINEERING.md §3.

The oracle is SDPA's math backend run in float64 on the same values (``reference`` has no masks); the baseline is the
same backend in the inputs' own dtype. Output and the gradients of query, key, value and a float mask are each held
to ``reference.assert_within_rule``. Fully masked rows: the contract says 0, so NaN from torch is read as 0.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import onlineattn
from onlineattn import reference as R

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _randn(shape, dtype, gen, device, scale=1.0):
    """Drawn in float32 on the CPU (the same values for every dtype and device at one seed), then converted."""
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _math_sdpa(q, k, v, mask, causal, scale, do, mask_grad):
    """SDPA's math backend: ``(o, dq, dk, dv, dmask)`` for the upstream gradient ``do`` (grads in the inputs' dtype)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    m = None if mask is None else mask.detach().clone().requires_grad_(mask_grad)
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=True)
    o = o.nan_to_num(0.0)  # the contract: a row that sees no key gives 0
    (o.double() * do.double()).sum().backward()
    grads = [x.grad.nan_to_num(0.0) for x in leaves] + [m.grad.nan_to_num(0.0) if mask_grad else None]
    return (o.detach(), *grads)


def _run(q, k, v, mask=None, causal=False, scale=None, gen=None, mask_grad=False):
    """Forward and backward of ``onlineattn.sdpa``; each result under the rule against float64 math SDPA."""
    dtype = q.dtype
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    m = None if mask is None else mask.detach().clone().requires_grad_(mask_grad)
    o = onlineattn.sdpa(*leaves, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=True)
    assert o.shape == q.shape[:-1] + v.shape[-1:] and o.dtype == dtype
    do = _randn(o.shape, dtype, gen, q.device)
    (o.double() * do.double()).sum().backward()
    to64 = lambda x: None if x is None else x.double() if x.dtype != torch.bool else x
    exact = _math_sdpa(*map(to64, (q, k, v, mask)), causal, scale, do.double(), mask_grad)
    baseline = _math_sdpa(q, k, v, mask, causal, scale, do, mask_grad)
    ours = [o] + [x.grad for x in leaves] + [m.grad if mask_grad else None]
    for name, got, want, base in zip(("o", "dq", "dk", "dv", "dmask"), ours, exact, baseline):
        if got is not None:
            R.assert_within_rule(f"sdpa {name}", got, want, base, _name(dtype))
    return o


# (B, Hq, Hkv, L, S, E, Ev): odd lengths, L != S both ways, GQA and MQA, head dims that are not powers of two
SHAPES = [
    (2, 4, 2, 17, 17, 16, 16),
    (1, 6, 3, 1, 129, 40, 24),
    (2, 4, 1, 129, 17, 24, 24),
    (1, 2, 2, 300, 301, 8, 12),
]
SHAPE_IDS = ["square", "one-query", "mqa-long-q", "multiblock"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unmasked_matches_math_sdpa(shape, causal, dtype, device):
    """No mask: the route through ``attention``, with top-left causal handled for every L vs S."""
    b, hq, hkv, sq, sk, d, dv = shape
    gen = torch.Generator().manual_seed(sq * 7 + sk + causal)
    q, k, v = (_randn(s, dtype, gen, device) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    _run(q, k, v, causal=causal, gen=gen)


def _masks(kind, b, hq, sq, sk, dtype, gen, device):
    """Random masks: bool broadcast over heads with some rows all False, bool [L, S], float per head with -inf."""
    if kind == "bool-padding":
        mask = torch.rand((b, 1, sq, sk), generator=gen) < 0.7
        mask[:, :, sq // 2] = False  # a fully masked query row
        mask[0, :, :, sk // 2 :] = False  # padding: the second half of sequence 0's keys
    elif kind == "bool-2d":
        mask = torch.rand((sq, sk), generator=gen) < 0.5
    else:
        mask = torch.randn((b, hq, sq, sk), generator=gen)
        mask[mask < -1.0] = float("-inf")
        mask[..., 0, :] = float("-inf")  # row 0 of every head sees nothing
        mask = mask.to(dtype)
    return mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kind", ["bool-padding", "bool-2d", "float"])
def test_masked_matches_math_sdpa(kind, shape, dtype, device):
    b, hq, hkv, sq, sk, d, dv = shape
    gen = torch.Generator().manual_seed(sq + 3 * sk + len(kind))
    q, k, v = (_randn(s, dtype, gen, device) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    mask = _masks(kind, b, hq, sq, sk, dtype, gen, device)
    o = _run(q, k, v, mask=mask, gen=gen, mask_grad=kind == "float")
    if kind != "bool-2d":  # the rows built to see no key give exactly 0
        row = sq // 2 if kind == "bool-padding" else 0
        assert torch.equal(o[..., row, :], torch.zeros_like(o[..., row, :]))


@pytest.mark.parametrize("dtype, q_scale", [(torch.float32, 1.0), (torch.float16, 30.0), (torch.float16, 100.0)])
def test_non_contiguous_and_scaled_logits(dtype, q_scale):
    """Transposed and sliced views and an explicit scale; in fp16, q scaled by 30-100 so the raw scores reach the
    thousands (float32 is held to 1e-5 relative, which such ill-conditioned gradients cannot meet in any float32
    computation, so it runs at scale 1)."""
    gen = torch.Generator().manual_seed(5)
    q = _randn((2, 33, 4, 48), dtype, gen, "cpu", scale=q_scale).transpose(1, 2)[..., :40]  # [2, 4, 33, 40]
    k = _randn((2, 2, 60, 40), dtype, gen, "cpu")[:, :, 7:52]
    v = _randn((2, 45, 2, 24), dtype, gen, "cpu").transpose(1, 2)
    mask = torch.rand((2, 1, 33, 45), generator=gen) < 0.8
    assert not any(x.is_contiguous() for x in (q, k, v))
    _run(q, k, v, mask=mask, gen=gen, scale=0.2)
    _run(q, k, v, causal=True, gen=gen, scale=0.2)


def test_three_and_five_dim_inputs():
    """SDPA takes any leading dims: [H, L, E] and [B, X, H, L, E] give what the 4-D call gives."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_randn((2, 3, 4, 9, 16), torch.float64, gen, "cpu") for _ in range(3))
    mask = torch.rand((3, 1, 9, 9), generator=gen) < 0.6
    _run(q, k, v, mask=mask, gen=gen)
    _run(q[0, 0], k[0, 0], v[0, 0], causal=True, gen=gen)


def test_masks_reach_the_kernels_as_attn_bias():
    """A mask becomes attention's attn_bias, so the Triton kernels take it too (interpreted on CPU), padding rows and
    an all-False row included, and agree with the torch path."""
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(2, 4, 5, 16, generator=gen) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False  # padding in sequence 1
    mask[0, 0, 2] = False  # one query of sequence 0 sees nothing
    on_torch = onlineattn.sdpa(q, k, v, attn_mask=mask, backend="torch")
    assert torch.all(on_torch[0, :, 2] == 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreted kernels need TRITON_INTERPRET=1 (set by conftest.py where CUDA is absent)")
    on_kernels = onlineattn.sdpa(*(x.to(device) for x in (q, k, v)), attn_mask=mask.to(device), backend="triton")
    torch.testing.assert_close(on_kernels.cpu(), on_torch, rtol=1e-5, atol=1e-5)


BAD_CALLS = {
    "mask-and-causal": (dict(attn_mask=torch.ones(3, 5, dtype=torch.bool), is_causal=True), ValueError, "is_causal"),
    "dropout-range": (dict(dropout_p=1.5), ValueError, "dropout_p"),
    "gqa-off": (dict(kv_heads=2), ValueError, "enable_gqa=True"),
    "gqa-not-dividing": (dict(kv_heads=3, enable_gqa=True), ValueError, "3 heads, which does not divide"),
    "mask-shape": (dict(attn_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    "mask-dtype": (dict(attn_mask=torch.ones(3, 5, dtype=torch.int32)), TypeError, "attn_mask must be bool"),
    "scale": (dict(scale="0.1"), TypeError, "scale must be"),
    "scale-nan": (dict(scale=float("nan")), ValueError, "scale must be 0 or finite"),
    "scale-past-float32": (dict(scale=1e39), ValueError, "scale must be 0 or finite .* float32"),
    "dropout-type": (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    "gqa-type": (dict(enable_gqa="yes"), TypeError, "enable_gqa must be a Python bool"),
    "causal-type": (dict(is_causal=1), TypeError, "is_causal must be a Python bool"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_name_the_argument(case):
    kwargs, error, message = BAD_CALLS[case]
    kwargs = dict(kwargs)
    hkv = kwargs.pop("kv_heads", 4)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, hkv, 5, 8)
    with pytest.raises(error, match=message):
        onlineattn.sdpa(q, k, k, **kwargs)


def test_mismatched_tensors_are_refused():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(TypeError, match="share one dtype"):
        onlineattn.sdpa(q, q.double(), q)
    with pytest.raises(ValueError, match="head dim must equal"):
        onlineattn.sdpa(q, torch.randn(1, 4, 3, 6), torch.randn(1, 4, 3, 6))
    with pytest.raises(ValueError, match="at least 3 dims"):
        onlineattn.sdpa(q[0, 0], q[0, 0], q[0, 0])


def test_dropout_is_attentions_and_follows_the_seed():
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(onlineattn.sdpa(q, k, v, dropout_p=0.25, backend="torch"))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], onlineattn.sdpa(q, k, v))
