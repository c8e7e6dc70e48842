"""The oracle checks itself: online against naive, online_softmax against torch's softmax, merge exactness, and the
hand-written backward against float64 autograd. Every other test trusts ``onlineattn.reference``, so it is held to
1e-13 in float64 here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onlineattn import reference as R

TOL = 1e-13


def _qkv(rng, b, sq, sk, hq, hkv, d, dv):
    return (
        rng.standard_normal((b, sq, hq, d)),
        rng.standard_normal((b, sk, hkv, d)),
        rng.standard_normal((b, sk, hkv, dv)),
    )


def _assert_close(name, got, want, tol=TOL):
    """Non-finite entries (the -inf lse of rows with no key) must match exactly; finite ones to ``tol``."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: non-finite entries differ"
    err = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
    assert err <= tol, f"{name}: max error {err:.3e} > {tol:.0e}"


# (B, Sq, Sk, Hq, Hkv, D, Dv, causal, block)
ORACLE_CASES = [
    (1, 1, 1, 1, 1, 8, 8, False, 64),
    (2, 1, 17, 2, 2, 16, 16, True, 4),
    (2, 17, 17, 4, 4, 16, 16, True, 5),
    (1, 17, 129, 4, 1, 40, 24, True, 16),  # Sq < Sk, GQA 4:1, Dv != D
    (1, 129, 17, 8, 1, 24, 40, True, 7),  # Sq > Sk causal: 112 rows see no key; GQA 8:1
    (1, 129, 129, 2, 1, 32, 32, False, 64),
    (2, 50, 300, 4, 2, 16, 8, True, 64),
    (1, 300, 50, 2, 2, 8, 8, False, 1),
    (1, 40, 33, 2, 1, 16, 16, True, 1000),  # one block bigger than Sk
]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: "B{}-Sq{}-Sk{}-H{}:{}-D{}-Dv{}-causal{}-blk{}".format(*c))
@pytest.mark.parametrize("explicit_scale", [False, True], ids=["default_scale", "scale0.37"])
def test_online_matches_naive(case, explicit_scale):
    b, sq, sk, hq, hkv, d, dv, causal, block = case
    rng = np.random.default_rng(hash(case) % 2**32 + explicit_scale)
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, d, dv)
    scale = 0.37 if explicit_scale else None
    o_n, lse_n = R.naive_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    o_o, lse_o = R.online_attention(q, k, v, causal=causal, softmax_scale=scale, block=block, return_lse=True)
    assert o_n.shape == (b, sq, hq, dv) and lse_n.shape == (b, hq, sq)
    _assert_close("o", o_o, o_n)
    _assert_close("lse", lse_o, lse_n)
    empty_rows = ~R.visible_mask(sq, sk, causal).any(axis=1)
    if causal and sq > sk:
        assert empty_rows.sum() == sq - sk
    assert np.all(o_o[:, empty_rows] == 0.0) and np.all(o_n[:, empty_rows] == 0.0)
    assert np.all(np.isneginf(lse_o[:, :, empty_rows])) and np.all(np.isfinite(lse_o[:, :, ~empty_rows]))


def test_visible_mask_is_bottom_right():
    # ENGINEERING.md section 2: query i sees key j when j <= i + Sk - Sq.
    np.testing.assert_array_equal(R.visible_mask(2, 4, True), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(R.visible_mask(4, 2, True), [[0, 0], [0, 0], [1, 0], [1, 1]])
    np.testing.assert_array_equal(R.visible_mask(3, 3, True), np.tril(np.ones((3, 3), dtype=bool)))
    assert R.visible_mask(3, 5, False).all()


def test_defaults_and_lse_semantics():
    """Default scale is 1/sqrt(D), lse is a natural log: with identical keys, lse = q·k·scale + ln(Sk)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 3, 5, 2, 2, 9, 4)
    np.testing.assert_array_equal(R.naive_attention(q, k, v), R.naive_attention(q, k, v, softmax_scale=1 / 3))
    k_same = np.broadcast_to(k[:, :1], k.shape)
    _, lse = R.naive_attention(q, k_same, v, return_lse=True)
    want = np.einsum("bshd,bhd->bhs", q, k[:, 0]) / 3 + np.log(5)
    _assert_close("lse", lse, want)


def test_oracle_accepts_low_precision_torch_tensors():
    """The oracle reads bf16/fp16 tensors exactly (upcast, no rounding of its own)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    got = R.naive_attention(q, k, v, causal=True)
    want = R.naive_attention(*(x.double().numpy() for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,block,spread", [(1, 1, 1.0), (17, 4, 1.0), (129, 64, 3.0), (1000, 128, 50.0), (64, 64, 1.0)])
def test_online_softmax_matches_softmax(n, block, spread):
    rng = np.random.default_rng(n * 7 + block)
    x = rng.standard_normal(n) * spread + rng.uniform(-500, 500)  # a large offset: exp(x) alone would overflow
    got = R.online_softmax(x, block=block)
    want = torch.softmax(torch.from_numpy(x), dim=0).numpy()
    _assert_close("softmax", got, want)
    assert abs(got.sum() - 1.0) <= TOL


# merge_states: split the keys at random points, attention over each part, merge; the union is full attention.
@pytest.mark.parametrize("seed", range(6))
def test_merge_of_key_split_equals_full_attention(seed):
    rng = np.random.default_rng(100 + seed)
    b, sq, sk = int(rng.integers(1, 3)), int(rng.integers(1, 40)), int(rng.integers(1, 80))
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.integers(1, 4))
    q, k, v = _qkv(rng, b, sq, sk, hq, hkv, 16, 12)
    # seeds 0 and 1 split off an empty part, first and last
    split = {0: 0, 1: sk}.get(seed, int(rng.integers(0, sk + 1)))
    o_a, lse_a = R.naive_attention(q, k[:, :split], v[:, :split], return_lse=True)
    o_b, lse_b = R.naive_attention(q, k[:, split:], v[:, split:], return_lse=True)
    o, lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    o_full, lse_full = R.naive_attention(q, k, v, return_lse=True)
    _assert_close("o", o, o_full)
    _assert_close("lse", lse, lse_full)


def test_merge_three_parts_in_either_order():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 9, 30, 4, 2, 8, 8)
    parts = [R.naive_attention(q, k[:, a:z], v[:, a:z], return_lse=True) for a, z in ((0, 11), (11, 12), (12, 30))]
    left = R.merge_states(*R.merge_states(*parts[0], *parts[1]), *parts[2])
    right = R.merge_states(*parts[0], *R.merge_states(*parts[1], *parts[2]))
    o_full, lse_full = R.naive_attention(q, k, v, return_lse=True)
    for o, lse in (left, right):
        _assert_close("o", o, o_full)
        _assert_close("lse", lse, lse_full)


def test_merge_with_empty_rows_is_exact():
    """Per-row -inf in one part: the other part passes through bit for bit; both empty: o = 0, lse = -inf."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 1, 10, 4, 2, 2, 8, 8)
    o_a, lse_a = R.naive_attention(q, k, v, causal=True, return_lse=True)  # rows 0..5 see no key
    o_b = rng.standard_normal(o_a.shape)
    lse_b = rng.standard_normal(lse_a.shape)
    o, lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    np.testing.assert_array_equal(o[:, :6], o_b[:, :6])
    np.testing.assert_array_equal(lse[:, :, :6], lse_b[:, :, :6])
    lse_b[:, :, :3] = -np.inf
    o, lse = R.merge_states(o_a, lse_a, rng.standard_normal(o_a.shape), lse_b)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[:, :3] == 0.0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))


def test_merge_both_empty():
    rng = np.random.default_rng(9)
    o_a, o_b = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    neg_inf = np.full((2, 4, 3), -np.inf)
    with np.errstate(all="raise"):  # no invalid operation is even attempted silently
        o, lse = R.merge_states(o_a, neg_inf, o_b, neg_inf)
    assert np.all(o == 0.0) and np.all(np.isneginf(lse))


# The hand-written float64 backward against torch's float64 autograd of the textbook formula.
BACKWARD_CASES = [
    (1, 1, 1, 1, 1, 8, 8, False),
    (2, 17, 17, 4, 4, 16, 16, True),
    (1, 17, 40, 4, 1, 16, 24, True),
    (1, 40, 17, 8, 1, 24, 16, True),  # rows with no visible key
    (2, 33, 21, 2, 1, 40, 40, False),
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: "B{}-Sq{}-Sk{}-H{}:{}-D{}-Dv{}-causal{}".format(*c))
def test_naive_backward_matches_autograd(case):
    b, sq, sk, hq, hkv, d, dv, causal = case
    rng = np.random.default_rng(hash(case) % 2**32)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _qkv(rng, b, sq, sk, hq, hkv, d, dv))
    do = torch.from_numpy(rng.standard_normal((b, sq, hq, dv)))
    o, _ = R.torch_math_attention(q, k, v, causal=causal, softmax_scale=0.3)
    (o * do).sum().backward()
    dq, dk, dv_ = R.naive_attention_backward(q, k, v, do, causal=causal, softmax_scale=0.3)
    for name, ours, auto in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv_, v.grad)):
        _assert_close(name, ours, auto.numpy(), tol=1e-12)
    if causal and sq > sk:
        assert np.all(dq[:, : sq - sk] == 0.0)


def test_rule_refuses_a_void_bound():
    """A baseline that overflowed (or is missing) would make any error pass; the rule must refuse it."""
    exact = np.ones((3, 3))
    ours = torch.ones(3, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="not finite"):
        R.assert_within_rule("x", ours, exact, torch.full((3, 3), float("nan")), "float16")
    with pytest.raises(ValueError, match="baseline"):
        R.assert_within_rule("x", ours, exact, None, "float16")


def test_rule_catches_an_error_above_the_bound():
    exact = np.linspace(-1, 1, 64).reshape(8, 8)
    baseline = torch.tensor(exact, dtype=torch.float16)
    off = baseline.clone()
    off[0, 0] += 0.1
    R.assert_within_rule("x", baseline, exact, baseline, "float16")
    with pytest.raises(AssertionError, match="exceeds"):
        R.assert_within_rule("x", off, exact, baseline, "float16")
    with pytest.raises(AssertionError, match="NaN"):
        R.assert_within_rule("x", torch.full((8, 8), float("nan")), exact, baseline, "float16")


# ---- score variants (issue #6): the hand-written oracle against float64 autograd of torch_math_attention, an
# independent implementation of the same definitions (onlineattn._mods).

VARIANT_CASES = {  # name: (B, Sq, Sk, Hq, Hkv, keywords)
    "window": (2, 13, 17, 4, 2, dict(window_size=(3, 2))),
    "window-causal-masked-rows": (1, 21, 13, 4, 1, dict(causal=True, window_size=(4, -1))),
    "softcap": (1, 9, 11, 2, 2, dict(softcap=1.5)),
    "alibi-per-batch": (2, 7, 12, 4, 2, dict(alibi=(2, 4), causal=True)),
    "bias-broadcast": (2, 9, 10, 4, 2, dict(bias=(2, 1, 1, 10))),
    "bias-2d": (1, 9, 10, 2, 1, dict(bias=(9, 10))),
    "sinks-masked-rows": (1, 12, 7, 4, 2, dict(sinks=True, causal=True)),
    "dropout": (2, 8, 9, 2, 1, dict(dropout_p=0.3)),
    "everything": (2, 15, 11, 4, 2, dict(causal=True, window_size=(5, 0), softcap=2.0, alibi=(4,), bias=(1, 4, 15, 11),
                                         sinks=True, dropout_p=0.2)),
}


def _variant_inputs(b, sq, sk, hq, hkv, kw, seed):
    """float64 leaves and the keywords of one case (the bias and the sinks require grad)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = (x.requires_grad_() for x in (rand(b, sq, hq, 8), rand(b, sk, hkv, 8), rand(b, sk, hkv, 5)))
    kw = dict(kw)
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(*kw.pop("alibi"), generator=gen, dtype=torch.float64)
    if "bias" in kw:
        kw["attn_bias"] = rand(*kw.pop("bias")).requires_grad_()
    if kw.pop("sinks", False):
        kw["sinks"] = rand(hq).requires_grad_()
    if "dropout_p" in kw:
        kw["dropout_mask"] = torch.rand(b, hq, sq, sk, generator=gen) > kw["dropout_p"]
    return q, k, v, kw


@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_variant_oracle_matches_autograd(name):
    b, sq, sk, hq, hkv, kw = VARIANT_CASES[name]
    q, k, v, kw = _variant_inputs(b, sq, sk, hq, hkv, kw, seed=len(name))
    o, lse = R.torch_math_attention(q, k, v, softmax_scale=0.4, **kw)
    o_exact, lse_exact = R.naive_attention(q, k, v, softmax_scale=0.4, return_lse=True, **kw)
    _assert_close("o", o_exact, o.detach().numpy(), tol=1e-12)
    _assert_close("lse", lse_exact, lse.detach().numpy(), tol=1e-12)
    do = torch.randn(o.shape, dtype=torch.float64)
    dlse = torch.randn(lse.shape, dtype=torch.float64).masked_fill(torch.isinf(lse), 0.0)
    ((o * do).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum()).backward()
    grads = R.naive_attention_grads(q, k, v, do, softmax_scale=0.4, dlse=dlse, **kw)
    leaves = {"dq": q, "dk": k, "dv": v, "dbias": kw.get("attn_bias"), "dsinks": kw.get("sinks")}
    assert set(grads) == {n for n, x in leaves.items() if x is not None}
    for n, x in leaves.items():
        if x is not None:
            _assert_close(n, grads[n], x.grad.numpy(), tol=1e-12)


def test_window_semantics():
    """flash-attn's: keys i + diag - left .. i + diag + right; causal sets right = 0; -1 is unbounded."""
    assert R.visible_mask(3, 3, False, (0, 0)).tolist() == np.eye(3, dtype=bool).tolist()
    band = R.visible_mask(2, 4, False, (1, 0))  # diag = 2: row 0 sees keys 1, 2; row 1 sees keys 2, 3
    assert band.tolist() == [[False, True, True, False], [False, False, True, True]]
    assert np.array_equal(R.visible_mask(5, 7, True, (2, 3)), R.visible_mask(5, 7, False, (2, 0)))
    assert np.array_equal(R.visible_mask(5, 7, True, (-1, -1)), R.visible_mask(5, 7, True))
    assert np.array_equal(R.visible_mask(5, 7, False, (-1, 1)), R.visible_mask(5, 7, False, (9, 1)))


def test_sinks_join_the_normaliser_only():
    """A row with no key gets o = 0 and lse = sink; a very negative sink changes nothing."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 6, 4, 2, 2, 8, 8)
    o, lse = R.naive_attention(q, k, v, causal=True, sinks=np.array([0.5, -1.0]), return_lse=True)
    assert np.all(o[:, :2] == 0) and np.allclose(lse[0, :, :2], [[0.5, 0.5], [-1.0, -1.0]])
    o0, lse0 = R.naive_attention(q, k, v, causal=True, return_lse=True)
    o1, lse1 = R.naive_attention(q, k, v, causal=True, sinks=np.full(2, -800.0), return_lse=True)
    _assert_close("o", o1, o0)
    _assert_close("lse", lse1[..., 2:], lse0[..., 2:])


def test_varlen_oracle_is_attention_per_sequence():
    rng = np.random.default_rng(4)
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 5, 9, 9])  # the third sequence has queries but no key
    q, k, v = rng.standard_normal((10, 4, 8)), rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 6))
    slopes = rng.random((3, 4))
    o, lse = R.naive_attention_varlen(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=slopes, return_lse=True)
    assert o.shape == (10, 4, 6) and lse.shape == (4, 10)
    o1, lse1 = R.naive_attention(q[None, :3], k[None, :5], v[None, :5], causal=True, alibi_slopes=slopes[0],
                                 return_lse=True)
    _assert_close("o", o[:3], o1[0])
    _assert_close("lse", lse[:, :3], lse1[0])
    assert np.all(o[3:] == 0) and np.all(np.isneginf(lse[:, 3:]))
    to = lambda *xs: [torch.from_numpy(x) for x in xs]
    o_t, lse_t = R.torch_math_attention_varlen(*to(q, k, v, cu_q, cu_k), causal=True,
                                               alibi_slopes=torch.from_numpy(slopes))
    _assert_close("o (torch math)", o_t.numpy(), o, tol=1e-12)
    _assert_close("lse (torch math)", lse_t.numpy(), lse, tol=1e-12)


def test_oracle_refuses_bad_arguments_naming_them():
    """The oracle is public: shapes that do not agree, a window side below -1, a negative softcap, a block < 1, a
    2-D row for ``online_softmax`` and cache lengths or pages past the cache raise ValueError, not a numpy error
    or a silent broadcast."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 2, 8)), rng.standard_normal((2, 5, 1, 8)), rng.standard_normal((2, 5, 1, 8))
    cases = [
        (lambda: R.naive_attention(q, k[:1], v[:1]), "must agree"),
        (lambda: R.naive_attention(q, k, v[..., :1, :, :]), "must agree"),
        (lambda: R.naive_attention(q[0], k, v), r"\[B, S, H, D\]"),
        (lambda: R.naive_attention(q, k, v, window_size=(-3, 0)), "window_size"),
        (lambda: R.naive_attention(q, k, v, softcap=-1.0), "softcap"),
        (lambda: R.online_attention(q, k, v, block=0), "block"),
        (lambda: R.online_softmax(np.zeros((2, 3))), "1-D"),
        (lambda: R.kvcache_attention(q[:, :1], k, v, cache_seqlens=6), "cache_seqlens"),
        (lambda: R.kvcache_attention(q[:1, :1], rng.standard_normal((3, 4, 1, 8)), rng.standard_normal((3, 4, 1, 8)),
                                     cache_seqlens=5, block_table=np.array([[0, 3]])), "block_table"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(TypeError, match="window_size"):
        R.naive_attention(q, k, v, window_size=(1,))
    # pages past a sequence's length are not read: an unassigned (-1) entry there is fine
    k_pool, v_pool = rng.standard_normal((3, 4, 1, 8)), rng.standard_normal((3, 4, 1, 8))
    R.kvcache_attention(q[:1, :1], k_pool, v_pool, cache_seqlens=3, block_table=np.array([[2, -1]]))
