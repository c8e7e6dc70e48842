"""Every bad argument raises ValueError or TypeError naming the argument, through the public entry points.

Hand-picked cases first, then hypothesis: random valid shapes with one mismatch injected.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onlineattn
from onlineattn import _validate as V
from onlineattn import reference as R


def _names(message: str, arg: str) -> bool:
    """Whether ``message`` mentions ``arg`` as a word (``k`` in ``"k has 3 heads"``, not in ``"block"``)."""
    return re.search(rf"(?<![\w]){re.escape(arg)}(?![\w])", message) is not None


def _qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dv=8, dtype=torch.float32):
    return torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype), torch.randn(b, sk, hkv, dv, dtype=dtype)


def _raises(exc, arg, fn, *shown):
    """Call ``fn``; it must raise ``exc`` whose message names ``arg`` and shows each of ``shown``."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert _names(msg, arg), f"message does not name {arg!r}: {msg!r}"
    for s in shown:
        assert str(s) in msg, f"message does not show {s!r}: {msg!r}"
    return msg


def _call(q, k, v, **kw):
    return lambda: onlineattn.attention(q, k, v, backend="torch", **kw)


# ---- q, k, v -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [2, 3, 5])
def test_wrong_rank(which, rank):
    t = dict(zip("qkv", _qkv()))
    t[which] = torch.randn(*([3] * rank))
    _raises(ValueError, which, _call(t["q"], t["k"], t["v"]), "4", rank)


@pytest.mark.parametrize("which", ["k", "v"])
def test_batch_mismatch(which):
    t = dict(zip("qkv", _qkv(b=2)))
    t[which] = torch.randn(3, *t[which].shape[1:])
    _raises(ValueError, which, _call(t["q"], t["k"], t["v"]), 3, 2)


def test_length_mismatch_between_k_and_v():
    q, k, _ = _qkv(sk=7)
    v = torch.randn(2, 9, 2, 8)
    _raises(ValueError, "v", _call(q, k, v), 7, 9)


@pytest.mark.parametrize("hq,hkv", [(8, 3), (4, 8), (6, 4)])
def test_heads_do_not_divide(hq, hkv):
    q, k, v = _qkv(hq=hq, hkv=hkv)
    _raises(ValueError, "k", _call(q, k, v), hq, hkv)


def test_k_and_v_heads_differ():
    q, k, _ = _qkv(hq=4, hkv=2)
    v = torch.randn(2, 7, 4, 8)
    _raises(ValueError, "v", _call(q, k, v), 2, 4)


def test_head_dim_mismatch():
    q, _, v = _qkv(d=8)
    k = torch.randn(2, 7, 2, 12)
    _raises(ValueError, "k", _call(q, k, v), 8, 12)


@pytest.mark.parametrize("which,d,dv", [("q", 257, 8), ("q", 512, 8), ("v", 8, 257), ("v", 64, 300)])
def test_head_dim_too_large(which, d, dv):
    q, k, v = _qkv(d=d, dv=dv, sq=2, sk=2)
    _raises(ValueError, which, _call(q, k, v), 256, d if which == "q" else dv)


def test_head_dim_256_is_accepted():
    q, k, v = _qkv(d=256, dv=256, sq=3, sk=3)
    assert onlineattn.attention(q, k, v, backend="torch").shape == (2, 3, 4, 256)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_dtypes(which):
    t = dict(zip("qkv", _qkv()))
    t[which] = t[which].to(torch.float16)
    _raises(TypeError, which, _call(t["q"], t["k"], t["v"]), "float16", "float32")


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_non_float_tensors(which, dtype):
    t = dict(zip("qkv", _qkv()))
    t[which] = torch.zeros(t[which].shape, dtype=dtype)
    _raises(TypeError, which, _call(t["q"], t["k"], t["v"]), str(dtype).replace("torch.", ""))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.zeros((2, 5, 4, 8)), [[1.0]], 3.0, None], ids=["ndarray", "list", "float", "None"])
def test_non_tensors(which, value):
    t = dict(zip("qkv", _qkv()))
    t[which] = value
    _raises(TypeError, which, _call(t["q"], t["k"], t["v"]), type(value).__name__)


def test_different_devices():
    q, k, v = _qkv()
    for args in ((q, k.to("meta"), v), (q, k, v.to("meta")), (q.to("meta"), k, v)):
        _raises(ValueError, "device", _call(*args), "meta", "cpu")


# ---- the other arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["0.5", True, False, torch.tensor(0.5), [0.5], 1j], ids=repr)
def test_bad_scale_type(scale):
    _raises(TypeError, "softmax_scale", _call(*_qkv(), softmax_scale=scale))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(scale):
    _raises(ValueError, "softmax_scale", _call(*_qkv(), softmax_scale=scale), scale)


@pytest.mark.parametrize("backend", ["cuda", "Torch", "", "flash"])
def test_unknown_backend(backend):
    q, k, v = _qkv()
    _raises(ValueError, "backend", lambda: onlineattn.attention(q, k, v, backend=backend), repr(backend), "torch")


@pytest.mark.parametrize("backend", [None, 1, ("torch",)])
def test_backend_not_a_string(backend):
    q, k, v = _qkv()
    _raises(TypeError, "backend", lambda: onlineattn.attention(q, k, v, backend=backend))


@pytest.mark.parametrize("arg", ["causal", "return_lse", "deterministic"])
@pytest.mark.parametrize("value", ["yes", None, 1.0])
def test_flags_must_be_bool(arg, value):
    _raises(TypeError, arg, _call(*_qkv(), **{arg: value}), type(value).__name__)


# ---- merge_states --------------------------------------------------------------------------------------------


def _states(b=2, s=5, h=3, d=4, dtype=torch.float32):
    return torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, h, s), torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, h, s)


def _merge(states):
    return lambda: onlineattn.merge_states(*states)


STATE_NAMES = ["o_a", "lse_a", "o_b", "lse_b"]


@pytest.mark.parametrize("i", range(4), ids=STATE_NAMES)
def test_merge_wrong_rank(i):
    states = list(_states())
    states[i] = states[i][..., None]
    _raises(ValueError, STATE_NAMES[i], _merge(states))


def test_merge_o_shapes_differ():
    o_a, lse_a, _, lse_b = _states()
    _raises(ValueError, "o_b", _merge((o_a, lse_a, torch.randn(2, 5, 3, 6), lse_b)), (2, 5, 3, 6))


@pytest.mark.parametrize("i", [1, 3], ids=["lse_a", "lse_b"])
@pytest.mark.parametrize("shape", [(2, 5, 3), (2, 3, 6), (1, 3, 5)], ids=["seq-heads-swapped", "long", "batch"])
def test_merge_lse_shape(i, shape):
    states = list(_states())
    states[i] = torch.randn(shape)
    _raises(ValueError, STATE_NAMES[i], _merge(states), shape, (2, 3, 5))


def test_merge_dtypes():
    o_a, lse_a, o_b, lse_b = _states()
    _raises(TypeError, "o_b", _merge((o_a, lse_a, o_b.half(), lse_b)), "float16")
    _raises(TypeError, "lse_b", _merge((o_a, lse_a, o_b, lse_b.double())), "float64")
    _raises(TypeError, "lse_a", _merge((o_a, lse_a.long(), o_b, lse_b)), "int64")
    _raises(TypeError, "o_a", _merge((np.zeros((2, 5, 3, 4)), lse_a, o_b, lse_b)), "ndarray")


def test_merge_devices():
    o_a, lse_a, o_b, lse_b = _states()
    _raises(ValueError, "lse_b", _merge((o_a, lse_a, o_b, lse_b.to("meta"))), "meta")


# ---- hypothesis: random shapes, one mismatch injected --------------------------------------------------------

MISMATCHES = ["rank", "batch", "seqlen", "heads_divide", "kv_heads", "head_dim", "head_dim_big", "dtype", "int"]
HYP = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _bad_qkv(draw):
    b, sq, sk = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    hkv, group = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    d, dv = draw(st.integers(1, 32)), draw(st.integers(1, 32))
    shapes = {"q": [b, sq, hkv * group, d], "k": [b, sk, hkv, d], "v": [b, sk, hkv, dv]}
    dtypes = dict.fromkeys("qkv", draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])))
    kind = draw(st.sampled_from(MISMATCHES))
    other = lambda n: draw(st.integers(1, 8).filter(lambda x: x != n))
    if kind == "rank":
        culprit = draw(st.sampled_from("qkv"))
        extra = draw(st.integers(-3, 2).filter(lambda x: x != 0))
        shapes[culprit] = shapes[culprit][: 4 + extra] if extra < 0 else shapes[culprit] + [1] * extra
        exc = ValueError
    elif kind == "batch":
        culprit = draw(st.sampled_from("kv"))
        shapes[culprit][0] = other(b)
        exc = ValueError
    elif kind == "seqlen":
        culprit = draw(st.sampled_from("kv"))
        shapes[culprit][1] = other(sk)
        exc = ValueError
    elif kind == "heads_divide":
        culprit = "k"
        hq = shapes["q"][2]
        bad = draw(st.integers(1, 12).filter(lambda x: hq % x != 0))
        shapes["k"][2] = shapes["v"][2] = bad
        exc = ValueError
    elif kind == "kv_heads":
        culprit = "v"
        shapes["v"][2] = other(hkv)
        exc = ValueError
    elif kind == "head_dim":
        culprit = "k"
        shapes["k"][3] = draw(st.integers(1, 40).filter(lambda x: x != d))
        exc = ValueError
    elif kind == "head_dim_big":
        culprit = draw(st.sampled_from("qv"))
        big = draw(st.integers(257, 400))
        if culprit == "q":
            shapes["q"][3] = shapes["k"][3] = big
        else:
            shapes["v"][3] = big
        exc = ValueError
    elif kind == "dtype":
        culprit = draw(st.sampled_from("qkv"))
        dtypes[culprit] = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]).filter(lambda t: t != dtypes["q"]))
        exc = TypeError
    else:
        culprit = draw(st.sampled_from("qkv"))
        dtypes[culprit] = draw(st.sampled_from([torch.int8, torch.int32, torch.int64, torch.bool]))
        exc = TypeError
    tensors = {n: torch.zeros(shapes[n], dtype=dtypes[n]) for n in "qkv"}
    return kind, culprit, exc, tensors


@HYP
@given(_bad_qkv(), st.booleans())
def test_hypothesis_invalid_qkv(bad, causal):
    kind, culprit, exc, t = bad
    with pytest.raises(exc) as info:
        onlineattn.attention(t["q"], t["k"], t["v"], causal=causal, backend="torch")
    msg = str(info.value)
    assert _names(msg, culprit), f"{kind}: message does not name {culprit!r}: {msg!r}"


@HYP
@given(
    st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.integers(1, 16),
    st.sampled_from(["o_b", "lse_a", "lse_b"]), st.data(),
)
def test_hypothesis_invalid_merge_shapes(b, s, h, d, culprit, data):
    shapes = {"o_a": [b, s, h, d], "lse_a": [b, h, s], "o_b": [b, s, h, d], "lse_b": [b, h, s]}
    axis = data.draw(st.integers(0, len(shapes[culprit]) - 1))
    shapes[culprit][axis] = data.draw(st.integers(1, 8).filter(lambda x: x != shapes[culprit][axis]))
    states = [torch.zeros(shapes[n]) for n in STATE_NAMES]
    with pytest.raises(ValueError) as info:
        onlineattn.merge_states(*states)
    assert _names(str(info.value), culprit), str(info.value)


@HYP
@given(
    st.integers(1, 3), st.integers(0, 6), st.integers(0, 6), st.integers(1, 4), st.integers(1, 4),
    st.integers(1, 256), st.integers(1, 256),
)
def test_hypothesis_valid_shapes_pass(b, sq, sk, hkv, group, d, dv):
    """The converse: valid shapes (zero lengths included) pass validation with the right sizes."""
    q = torch.empty(b, sq, hkv * group, d, device="meta")
    k = torch.empty(b, sk, hkv, d, device="meta")
    v = torch.empty(b, sk, hkv, dv, device="meta")
    dims = V.check_qkv(q, k, v)
    assert dims == V.Dims(b, sq, sk, hkv * group, hkv, d, dv) and dims.group == group


# ---- attention_with_kvcache ------------------------------------------------------------------------------------


def _kv(b=2, sq=1, hq=4, hkv=2, d=8, dv=8, cap=32, new=1, paged=False, dtype=torch.float32):
    """Valid arguments: a contiguous cache of ``cap`` tokens, or a pool of 6 pages of 16 with a 2-page table."""
    t = {"q": torch.randn(b, sq, hq, d, dtype=dtype)}
    if paged:
        t["k_cache"], t["v_cache"] = torch.zeros(6, 16, hkv, d, dtype=dtype), torch.zeros(6, 16, hkv, dv, dtype=dtype)
        t["block_table"] = torch.arange(2 * b, dtype=torch.int32).reshape(b, 2)
    else:
        t["k_cache"], t["v_cache"] = torch.zeros(b, cap, hkv, d, dtype=dtype), torch.zeros(b, cap, hkv, dv, dtype=dtype)
    if new:
        t["k"], t["v"] = torch.randn(b, new, hkv, d, dtype=dtype), torch.randn(b, new, hkv, dv, dtype=dtype)
    t["cache_seqlens"] = torch.full((b,), 3, dtype=torch.int32)
    return t


def _kvcall(t, **kw):
    t = {**t, **kw}
    args = [t.pop(n) for n in ("q", "k_cache", "v_cache")]
    return lambda: onlineattn.attention_with_kvcache(*args, **t)


def test_kvcache_valid_arguments_pass():
    for paged in (False, True):
        assert _kvcall(_kv(paged=paged), backend="torch")().shape == (2, 1, 4, 8)


KV_BAD = pytest.mark.parametrize(
    "arg,value,exc,shown",
    [
        ("q", torch.randn(2, 4, 8), ValueError, [4, 3]),
        ("k_cache", torch.zeros(2, 32, 2, 8, dtype=torch.float16), TypeError, ["float16"]),
        ("k_cache", torch.zeros(3, 32, 2, 8), ValueError, [3, 2]),
        ("v_cache", torch.zeros(2, 31, 2, 8), ValueError, [31]),
        ("k_cache", torch.zeros(2, 32, 2, 12), ValueError, [8, 12]),
        ("v_cache", torch.zeros(2, 32, 2, 300), ValueError, [256, 300]),
        ("k_cache", torch.zeros(2, 32, 2, 16)[..., ::2], ValueError, ["stride"]),
        ("k", torch.randn(2, 1, 2, 8, dtype=torch.float16), TypeError, ["float16"]),
        ("k", torch.randn(2, 1, 1, 8), ValueError, [(2, 1, 2, 8)]),
        ("v", torch.randn(2, 2, 2, 8), ValueError, [(2, 1, 2, 8)]),
        ("v", None, ValueError, ["None"]),
        ("cache_seqlens", torch.full((2,), 3), TypeError, ["int64"]),
        ("cache_seqlens", torch.full((3,), 3, dtype=torch.int32), ValueError, [(3,)]),
        ("cache_seqlens", 3.0, TypeError, ["float"]),
        ("cache_seqlens", True, TypeError, ["bool"]),
        ("cache_seqlens", -1, ValueError, [-1]),
        ("cache_seqlens", 32, ValueError, [32, 31]),  # one new token: at most 31 cached
        ("cache_seqlens", torch.tensor([3, -2], dtype=torch.int32), ValueError, ["cache_seqlens[1]", -2]),
        ("cache_seqlens", torch.tensor([32, 3], dtype=torch.int32), ValueError, ["cache_seqlens[0]", 32, 31]),
        ("num_splits", -1, ValueError, [-1]),
        ("num_splits", 70000, ValueError, [70000]),
        ("num_splits", 2.0, TypeError, ["float"]),
        ("num_splits", True, TypeError, ["bool"]),
        ("causal", 1, TypeError, ["int"]),
        ("check_indices", None, TypeError, ["NoneType"]),
        ("softmax_scale", float("nan"), ValueError, ["nan"]),
        ("backend", "cuda", ValueError, ["'cuda'"]),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)


@KV_BAD
def test_kvcache_bad_argument(arg, value, exc, shown):
    _raises(exc, arg, _kvcall(_kv(), **{arg: value}), *shown)


@KV_BAD
def test_kvcache_bad_argument_after_a_passing_call(arg, value, exc, shown):
    """check_kvcache remembers the metadata of calls that passed; a bad call right after a good one is still
    refused with the same error."""
    t = _kv()
    _kvcall(t)()
    _kvcall(t)()
    _raises(exc, arg, _kvcall(t, **{arg: value}), *shown)


def _counted(monkeypatch, module, checks: str, memo: str) -> list:
    """Count the calls of ``module.checks`` (each appends to the list returned), its memo ``module.memo`` emptied."""
    calls = []
    full = getattr(module, checks)
    monkeypatch.setattr(module, checks, lambda *a: calls.append(1) or full(*a))
    monkeypatch.setattr(module, memo, {})
    return calls


@pytest.mark.parametrize(
    "good,bad,exc,shown",
    [
        (dict(causal=True), dict(causal=1), TypeError, ["int"]),
        (dict(return_lse=False), dict(return_lse=0), TypeError, ["int"]),
        (dict(check_indices=True), dict(check_indices=1.0), TypeError, ["float"]),
        (dict(num_splits=1), dict(num_splits=True), TypeError, ["bool"]),
        (dict(num_splits=2), dict(num_splits=2.0), TypeError, ["float"]),
        (dict(softmax_scale=1), dict(softmax_scale=True), TypeError, ["bool"]),
        (dict(softmax_scale=0.5), dict(softmax_scale=np.float32(0.5)), TypeError, ["float32"]),
        (dict(causal=True), dict(causal=[True]), TypeError, ["list"]),
    ],
    ids=["causal-int", "lse-int", "indices-float", "splits-bool", "splits-float", "scale-bool", "scale-numpy",
         "causal-unhashable"],
)
def test_kvcache_keywords_equal_to_passing_ones_are_still_checked(good, bad, exc, shown):
    """The keywords' checks are remembered per metadata and keyword values with their types: a value equal to one
    that passed (``1 == True``, ``np.float32(0.5) == 0.5``), or one that cannot key a table, is still checked and
    refused with the error a first call gets."""
    t = _kv(new=0)
    for _ in range(2):
        _kvcall(t, **good)()
    _raises(exc, next(iter(bad)), _kvcall(t, **bad), *shown)


def test_kvcache_keywords_are_checked_once_per_metadata(monkeypatch):
    """A repeated call checks its keywords once; other keyword values or other metadata check them again."""
    from onlineattn import api
    from onlineattn.api import kvcache_keywords as checks

    calls = _counted(monkeypatch, api, "kvcache_keywords", "_CHECKED_KEYWORDS")
    t = _kv(new=0)
    for _ in range(3):
        _kvcall(t, causal=False)()
    assert len(calls) == 1
    (remembered,) = api._CHECKED_KEYWORDS.values()
    assert remembered == checks(t["q"], None, False, False, True, 0, "auto")  # what the checks return
    _kvcall(t, causal=True)()
    _kvcall(t, causal=False, softmax_scale=0.25)()
    _kvcall(t, causal=False, q=torch.randn(2, 1, 4, 8, dtype=torch.float64), k_cache=t["k_cache"].double(),
            v_cache=t["v_cache"].double())()
    assert len(calls) == 4
    _kvcall(t, causal=False)()
    assert len(calls) == 4


def test_kvcache_keywords_follow_triton_interpret_off_cuda(monkeypatch):
    """Off CUDA a forced ``backend="triton"`` needs TRITON_INTERPRET, read per call: a call that passed with it set
    does not let the next call through once it is unset."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs where Triton's interpreter is on (CPU machines)")
    t = _kv(new=0)
    _kvcall(t, backend="triton")()
    _kvcall(t, backend="triton")()
    monkeypatch.delenv("TRITON_INTERPRET")
    _raises(ValueError, "backend", _kvcall(t, backend="triton"), "TRITON_INTERPRET")


def test_kvcache_checks_run_once_per_metadata(monkeypatch):
    """A repeated call (same shapes, strides, dtypes, devices, int length) skips the checks; new metadata, a new int
    length or a tensor subclass runs them."""
    calls = _counted(monkeypatch, V, "_check_kvcache", "_CHECKED_KVCACHE")
    t = _kv(new=0)
    for _ in range(3):
        _kvcall(t)()
    assert len(calls) == 1
    _kvcall(t, q=torch.randn(2, 1, 4, 8, dtype=torch.float64), k_cache=t["k_cache"].double(),
            v_cache=t["v_cache"].double())()
    assert len(calls) == 2
    _kvcall(t, cache_seqlens=5)()
    _kvcall(t, cache_seqlens=5)()
    _kvcall(t, cache_seqlens=6)()
    assert len(calls) == 4

    class Sub(torch.Tensor):
        pass

    sub = t["q"].as_subclass(Sub)
    for _ in range(2):
        _kvcall(t, q=sub)()
    assert len(calls) == 6


def test_kvcache_sparse_lengths_get_the_checks_error():
    """Sparse tensors (CSR ones raise on stride()) are left to the checks, which refuse them naming the argument."""
    t = _kv()
    sparse = torch.tensor([[3, 3]], dtype=torch.int32).to_sparse()
    _raises(TypeError, "cache_seqlens", _kvcall(t, cache_seqlens=sparse), "dense")


def test_sparse_and_nested_tensors_are_refused_naming_them():
    q, k, v = _qkv()
    _raises(TypeError, "k", lambda: onlineattn.attention(q, k.to_sparse(), v), "dense", "sparse")
    nested = torch.nested.nested_tensor([torch.randn(5, 4, 8), torch.randn(3, 4, 8)], layout=torch.jagged)
    _raises(TypeError, "q", lambda: onlineattn.attention(nested, k, v), "dense")


@pytest.mark.parametrize("kw,arg", [({"softmax_scale": 1e39}, "softmax_scale"),
                                    ({"softmax_scale": 10**400}, "softmax_scale"),
                                    ({"softmax_scale": -1e39}, "softmax_scale"),
                                    ({"softmax_scale": 3e38}, "softmax_scale"),
                                    ({"softmax_scale": 1e-39}, "softmax_scale"),
                                    ({"softmax_scale": -1e-45}, "softmax_scale"), ({"softcap": 1e300}, "softcap"),
                                    ({"softcap": 3e38}, "softcap"), ({"softcap": 1e-40}, "softcap")])
def test_scale_and_softcap_must_fit_float32(kw, arg):
    """The kernels compute in float32 with log2 e folded into the scale and the softcap: a factor whose product
    with it is past float32's range (inf there) or subnormal (0 on the GPU, so 0 / 0 for a zero score) is refused.
    (Scores that pass float32's range once scaled still overflow, as in any float32 kernel.)"""
    q, k, v = _qkv()
    _raises(ValueError, arg, lambda: onlineattn.attention(q, k, v, **kw), "float32")
    assert not onlineattn.attention(torch.zeros_like(q), k, v, softcap=1e-30).isnan().any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_zero_scale_weighs_every_visible_key_alike(backend):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    q, k, v = (x.to(device) for x in _qkv())
    mean = v.mean(1, keepdim=True).repeat_interleave(2, dim=2).expand_as(q)
    assert torch.allclose(onlineattn.attention(q, k, v, softmax_scale=0, backend=backend), mean, atol=1e-6)
    # and a huge softcap over a tiny one: scale / softcap past float32 (the kernels' tanh input factor) is no NaN
    o = onlineattn.attention(torch.zeros_like(q), k, v, softmax_scale=1e20, softcap=1e-20, backend=backend)
    assert torch.allclose(o, mean, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # qk · 2e37: inf, tanh 1
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_huge_scale_under_softcap_is_bounded_by_the_tanh(backend):
    """softcap · tanh(scale · qk / softcap) is bounded for any scale the API takes: with scale 1e38 the torch path
    had scaled q by it before QKᵀ (inf, then NaN or a wrong o and lse); now the scale joins inside the tanh on both
    paths. Every score saturates to ±softcap, so o and lse are the oracle's and the gradients 0 (1 - tanh² = 0)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    q, k, v = (x.to(device).requires_grad_() for x in _qkv())
    o, lse = onlineattn.attention(q, k, v, softmax_scale=1e38, softcap=5.0, backend=backend, return_lse=True)
    exact_o, exact_lse = R.naive_attention(q, k, v, softmax_scale=1e38, softcap=5.0, return_lse=True)
    base_o, base_lse = R.torch_math_attention(q, k, v, softmax_scale=1e38, softcap=5.0)
    R.assert_within_rule("o", o, exact_o, base_o, "float32")
    R.assert_within_rule("lse", lse, exact_lse, base_lse, "float32")
    dq, dk = torch.autograd.grad(o.sum(), (q, k))
    assert torch.all(dq == 0) and torch.all(dk == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 2**31 - 1), (2**31 - 1, 0), (2**70, 3), (3, 2**30)])
def test_window_sides_past_every_index_are_unbounded(backend, window):
    """A window side of 2^30 (the kernels' unbounded) or more reaches past every index: it is -1, not a value
    that overflows the kernels' int32 index arithmetic (which then hid every key) or torch's int64 schema."""
    assert V.check_window(window) == tuple(-1 if side >= 2**30 else side for side in window)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    q, k, v = (x.to(device).requires_grad_() for x in _qkv())
    o = onlineattn.attention(q, k, v, window_size=window, backend=backend)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    unbounded = tuple(-1 if side >= 2**30 else side for side in window)
    R.assert_within_rule("o", o, R.naive_attention(q, k, v, window_size=unbounded))
    exact = R.naive_attention_backward(q, k, v, torch.ones_like(o), window_size=unbounded)
    for name, got, want in zip(("dq", "dk", "dv"), grads, exact):
        R.assert_within_rule(name, got, want)


def test_nested_kvcache_tensors_are_refused_naming_them():
    """A nested tensor has no sizes to memoise: it reaches the checks, which name it."""
    t = _kv()
    nested = torch.nested.nested_tensor([torch.randn(1, 4, 8), torch.randn(1, 4, 8)])
    for name in ("q", "k_cache", "v_cache"):
        _raises(TypeError, name, _kvcall(t, **{name: nested}), "dense")


def test_varlen_max_seqlen_is_never_negative():
    cu = torch.zeros(1, dtype=torch.int32)
    empty = (torch.randn(0, 2, 8), torch.randn(0, 1, 8), torch.randn(0, 1, 8))
    for name in ("max_seqlen_q", "max_seqlen_k"):
        lengths = {"max_seqlen_q": 0, "max_seqlen_k": 0, name: -5}
        _raises(ValueError, name, lambda: onlineattn.attention_varlen(*empty, cu, cu, **lengths), "-5")


@pytest.mark.parametrize(
    "arg,value,exc,shown",
    [
        ("block_table", torch.zeros(2, 2, dtype=torch.int64), TypeError, ["int64"]),
        ("block_table", torch.zeros(3, 2, dtype=torch.int32), ValueError, [3, 2]),
        ("block_table", torch.zeros(2, dtype=torch.int32), ValueError, [2, 1]),
        ("block_table", torch.tensor([[0, 1], [2, 6]], dtype=torch.int32), ValueError, ["block_table[1, 1]", 6]),
        ("block_table", torch.tensor([[0, -1], [2, 3]], dtype=torch.int32), ValueError, ["block_table[0, 1]", -1]),
        ("k_cache", torch.zeros(6, 24, 2, 8), ValueError, [24, 16]),
        ("cache_seqlens", 32, ValueError, [32, 31]),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_kvcache_bad_paged_argument(arg, value, exc, shown):
    t = _kv(paged=True)
    if arg == "block_table" and value.dim() == 2 and value.shape[0] == 2 and value.dtype == torch.int32:
        t["cache_seqlens"] = torch.tensor([20, 20], dtype=torch.int32)  # each sequence uses both of its pages
    if arg == "k_cache":
        t["v_cache"] = torch.zeros(6, 24, 2, 8)
    _raises(exc, arg, _kvcall(t, **{arg: value}), *shown)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_bad_page_rejected_before_anything_is_written(backend):
    """A bad page id in the part of the table that the call uses is refused before the append, so no cache changes;
    -1 beyond the pages a sequence uses is fine."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # CPU: through the interpreter
    t = _kv(paged=True, new=2)
    t["block_table"] = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    t["cache_seqlens"] = torch.tensor([3, 15], dtype=torch.int32)  # sequence 1 writes tokens 15 and 16: page 9
    t = {name: x.to(device) for name, x in t.items()}
    _raises(ValueError, "block_table", _kvcall(t, backend=backend), "block_table[1, 1]", 9)
    assert not t["k_cache"].any() and not t["v_cache"].any()
    t["block_table"] = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32, device=device)
    _kvcall(t, backend=backend)()  # sequence 0 needs one page only
    assert t["k_cache"].any()


def test_kvcache_heads_do_not_divide():
    t = _kv()
    _raises(ValueError, "k_cache", _kvcall(t, k_cache=torch.zeros(2, 32, 3, 8), v_cache=torch.zeros(2, 32, 3, 8)), 3, 4)


def test_kvcache_devices():
    t = _kv()
    _raises(ValueError, "cache_seqlens", _kvcall(t, cache_seqlens=t["cache_seqlens"].to("meta")), "meta")
    _raises(ValueError, "k", _kvcall(t, k=t["k"].to("meta")), "meta")


def test_kvcache_triton_backend_refuses_float64():
    _raises(TypeError, "q", _kvcall(_kv(dtype=torch.float64), backend="triton"), "float64")


def test_kvcache_refuses_caches_whose_elements_share_memory():
    """New tokens are written into the caches in place: an expanded cache (one write would land in every batch row)
    and a v_cache that is k_cache are refused there; separate views of one buffer (a fused [.., 2 · D] layout) are
    not, and without new tokens (a read-only step) shared memory is fine: a prompt prefix expanded over the batch,
    an MLA-style v_cache that is a slice of k_cache."""
    t = _kv()
    expanded = torch.zeros(1, 32, 2, 8).expand(2, 32, 2, 8)
    _raises(ValueError, "k_cache", _kvcall(t, k_cache=expanded), "strides")
    _raises(ValueError, "v_cache", _kvcall(t, v_cache=expanded), "strides")
    _raises(ValueError, "v_cache", _kvcall(t, v_cache=t["k_cache"]))
    fused = torch.zeros(2, 32, 2, 16)
    assert _kvcall(t, k_cache=fused[..., :8], v_cache=fused[..., 8:])().shape == (2, 1, 4, 8)
    read = _kv(new=0)
    prefix = torch.randn(1, 32, 2, 8).expand(2, 32, 2, 8)
    o = _kvcall(read, k_cache=prefix, v_cache=prefix)()
    assert torch.equal(o, _kvcall(read, k_cache=prefix.contiguous(), v_cache=prefix.contiguous())())
    assert _kvcall(read, v_cache=read["k_cache"][..., :4])().shape == (2, 1, 4, 4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter off (a CUDA machine)")
def test_triton_backend_on_the_interpreter_refuses_bfloat16():
    """Triton 3.6's interpreter computes bfloat16 dots wrongly: a CPU call forced onto backend='triton' is refused
    (TypeError naming the tensor) rather than answered wrongly; merges, which multiply no matrices, still run."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    _raises(TypeError, "q", lambda: onlineattn.attention(q, k, v, backend="triton"), "bfloat16")
    _raises(TypeError, "q", _kvcall(_kv(dtype=torch.bfloat16), backend="triton"), "bfloat16")
    o, lse = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16), torch.randn(2, 4, 3)
    merged, _ = onlineattn.merge_states(o, lse, o, lse, backend="triton")
    assert torch.allclose(merged.float(), o.float())
