"""``onlineattn.compat.flash_attn``: flash-attn 2's signatures and return conventions, against the float64 oracle.

Results are held to ``reference.assert_within_rule`` with ``reference.torch_math_attention`` as the same-dtype
baseline. On CPU this is the torch path; on CUDA (marked gpu) the Triton kernels, bf16 included.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from onlineattn import api
from onlineattn import reference as R
from onlineattn.compat import flash_attn as FA

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _randn(gen, device, dtype, *shape):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("sq, sk, hq, hkv, causal", [(17, 17, 4, 4, True), (9, 33, 6, 2, True), (33, 9, 4, 1, False),
                                                      (129, 70, 2, 2, True)])
def test_flash_attn_func_matches_the_oracle(sq, sk, hq, hkv, causal, dtype, device):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, k, v = _randn(gen, device, dtype, 2, sq, hq, 24), _randn(gen, device, dtype, 2, sk, hkv, 24), \
        _randn(gen, device, dtype, 2, sk, hkv, 24)
    out, lse, probs = FA.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert probs is None and out.dtype == dtype and lse.shape == (2, hq, sq)
    assert torch.equal(FA.flash_attn_func(q, k, v, causal=causal), out)
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=causal, return_lse=True)
    base_o, base_lse = R.torch_math_attention(q, k, v, causal=causal)
    R.assert_within_rule("out", out, exact_o, base_o, _name(dtype))
    R.assert_within_rule("softmax_lse", lse, exact_lse, base_lse, "float64" if dtype == torch.float64 else "float32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_packed_variants_equal_the_unpacked_call_and_grads_reach_the_pack(dtype, device):
    gen = torch.Generator().manual_seed(1)
    qkv = _randn(gen, device, dtype, 2, 11, 3, 4, 16).requires_grad_()
    out = FA.flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.3)
    assert torch.equal(out, FA.flash_attn_func(*qkv.unbind(2), causal=True, softmax_scale=0.3))
    out.float().square().sum().backward()
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(2))
    FA.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3).float().square().sum().backward()
    assert torch.equal(qkv.grad, torch.stack((q.grad, k.grad, v.grad), dim=2))

    q, kv = _randn(gen, device, dtype, 1, 5, 4, 16), _randn(gen, device, dtype, 1, 8, 2, 2, 16)
    got = FA.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    want = FA.flash_attn_func(q, *kv.unbind(2), return_attn_probs=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None


def test_signatures_are_flash_attn_2s():
    """Positional order and defaults as in flash_attn/flash_attn_interface.py (v2.8)."""
    expect = {
        "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                           "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
        "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                                  "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                  "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None",
        "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
                                   "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
                                   "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                   "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                                   "return_softmax_lse=False",
    }
    for name, params in expect.items():
        assert str(inspect.signature(getattr(FA, name))) == f"({params})", name


@pytest.mark.parametrize("keyword, value", [("window_size", (4, 0)), ("softcap", 30.0),
                                            ("alibi_slopes", torch.ones(4)), ("dropout_p", 0.1)])
def test_features_onlineattn_lacks_raise_naming_the_parameter(keyword, value):
    """Passed on to ``attention``: NotImplementedError naming the keyword until issue #6 implements it, then a result."""
    q = torch.randn(1, 5, 4, 16)
    try:
        out = FA.flash_attn_func(q, q, q, **{keyword: value})
    except NotImplementedError as err:
        assert keyword in str(err)
    else:  # issue #6 has landed: the keyword reached attention() and computed something of the right shape
        assert out.shape == q.shape and torch.isfinite(out).all()


def test_deterministic_keeps_flash_attns_default(monkeypatch):
    """flash_attn_func hands ``deterministic`` on with flash-attn's default (False: the backward may sum dQ in any
    order where that is faster), and True when asked."""
    seen = []
    attention = api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **kw: seen.append(kw["deterministic"]) or attention(*a, **kw))
    q, k, v = (torch.randn(1, 5, 2, 16) for _ in range(3))
    FA.flash_attn_func(q, k, v)
    FA.flash_attn_func(q, k, v, deterministic=True)
    assert seen == [False, True]


def test_varlen_without_attention_varlen_names_it(monkeypatch):
    monkeypatch.delattr(api, "attention_varlen", raising=False)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 4, 16)
    with pytest.raises(NotImplementedError, match="onlineattn.attention_varlen"):
        FA.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4)
    with pytest.raises(NotImplementedError, match="onlineattn.attention_varlen"):
        FA.flash_attn_varlen_qkvpacked_func(torch.stack((q, q, q), dim=1), cu, 4)


def test_varlen_is_wired_to_attention_varlen(monkeypatch):
    """With a stand-in for #6's ``attention_varlen``: arguments arrive in order, non-default keywords are passed,
    keywords it does not take raise naming themselves, and the result comes back in flash-attn's conventions."""
    calls = []

    def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                         softmax_scale=None, window_size=(-1, -1), deterministic=True, return_lse=False):
        calls.append(dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                          softmax_scale=softmax_scale, window_size=window_size, return_lse=return_lse))
        return q * 2, torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(api, "attention_varlen", attention_varlen, raising=False)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, kv = torch.randn(7, 4, 16), torch.randn(7, 2, 2, 16)
    out, lse, probs = FA.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 4, 5, causal=True, window_size=(2, 0),
                                                         return_attn_probs=True)
    assert torch.equal(out, q * 2) and lse.shape == (4, 7) and probs is None
    assert calls == [dict(max_seqlen_q=4, max_seqlen_k=5, causal=True, softmax_scale=None, window_size=(2, 0),
                          return_lse=True)]
    with pytest.raises(NotImplementedError, match="softcap=30.0 is not supported by onlineattn.attention_varlen"):
        FA.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 4, 4, softcap=30.0)


@pytest.mark.skipif(not hasattr(api, "attention_varlen"), reason="onlineattn.attention_varlen lands with issue #6")
def test_varlen_equals_one_call_per_sequence():
    gen = torch.Generator().manual_seed(4)
    lengths = [3, 17, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (_randn(gen, "cpu", torch.float64, sum(lengths), 4, 16) for _ in range(3))
    out = FA.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = FA.flash_attn_func(q[None, rows], k[None, rows], v[None, rows], causal=True)[0]
        R.assert_within_rule(f"sequence {b}", out[rows], R._f64(one), None, "float64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_with_kvcache_matches_the_oracle(paged, dtype, device):
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, d, page = 2, 4, 2, 16, 16
    lens = torch.tensor([20, 5], dtype=torch.int32)
    if paged:
        table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32, device=device)
        k_cache, v_cache = (_randn(gen, device, dtype, 4, page, hkv, d) for _ in range(2))
    else:
        table = None
        k_cache, v_cache = (_randn(gen, device, dtype, b, 2 * page, hkv, d) for _ in range(2))
    q, k, v = _randn(gen, device, dtype, b, 3, hq, d), *(_randn(gen, device, dtype, b, 3, hkv, d) for _ in range(2))
    exact_o, exact_lse, exact_k, _ = R.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                         block_table=table, causal=True)
    out, lse = FA.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens.to(device),
                                          block_table=table, causal=True, return_softmax_lse=True)
    assert lse.shape == (b, hq, 3)
    R.assert_within_rule("k_cache", k_cache, exact_k, k_cache, _name(dtype))  # the new tokens were written in place
    base = None
    if dtype == torch.bfloat16:  # the baseline: textbook attention in bf16 over each sequence's visible tokens
        base = torch.cat([R.torch_math_attention(q[i : i + 1], *_visible(k_cache, v_cache, table, i, int(lens[i]) + 3),
                                                 causal=True)[0] for i in range(b)])
    R.assert_within_rule("out", out, exact_o, base, _name(dtype))


def _visible(k_cache, v_cache, table, i, length):
    """Sequence i's first ``length`` cached tokens, ``[1, length, Hkv, D]``, from a contiguous or paged cache."""
    if table is None:
        return k_cache[i : i + 1, :length], v_cache[i : i + 1, :length]
    page = k_cache.shape[1]
    t = torch.arange(length, device=k_cache.device)
    index = (table[i].long()[t // page], t % page)
    return k_cache[index][None], v_cache[index][None]


def test_with_kvcache_without_seqlens_reads_the_whole_cache():
    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache = torch.randn(2, 1, 4, 8, generator=gen), torch.randn(2, 6, 2, 8, generator=gen), \
        torch.randn(2, 6, 2, 8, generator=gen)
    out = FA.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.allclose(out, FA.flash_attn_func(q, k_cache, v_cache), atol=1e-6)
    with pytest.raises(ValueError, match="cache_seqlens=None"):
        FA.flash_attn_with_kvcache(q, k_cache, v_cache, k_cache[:, :1], v_cache[:, :1])


@pytest.mark.parametrize("keyword", ["rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad"])
def test_with_kvcache_features_onlineattn_lacks_raise_naming_them(keyword):
    q, cache = torch.randn(1, 1, 2, 8), torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match=f"{keyword}=a Tensor is not supported by onlineattn"):
        FA.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2, **{keyword: torch.zeros(1, dtype=torch.int32)})


@pytest.mark.parametrize("call,packed,layout", [
    (lambda x: FA.flash_attn_qkvpacked_func(x), torch.randn(2, 5, 4, 16), "qkv"),
    (lambda x: FA.flash_attn_qkvpacked_func(x), torch.randn(2, 5, 3, 2), "qkv"),
    (lambda x: FA.flash_attn_kvpacked_func(torch.randn(1, 5, 2, 16), x), torch.randn(1, 5, 3, 2, 16), "kv"),
    (lambda x: FA.flash_attn_varlen_qkvpacked_func(x, torch.tensor([0, 5], dtype=torch.int32), 5),
     torch.randn(5, 2, 2, 16), "qkv"),
    (lambda x: FA.flash_attn_varlen_kvpacked_func(torch.randn(5, 2, 16), x, torch.tensor([0, 5], dtype=torch.int32),
                                                  torch.tensor([0, 5], dtype=torch.int32), 5, 5),
     torch.randn(5, 2, 2, 2, 16), "kv"),
])
def test_packed_variants_refuse_a_bad_pack_naming_it(call, packed, layout):
    """A pack of the wrong rank or with the wrong count along its packed dim raises ValueError naming ``qkv``/``kv``
    with the layout it expects; a non-tensor raises TypeError."""
    with pytest.raises(ValueError, match=rf"^{layout} must be \["):
        call(packed)
    with pytest.raises(TypeError, match=rf"^{layout} must be a torch.Tensor"):
        call([packed])


def test_return_attn_probs_is_a_bool_like_every_flag():
    q, k, v = (torch.randn(1, 3, 2, 16) for _ in range(3))
    for call in (lambda: FA.flash_attn_func(q, k, v, return_attn_probs=1),
                 lambda: FA.flash_attn_varlen_func(q[0], k[0], v[0], *(torch.tensor([0, 3], dtype=torch.int32),) * 2,
                                                   3, 3, return_attn_probs="yes")):
        with pytest.raises(TypeError, match="return_attn_probs"):
            call()


def test_with_kvcache_without_seqlens_checks_what_it_reads_for_the_length():
    """``cache_seqlens=None`` reads the cache's (and block table's) length: a bad one is named, not indexed."""
    q = torch.randn(2, 1, 2, 16)
    with pytest.raises(TypeError, match="k_cache"):
        FA.flash_attn_with_kvcache(q, [1], torch.randn(2, 8, 1, 16))
    with pytest.raises(ValueError, match="k_cache"):
        FA.flash_attn_with_kvcache(q, torch.randn(8, 1, 16), torch.randn(2, 8, 1, 16))
    with pytest.raises(ValueError, match="block_table"):
        FA.flash_attn_with_kvcache(q, torch.randn(4, 16, 1, 16), torch.randn(4, 16, 1, 16),
                                   block_table=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
