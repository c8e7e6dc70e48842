"""Dropout's random stream (``onlineattn.dropout``): the kernels and the torch path draw the same Philox words, the
keep rate is 1 − p, and a seed reproduces a call bit for bit. Exactness against the oracle given the mask is in
``test_variants.py`` (the dropout cases)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import onlineattn
from onlineattn.dropout import draw_rng_state, dropout_mask
from onlineattn.ops._common import dropout_keep

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def keep_mask_kernel(RNG, OUT, heads_q, seqlen_q, seqlen_k, dropout_p, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """The kernels' keep decisions for one (batch entry, head): ``OUT [B, Hq, Sq, Sk]`` as int8."""
    pid_bh = tl.program_id(0)
    b = pid_bh // heads_q
    h = pid_bh % heads_q
    i = tl.arange(0, BLOCK_M)[:, None]
    j = tl.arange(0, BLOCK_N)[None, :]
    keep = dropout_keep(RNG, i, j, h, b, heads_q, dropout_p)
    tl.store(OUT + pid_bh * seqlen_q * seqlen_k + i * seqlen_k + j, keep.to(tl.int8),
             mask=(i < seqlen_q) & (j < seqlen_k))


def test_kernel_and_torch_draw_the_same_mask():
    rng = draw_rng_state(torch.Generator().manual_seed(4), DEVICE)
    b, h, sq, sk, p = 2, 3, 30, 50, 0.4
    out = torch.full((b, h, sq, sk), 7, dtype=torch.int8, device=DEVICE)
    keep_mask_kernel[(b * h,)](rng, out, h, sq, sk, p, 32, 64)
    assert torch.equal(out.bool(), dropout_mask(rng, b, h, sq, sk, p))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_over_a_million_elements(p):
    keep = dropout_mask(draw_rng_state(torch.Generator().manual_seed(1)), 2, 4, 375, 350, p)  # 1.05M elements
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) <= 0.01 * (1 - p), rate
    per_head = keep.double().mean(dim=(2, 3))  # every (entry, head) stream is as fair
    assert torch.all((per_head - (1 - p)).abs() <= 0.02 * (1 - p)), per_head


def test_neighbouring_counters_are_not_correlated():
    """Adjacent keys, queries and heads share all but one counter word: their decisions must still be independent."""
    keep = dropout_mask(draw_rng_state(torch.Generator().manual_seed(2)), 1, 8, 256, 512, 0.5).double()
    for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[:, :, 1:], keep[:, :, :-1]), (keep[:, 1:], keep[:, :-1])):
        corr = torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1].item()
        assert abs(corr) < 0.01, corr


def _grads(backend, device, **kw):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 19, h, 16, generator=gen).to(device).requires_grad_() for h in (4, 2, 2))
    o = onlineattn.attention(q, k, v, causal=True, dropout_p=0.3, backend=backend, **kw)
    o.backward(torch.ones_like(o))
    return [o.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_same_seed_same_result_other_seed_other_result(backend):
    device = DEVICE if backend == "triton" else "cpu"
    run = lambda seed: _grads(backend, device, generator=torch.Generator(device).manual_seed(seed))
    first, again, other = run(10), run(10), run(11)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "same seed, different bits"
    assert all(not torch.equal(a, b) for a, b in zip(first, other)), "another seed gave the same result"
    torch.manual_seed(3)
    seeded = _grads(backend, device)
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(seeded, _grads(backend, device))), "torch.manual_seed does not fix it"
    assert not torch.equal(seeded[0], _grads(backend, device)[0]), "successive calls must draw fresh masks"


def test_both_backends_drop_the_same_elements():
    torch_path = _grads("torch", DEVICE, generator=torch.Generator(DEVICE).manual_seed(8))
    kernels = _grads("triton", DEVICE, generator=torch.Generator(DEVICE).manual_seed(8))
    for a, b in zip(torch_path, kernels):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_generator_of_another_device_type_is_refused():
    with pytest.raises(ValueError, match="generator"):
        draw_rng_state(torch.Generator(), "meta")
