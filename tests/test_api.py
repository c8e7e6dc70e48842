"""The public surface: return conventions, backend dispatch, keywords that later issues implement, and merge_states."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn.ops import _launch as launch_cache

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _qkv(gen, b=1, sq=9, sk=13, hq=4, hkv=2, d=16, dv=16, dtype=torch.float32):
    return tuple(
        torch.randn(shape, generator=gen).to(dtype) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv))
    )


def _check(name, ours, exact, baseline, dtype):
    """``assert_within_rule``, refusing a non-finite baseline (it would make the bound void)."""
    if dtype in (torch.float16, torch.bfloat16):
        finite = np.isfinite(R._f64(exact))
        assert np.isfinite(R._f64(baseline)[finite]).all(), f"{name}: baseline not finite"
    R.assert_within_rule(name, ours, exact, baseline, _name(dtype))


def test_return_conventions():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, dv=24)
    o = onlineattn.attention(q, k, v)
    assert isinstance(o, torch.Tensor) and o.shape == (1, 9, 4, 24)
    out = onlineattn.attention(q, k, v, return_lse=True)
    assert isinstance(out, tuple) and len(out) == 2
    assert torch.equal(out[0], o) and out[1].shape == (1, 4, 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_auto_backend_on_cpu_is_the_torch_path(dtype, causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, dtype=dtype)
    auto = onlineattn.attention(q, k, v, causal=causal, return_lse=True)
    forced = onlineattn.attention(q, k, v, causal=causal, return_lse=True, backend="torch")
    for a, b in zip(auto, forced):
        assert torch.equal(a, b)


def test_defaults_accepted_explicitly():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(gen)
    want = onlineattn.attention(q, k, v)
    got = onlineattn.attention(
        q, k, v, causal=False, softmax_scale=None, window_size=[-1, -1], softcap=0.0, alibi_slopes=None,
        dropout_p=0.0, attn_bias=None, sinks=None, deterministic=False, return_lse=False, backend="torch",
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_reaches_the_triton_backward(deterministic, monkeypatch):
    """``deterministic`` travels from ``attention`` to the eager Triton backward (which may fuse dQ only when it is
    False); the default is True. On the GPU where there is one (there the interpreter is off, and backend="triton"
    refuses CPU tensors), else under the interpreter."""
    from onlineattn.ops import backward as B

    seen = []
    gradients = B.gradients
    monkeypatch.setattr(B, "gradients", lambda *a, **kw: seen.append(kw["deterministic"]) or gradients(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x.to(device).requires_grad_() for x in _qkv(torch.Generator().manual_seed(5)))
    onlineattn.attention(q, k, v, backend="triton").sum().backward()
    onlineattn.attention(q, k, v, deterministic=deterministic, backend="triton").sum().backward()
    assert seen == [True, deterministic]


@pytest.mark.parametrize("keyword,value", [("window_size", (4, 0)), ("softcap", 30.0), ("alibi_slopes", torch.ones(4))])
def test_kvcache_refuses_score_variants_naming_them(keyword, value):
    """Decoding has no score variants: flash-attn's keywords are accepted at their defaults only."""
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, _, _ = _decode_inputs(gen)
    with pytest.raises(NotImplementedError, match=keyword):
        onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, **{keyword: value})
    onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, window_size=[-1, -1], softcap=0)


# ---- merge_states (torch) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("split", ["empty-first", "random", "empty-last"])
def test_merge_of_key_split_equals_full_attention(dtype, split):
    """Attention over keys [0, s) and [s, Sk), merged, is attention over all keys (GQA, Dv != D)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(gen, b=2, sq=17, sk=41, hq=6, hkv=2, d=24, dv=8, dtype=dtype)
    s = {"empty-first": 0, "empty-last": 41, "random": int(torch.randint(1, 41, (1,), generator=gen))}[split]
    o_a, lse_a = onlineattn.attention(q, k[:, :s], v[:, :s], return_lse=True)
    o_b, lse_b = onlineattn.attention(q, k[:, s:], v[:, s:], return_lse=True)
    if split != "random":  # the empty part really is empty
        empty_lse = lse_a if s == 0 else lse_b
        assert torch.all(torch.isneginf(empty_lse))
    o, lse = onlineattn.merge_states(o_a, lse_a, o_b, lse_b)
    o_exact, lse_exact = R.naive_attention(q, k, v, return_lse=True)
    o_base, lse_base = R.torch_math_attention(q, k, v)
    _check("o", o, o_exact, o_base, dtype)
    _check("lse", lse, lse_exact, lse_base, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_name)
def test_merge_matches_oracle_merge_with_inf(dtype):
    """Arbitrary states, some rows -inf in one part, some in both: agrees with reference.merge_states."""
    gen = torch.Generator().manual_seed(5)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    o_a, o_b = (torch.randn(2, 7, 3, 5, generator=gen, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, 7, generator=gen, dtype=lse_dtype) * 5 for _ in range(2))
    lse_a[:, :, :2] = float("-inf")
    lse_b[:, :, 1:3] = float("-inf")  # row 1: both empty
    lse_b[0, 1, 5] = float("-inf")
    o, lse = onlineattn.merge_states(o_a, lse_a, o_b, lse_b)
    o_exact, lse_exact = R.merge_states(o_a, lse_a, o_b, lse_b)
    R.assert_within_rule("o", o, o_exact, None, _name(dtype))
    R.assert_within_rule("lse", lse, lse_exact, None, _name(dtype))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.all(o[:, 1] == 0) and torch.all(torch.isneginf(lse[:, :, 1]))
    assert torch.equal(o[:, 0], o_b[:, 0]) and torch.equal(lse[:, :, 0], lse_b[:, :, 0])  # a is empty: b exactly
    assert torch.equal(o[:, 2], o_a[:, 2]) and torch.equal(lse[:, :, 2], lse_a[:, :, 2])  # b is empty: a exactly


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_merge_both_empty(dtype):
    o_a, o_b = torch.randn(1, 4, 2, 3).to(dtype), torch.randn(1, 4, 2, 3).to(dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    neg_inf = torch.full((1, 2, 4), float("-inf"), dtype=lse_dtype)
    o, lse = onlineattn.merge_states(o_a, neg_inf, o_b, neg_inf.clone())
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize(
    "o_dtype,lse_dtype,want_lse",
    [
        (torch.float16, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.float32, torch.float32),
        (torch.float64, torch.float64, torch.float64),
    ],
    ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x,
)
def test_merge_dtypes(o_dtype, lse_dtype, want_lse):
    gen = torch.Generator().manual_seed(6)
    o_a, o_b = (torch.randn(1, 3, 2, 4, generator=gen).to(o_dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(1, 2, 3, generator=gen).to(lse_dtype) for _ in range(2))
    o, lse = onlineattn.merge_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == o_dtype and lse.dtype == want_lse
    assert o.shape == o_a.shape and lse.shape == lse_a.shape


def test_merge_states_list_of_one_state_is_that_state():
    gen = torch.Generator().manual_seed(8)
    o, lse = torch.randn(1, 2, 5, 3, 8, generator=gen, dtype=torch.float64), torch.randn(1, 2, 3, 5, generator=gen, dtype=torch.float64)
    merged = onlineattn.merge_states_list(o, lse)
    assert torch.equal(merged[0], o[0]) and torch.equal(merged[1], lse[0])


@pytest.mark.parametrize(
    "os_shape,lses_shape,device,match",
    [
        ((0, 1, 2, 3, 4), (0, 1, 3, 2), "cpu", "at least one"),
        ((2, 1, 2, 3, 4), (2, 1, 2, 3), "cpu", r"lses must have shape"),
        ((2, 1, 2, 3, 4), (2, 1, 3), "cpu", r"lses must have 4 dims"),
        ((1, 2, 3, 4), (2, 1, 3, 2), "cpu", r"os must have 5 dims"),
        ((2, 1, 2, 3, 4), (2, 1, 3, 2), "meta", "one device"),
    ],
)
def test_merge_states_list_rejects_bad_states(os_shape, lses_shape, device, match):
    with pytest.raises(ValueError, match=match):
        onlineattn.merge_states_list(torch.zeros(os_shape), torch.zeros(lses_shape, device=device))


# ---- attention_with_kvcache ------------------------------------------------------------------------------------


def _decode_inputs(gen, dtype=torch.float32, b=2, new=2):
    q = torch.randn(b, 3, 4, 16, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(b, 40, 2, 16, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, new, 2, 16, generator=gen).to(dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("dtype,lse_dtype", [(torch.float64, torch.float64), (torch.float16, torch.float32)], ids=str)
def test_kvcache_return_conventions(dtype, lse_dtype):
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, k, v = _decode_inputs(gen, dtype)
    lens = torch.tensor([5, 30], dtype=torch.int32)
    o = onlineattn.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens)
    o2, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, return_lse=True)
    assert torch.equal(o, o2) and o.dtype == dtype and o.shape == (2, 3, 4, 16)
    assert lse.dtype == lse_dtype and lse.shape == (2, 4, 3)
    assert lens.tolist() == [5, 30], "cache_seqlens is the caller's: it is not updated"


def test_kvcache_auto_on_cpu_is_the_torch_path_and_int_lengths_equal_tensor_lengths():
    gen = torch.Generator().manual_seed(10)
    q, k_cache, v_cache, k, v = _decode_inputs(gen)
    runs = []
    for kw in ({}, {"backend": "torch"}, {"cache_seqlens": torch.full((2,), 7, dtype=torch.int32)}):
        caches = k_cache.clone(), v_cache.clone()
        out = onlineattn.attention_with_kvcache(q, *caches, k, v, **{"cache_seqlens": 7, **kw}, return_lse=True)
        runs.append((*out, *caches))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_kvcache_float64_matches_the_oracle_exactly():
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, k, v = _decode_inputs(gen, torch.float64)
    lens = torch.tensor([0, 38], dtype=torch.int32)
    exact = R.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    o, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, return_lse=True)
    R.assert_within_rule("o", o, exact[0])
    R.assert_within_rule("lse", lse, exact[1])
    assert torch.equal(k_cache, torch.as_tensor(exact[2])) and torch.equal(v_cache, torch.as_tensor(exact[3]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_empty_shapes(backend):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    gen = torch.Generator().manual_seed(12)
    q, k_cache, v_cache, k, v = (x.to(device) for x in _decode_inputs(gen))
    o, lse = onlineattn.attention_with_kvcache(q[:, :0], k_cache, v_cache, k, v, cache_seqlens=3, return_lse=True,
                                               backend=backend)
    assert o.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    assert torch.equal(k_cache[:, 3:5], k), "the new tokens are written even without queries"
    q, k_cache, v_cache, k, v = (x.to(device) for x in _decode_inputs(gen, b=0))
    assert onlineattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0, backend=backend).shape[0] == 0


def test_kvcache_is_not_differentiable():
    gen = torch.Generator().manual_seed(13)
    q, k_cache, v_cache, _, _ = _decode_inputs(gen)
    o = onlineattn.attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, cache_seqlens=10)
    assert not o.requires_grad


# ---- CUDA: the torch path on the device ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_torch_backend_on_cuda(dtype):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (x.cuda().requires_grad_() for x in _qkv(gen, sq=70, sk=300, dtype=dtype))
    o, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True, backend="torch")
    assert o.is_cuda and lse.is_cuda
    do = torch.randn(o.shape, generator=gen).to(dtype).cuda()
    o.backward(do)
    qb, kb, vb = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o_base, lse_base = R.torch_math_attention(qb, kb, vb, causal=True)
    o_base.backward(do)
    _check("o", o, R.naive_attention(q, k, v, causal=True), o_base, dtype)
    _check("lse", lse, R.naive_attention(q, k, v, causal=True, return_lse=True)[1], lse_base, dtype)
    for name, x, xb, exact in zip(("dq", "dk", "dv"), (q, k, v), (qb, kb, vb), R.naive_attention_backward(q, k, v, do, causal=True)):
        _check(name, x.grad, exact, xb.grad, dtype)


def test_compiled_training_step_on_the_torch_path_has_no_graph_break():
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 37, 4, 16, generator=g) for _ in range(3))

    def step(q, k, v):
        o, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True, backend="torch")
        return (o * o).sum() + lse.sum()

    compiled = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(step, fullgraph=True)(*compiled).backward()  # fullgraph=True raises on any graph break
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    step(*eager).backward()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("d,n,hkv,causal,deterministic", [
    (128, 512, 4, True, True),  # on sm_90: the fused dQ, adds ordered by counters the delta pass zeroes
    (128, 512, 4, False, False),  # the fused dQ's adds in any order, its sum zeroed by the delta pass; persistent
    (64, 1024, 4, False, True),  # the Gluon dK/dV tile beside the Triton dQ kernel
    (256, 512, 4, True, True),  # d = 256: the split dK/dV tile, the dQ kernel's K/V through descriptors
    (128, 640, 2, True, True),  # GQA over five whole key blocks
    (128, 600, 2, True, True),  # GQA, the last row tile and key block partial
], ids=str)
def test_training_step_replays_from_a_cuda_graph(d, n, hkv, causal, deterministic, monkeypatch):
    """A training step (forward and backward) captured in one CUDA graph, after warm-up on a side stream as
    ``torch.cuda.graph`` asks, and replayed on new data copied into its inputs: the output and gradients equal an
    eager step's on that data (dQ up to float32 summation order where its adds go in any order), the eager step
    taken without the kept launches the capture replays (``ONLINEATTN_LAUNCH_CACHE=0``'s full path). The small-N
    training steps whose host time is as long as their kernels (benchmarks/NOTES.md v25-v26) run this way."""
    gen = torch.Generator(device="cuda").manual_seed(d + n + hkv)
    make = lambda h: torch.randn(2, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    leaves = [make(h).requires_grad_() for h in (4, hkv, hkv)]
    do = make(4)

    def step(q, k, v, do):
        o = onlineattn.attention(q, k, v, causal=causal, deterministic=deterministic)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(*leaves, do)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*leaves, do)
    for _ in range(2):
        fresh = [make(h) for h in (4, hkv, hkv, 4)]
        with torch.no_grad():
            for x, y in zip((*leaves, do), fresh):
                x.copy_(y)
        graph.replay()
        with monkeypatch.context() as full_path:
            full_path.setattr(launch_cache, "enabled", False)
            want = step(*(x.clone().requires_grad_() for x in fresh[:3]), fresh[3])
        for name, got, ref in zip(("o", "dq", "dk", "dv"), captured, want):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-6)
            else:
                assert torch.equal(got, ref), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_positive_scales_match_the_oracle(backend, scale, causal):
    """The kernels take a row's maximum of the raw scores before scaling, so a scale <= 0 reaches them as q negated
    (or zeroed) with a positive scale: o, lse and the gradients are the oracle's, masked keys included (Sk off the
    block size, causal rows that see few keys)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    q, k, v = (x.to(device) for x in _qkv(torch.Generator().manual_seed(20), sq=9, sk=13))
    do = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(21)).to(device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = onlineattn.attention(*leaves, causal=causal, softmax_scale=scale, return_lse=True, backend=backend)
    grads = torch.autograd.grad(o, leaves, do)
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    R.assert_within_rule("o", o, exact_o)
    R.assert_within_rule("lse", lse, exact_lse)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal, softmax_scale=scale)
    for name, got, want in zip(("dq", "dk", "dv"), grads, exact):
        R.assert_within_rule(name, got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_kvcache_non_positive_scales_match_the_oracle(backend, scale):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    q, k_cache, v_cache, _, _ = (x.to(device) for x in _decode_inputs(torch.Generator().manual_seed(22)))
    lens = torch.tensor([5, 30], dtype=torch.int32, device=device)
    o, lse = onlineattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, softmax_scale=scale,
                                               return_lse=True, backend=backend)
    exact = R.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens, softmax_scale=scale)
    R.assert_within_rule("o", o, exact[0])
    R.assert_within_rule("lse", lse, exact[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("variant", ["window", "softcap", "alibi", "sinks", "bias", "all"])
def test_negative_scale_with_score_variants_matches_the_oracle(backend, variant):
    """A negative scale through every score variant (each scales the scores before its max, but the row max of the
    masked keys once gave NaN too): o, lse and every gradient, the bias's and the sinks' included."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    gen = torch.Generator().manual_seed(23)
    q, k, v = (x.to(device) for x in _qkv(gen, sq=9, sk=13))
    do = torch.randn(q.shape[:3] + v.shape[3:], generator=gen).to(device)
    extra = {"window": dict(window_size=(3, 1)), "softcap": dict(softcap=5.0),
             "alibi": dict(alibi_slopes=torch.rand(4, generator=gen).to(device)),
             "sinks": dict(sinks=torch.randn(4, generator=gen).to(device).requires_grad_()),
             "bias": dict(attn_bias=torch.randn(1, 4, 9, 13, generator=gen).to(device).requires_grad_())}
    every = {name: value for part in extra.values() for name, value in part.items()}
    kw = every if variant == "all" else extra[variant]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = onlineattn.attention(*leaves, causal=True, softmax_scale=-0.3, return_lse=True, backend=backend, **kw)
    wrt = leaves + [kw[name] for name in ("attn_bias", "sinks") if name in kw]
    grads = torch.autograd.grad(o, wrt, do)
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=True, softmax_scale=-0.3, return_lse=True, **kw)
    R.assert_within_rule("o", o, exact_o)
    R.assert_within_rule("lse", lse, exact_lse)
    exact = R.naive_attention_grads(q, k, v, do, causal=True, softmax_scale=-0.3, **kw)
    names = ["dq", "dk", "dv"] + [{"attn_bias": "dbias", "sinks": "dsinks"}[n] for n in ("attn_bias", "sinks")
                                  if n in kw]
    for name, got in zip(names, grads):
        R.assert_within_rule(name, got, exact[name])
