"""The blockwise torch path (``backend="torch"``) against the float64 oracle, under the rule of ENGINEERING.md §3.

Forward o and lse and the gradients dq, dk, dv are each held to ``reference.assert_within_rule``: error vs float64 at
most 2x that of torch math attention in the same dtype (the baseline) plus 2 rounding quanta; float32 within 1e-5 and
float64 within 1e-12, relative to the largest exact value.
"""

from __future__ import annotations

import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn import torch_impl

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
LSE_DTYPE = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _randn(shape, dtype, gen, scale=1.0):
    """Normal samples drawn in float32 (the same values for every dtype at one seed), then rounded to ``dtype``."""
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _check(name, ours, exact, baseline, dtype):
    R.assert_within_rule(name, ours, exact, baseline, _name(dtype))


def _leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def _baseline(q, k, v, do, causal, scale=None, dlse=None):
    """Torch math attention in the inputs' dtype: (o, lse, dq, dk, dv) with the same upstream gradients."""
    qb, kb, vb = _leaves(q, k, v)
    o, lse = R.torch_math_attention(qb, kb, vb, causal=causal, softmax_scale=scale)
    loss = (o.float() * do.float()).sum()
    if dlse is not None:
        loss = loss + (lse.float().masked_fill(torch.isinf(lse), 0.0) * dlse).sum()
    loss.backward()
    return o.detach(), lse.detach(), qb.grad, kb.grad, vb.grad


def _run_and_check(q, k, v, causal, dtype, gen, scale=None):
    """Forward and backward of the torch path on (possibly non-contiguous) q, k, v, each output under the rule."""
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[3]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = onlineattn.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, backend="torch")
    assert o.shape == (b, sq, hq, dv) and o.dtype == dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == LSE_DTYPE[dtype]
    do = _randn(o.shape, dtype, gen)
    (o.float() * do.float()).sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == dtype

    o_exact, lse_exact = R.naive_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    grads_exact = R.naive_attention_backward(q, k, v, do, causal=causal, softmax_scale=scale)
    o_base, lse_base, *grads_base = _baseline(q, k, v, do, causal, scale)
    _check("o", o, o_exact, o_base, dtype)
    _check("lse", lse, lse_exact, lse_base, dtype)
    for name, x, exact, base in zip(("dq", "dk", "dv"), (q, k, v), grads_exact, grads_base):
        _check(name, x.grad, exact, base, dtype)

    empty = ~torch.from_numpy(R.visible_mask(sq, sk, causal)).any(dim=1)
    if causal and sq > sk:
        assert int(empty.sum()) == sq - sk  # the case really has rows that see no key
    assert torch.all(o[:, empty] == 0) and torch.all(torch.isneginf(lse[:, :, empty]))
    assert torch.all(q.grad[:, empty] == 0)
    return o, lse


# (B, Sq, Sk, Hq, Hkv, D, Dv, causal)
CASES = [
    (1, 1, 1, 2, 2, 16, 16, False),
    (2, 1, 17, 2, 1, 40, 40, True),
    (2, 17, 17, 4, 4, 80, 80, True),
    (1, 129, 129, 2, 2, 96, 96, False),
    (1, 129, 17, 4, 1, 64, 64, True),  # Sq > Sk: 112 rows see no key; GQA 4:1
    (1, 17, 129, 8, 1, 128, 128, True),  # Sq < Sk; GQA 8:1
    (1, 33, 65, 2, 1, 256, 256, False),
    (1, 40, 300, 4, 2, 64, 32, True),  # Dv != D, two key blocks
    (1, 300, 520, 2, 2, 32, 48, False),  # three key blocks
    (1, 520, 300, 8, 1, 16, 16, True),  # several key blocks, 220 rows see no key, GQA 8:1
]
CASE_IDS = ["B{}-Sq{}-Sk{}-H{}:{}-D{}-Dv{}-causal{}".format(*c) for c in CASES]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_and_grads_within_rule(case, dtype):
    b, sq, sk, hq, hkv, d, dv, causal = case
    gen = torch.Generator().manual_seed(CASES.index(case))
    q = _randn((b, sq, hq, d), dtype, gen)
    k = _randn((b, sk, hkv, d), dtype, gen)
    v = _randn((b, sk, hkv, dv), dtype, gen)
    _run_and_check(q, k, v, causal, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_contiguous_inputs(dtype, causal):
    """Slices of bigger tensors and transposed views; only the last dim has stride 1."""
    gen = torch.Generator().manual_seed(11)
    q = _randn((2, 4, 37, 40), dtype, gen).transpose(1, 2)[:, 3:32]  # [2, 29, 4, 40], a transposed view
    k_big = _randn((2, 50, 4, 48), dtype, gen)
    k = k_big[:, 5:46, ::2, :40]  # [2, 41, 2, 40]: sequence slice, every other head, part of the last dim
    v = _randn((2, 2, 41, 24), dtype, gen).permute(0, 2, 1, 3)  # [2, 41, 2, 24]
    assert not any(x.is_contiguous() for x in (q, k, v)) and all(x.stride(-1) == 1 for x in (q, k, v))
    o_view, lse_view = _run_and_check(q, k, v, causal, dtype, gen)
    o_copy, lse_copy = onlineattn.attention(
        *(x.detach().contiguous() for x in (q, k, v)), causal=causal, return_lse=True, backend="torch"
    )
    _check("o(view) vs o(contiguous)", o_view, R._f64(o_copy), o_copy, dtype)


@pytest.mark.parametrize("q_scale", [30.0, 60.0, 100.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16_logits_near_overflow(q_scale, causal):
    """q scaled by 30-100 in float16: raw scores reach the thousands, the softmax is nearly one-hot."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(int(q_scale) + causal)
    q = _randn((1, 33, 4, 64), dtype, gen, scale=q_scale)
    k = _randn((1, 47, 2, 64), dtype, gen)
    v = _randn((1, 47, 2, 64), dtype, gen)
    raw = torch.einsum("bihd,bjhd->bhij", q.double(), k.repeat_interleave(2, dim=2).double())
    assert raw.abs().max() > 1000 and raw.abs().max() < torch.finfo(dtype).max  # large, still representable
    _run_and_check(q, k, v, causal, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(
    "case", [(1, 21, 13, 4, 1, 16, 16, True), (2, 17, 300, 2, 2, 32, 24, False)], ids=["masked-rows-gqa", "multiblock"]
)
def test_gradient_through_lse(case, dtype):
    """A loss on o and lse: gradients against float64 autograd of torch math attention."""
    b, sq, sk, hq, hkv, d, dv, causal = case
    gen = torch.Generator().manual_seed(5)
    q, k, v = _leaves(_randn((b, sq, hq, d), dtype, gen), _randn((b, sk, hkv, d), dtype, gen), _randn((b, sk, hkv, dv), dtype, gen))
    do = _randn((b, sq, hq, dv), dtype, gen)
    dlse = _randn((b, hq, sq), dtype, gen).float()  # representable in dtype, so every loss below is the same loss
    o, lse = onlineattn.attention(q, k, v, causal=causal, return_lse=True, backend="torch")
    ((o.float() * do.float()).sum() + (lse.float().masked_fill(torch.isinf(lse), 0.0) * dlse).sum()).backward()

    q64, k64, v64 = _leaves(q.double(), k.double(), v.double())
    o64, lse64 = R.torch_math_attention(q64, k64, v64, causal=causal)
    ((o64 * do.double()).sum() + (lse64.masked_fill(torch.isinf(lse64), 0.0) * dlse.double()).sum()).backward()
    _, _, *grads_base = _baseline(q, k, v, do, causal, dlse=dlse)
    for name, x, x64, base in zip(("dq", "dk", "dv"), (q, k, v), (q64, k64, v64), grads_base):
        _check(name, x.grad, x64.grad, base, dtype)
    if causal and sq > sk:
        assert torch.all(q.grad[:, : sq - sk] == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_name)
def test_gradient_of_lse_alone(dtype):
    """Only lse reaches the loss, so o receives no gradient at all."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = _leaves(*(_randn((1, 19, 4, 16), dtype, gen) for _ in range(3)))
    _, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True, backend="torch")
    lse.sum().backward()
    q64, k64, v64 = _leaves(q.double(), k.double(), v.double())
    R.torch_math_attention(q64, k64, v64, causal=True)[1].sum().backward()
    for name, x, x64 in zip(("dq", "dk"), (q, k), (q64, k64)):
        _check(name, x.grad, x64.grad, None, dtype)
    assert v64.grad is None and torch.all(v.grad == 0)  # lse does not depend on v


@pytest.mark.parametrize(
    "case",
    [
        (1, 3, 5, 2, 1, 4, 3, False),
        (1, 5, 3, 2, 1, 4, 3, True),  # Sq > Sk: two rows see no key
        (2, 4, 4, 4, 2, 3, 5, True),
        (1, 6, 9, 3, 3, 8, 2, True),
    ],
    ids=["gqa2-full", "gqa2-causal-masked-rows", "gqa2-causal", "mha-causal-sq<sk"],
)
def test_gradcheck(case):
    b, sq, sk, hq, hkv, d, dv, causal = case
    gen = torch.Generator().manual_seed(sq * 10 + sk)
    inputs = tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
        for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv))
    )

    def fn(q, k, v):
        o, lse = onlineattn.attention(q, k, v, causal=causal, return_lse=True, backend="torch")
        # -inf lse of empty rows: finite differences of -inf are NaN, so those fixed entries are zeroed
        return o, lse.masked_fill(torch.isinf(lse), 0.0)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("block", [1, 7, 16, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(37, 37), (23, 70), (70, 23)])
def test_small_blocks_float64(block, causal, sq, sk):
    """The recurrence over many key blocks (and the causal block skipping) directly, in float64, to 1e-12."""
    gen = torch.Generator().manual_seed(block + sq)
    q = torch.randn(2, sq, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, sk, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, sk, 2, 6, generator=gen, dtype=torch.float64)
    do = torch.randn(2, sq, 4, 6, generator=gen, dtype=torch.float64)
    dlse = torch.randn(2, 4, sq, generator=gen, dtype=torch.float64)
    o, lse = torch_impl.forward(q, k, v, 0.4, causal, block=block)
    o_exact, lse_exact = R.naive_attention(q, k, v, causal=causal, softmax_scale=0.4, return_lse=True)
    _check("o", o, o_exact, None, torch.float64)
    _check("lse", lse, lse_exact, None, torch.float64)
    grads = torch_impl.backward(do, q, k, v, o, lse, 0.4, causal, block=block)
    for name, g, exact in zip(("dq", "dk", "dv"), grads, R.naive_attention_backward(q, k, v, do, causal=causal, softmax_scale=0.4)):
        _check(name, g, exact, None, torch.float64)
    # with a gradient on lse too, against float64 autograd
    q64, k64, v64 = _leaves(q, k, v)
    o64, lse64 = R.torch_math_attention(q64, k64, v64, causal=causal, softmax_scale=0.4)
    ((o64 * do).sum() + (lse64.masked_fill(torch.isinf(lse64), 0.0) * dlse).sum()).backward()
    grads = torch_impl.backward(do, q, k, v, o, lse, 0.4, causal, dlse=dlse, block=block)
    for name, g, x64 in zip(("dq", "dk", "dv"), grads, (q64, k64, v64)):
        _check(name, g, x64.grad, None, torch.float64)


def test_explicit_scale():
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 9, 2, 12, generator=gen) for _ in range(3))
    for scale in (0.05, 1, 2.5):
        o, lse = onlineattn.attention(q, k, v, softmax_scale=scale, return_lse=True, backend="torch")
        o_exact, lse_exact = R.naive_attention(q, k, v, softmax_scale=scale, return_lse=True)
        _check("o", o, o_exact, None, torch.float32)
        _check("lse", lse, lse_exact, None, torch.float32)


def test_no_keys_at_all():
    """Sk = 0: every row is empty, o = 0, lse = -inf, gradients 0, no NaN."""
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 0, 2, 8, dtype=torch.float64), torch.randn(1, 0, 2, 4, dtype=torch.float64)
    o, lse = onlineattn.attention(q, k, v, return_lse=True, backend="torch")
    assert o.shape == (1, 3, 2, 4) and torch.all(o == 0) and torch.all(torch.isneginf(lse))
    o.sum().backward()
    assert torch.all(q.grad == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_deterministic_bitwise(dtype):
    gen = torch.Generator().manual_seed(13)
    q, k, v = (_randn((1, 150, 4, 32), dtype, gen) for _ in range(3))
    do = _randn((1, 150, 4, 32), dtype, gen)
    runs = []
    for _ in range(2):
        leaves = _leaves(q, k, v)
        o, lse = onlineattn.attention(*leaves, causal=True, return_lse=True, backend="torch")
        o.backward(do)
        runs.append((o, lse, *(x.grad for x in leaves)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_is_refused_clearly(backend):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the triton backend runs interpreted
    q, k, v = (torch.randn(1, 8, 2, 16, device=device, requires_grad=True) for _ in range(3))
    o = onlineattn.attention(q, k, v, backend=backend)
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=False)
    assert dq.shape == q.shape
    o = onlineattn.attention(q, k, v, backend=backend)
    with pytest.raises((NotImplementedError, RuntimeError), match="differentiable|double backward|does not require grad"):
        (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
        dq.sum().backward()


def test_blockwise_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 9, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    torch.library.opcheck(torch.ops.onlineattn.blockwise_fwd, (q.requires_grad_(), k.requires_grad_(), v, 0.25, True))
    o, lse = torch_impl.forward(q.detach(), k.detach(), v, 0.25, True)
    do = torch.randn_like(o)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.onlineattn.blockwise_bwd, (do, q.detach(), k.detach(), v, o, lse, dlse, 0.25, True))


def test_plain_eager_sees_subclasses_and_functorch():
    """Calls may skip their custom ops only with plain tensors and no functorch transform (nor torch.compile)."""
    from onlineattn.torch_impl import plain_eager

    class Sub(torch.Tensor):
        pass

    x = torch.zeros(2)
    assert plain_eager(x, None) and not plain_eager(x, x.as_subclass(Sub))
    seen = []
    torch.func.vmap(lambda y: seen.append(plain_eager(y)) or y)(torch.zeros(3, 2))
    assert seen == [False]
    assert plain_eager(torch.nn.Parameter(x))
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert not plain_eager(x)
