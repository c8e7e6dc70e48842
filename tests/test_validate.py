"""Every bad argument raises ValueError or TypeError naming the argument, through the public entry points.

Hand-picked cases first, then hypothesis: random valid shapes with one mismatch injected.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onlineattn
from onlineattn import _validate as V


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
