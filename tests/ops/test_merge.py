"""Triton merge kernels (``ops/merge.py``) against the oracle, and the acceptance check of issue #5: attention over
chunks of random sizes (empty ones included), merged, equals attention over all keys. Without CUDA the kernels run
through Triton's interpreter on CPU tensors (fp32 and fp16); bf16 and large shapes are GPU tests."""

import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn.ops import merge as M

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
gpu = pytest.mark.gpu


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _states(shape, dtype, *, seed, empty_fraction=0.2, device=DEVICE):
    """Random partial states ``o [*shape]`` and ``lse [*shape[:-3], H, Sq]`` with about ``empty_fraction`` of the
    lse entries -inf; the o of every empty entry is NaN, which a merge must ignore."""
    g = torch.Generator().manual_seed(seed)
    *lead, sq, h, dv = shape
    o = torch.randn(shape, generator=g)
    lse = torch.randn((*lead, h, sq), generator=g) * 4
    empty = torch.rand(lse.shape, generator=g) < empty_fraction
    lse[empty] = float("-inf")
    o.masked_fill_(empty.transpose(-1, -2)[..., None], float("nan"))
    return o.to(device=device, dtype=dtype), lse.to(device)


def _poisoned(b, sq, h, dv, dtype, device=DEVICE):
    o = torch.full((b, sq, h, dv), float("nan"), dtype=dtype, device=device)
    return o, torch.full((b, h, sq), float("nan"), dtype=torch.float32, device=device)


def _check_merge(o, lse, exact_o, exact_lse, dtype):
    """The merge itself computes in float32, so its only half-precision error is the final rounding of o."""
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    R.assert_within_rule("lse", lse, exact_lse, dtype_name="float32")
    if dtype == torch.float32:
        R.assert_within_rule("o", o, exact_o, dtype_name="float32")
    else:  # one rounding of the exact result to the output dtype is the baseline
        R.assert_within_rule("o", o, exact_o, torch.as_tensor(exact_o).to(dtype), _name(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(2, 1, 32, 128), (3, 17, 5, 40), (1, 70, 3, 8)], ids=str)
def test_merge_states_matches_oracle(shape, dtype):
    (o_a, o_b), (lse_a, lse_b) = zip(*(_states(shape, dtype, seed=s + sum(shape)) for s in (0, 1)))
    lse_a[..., 0], lse_b[..., 0] = float("-inf"), float("-inf")  # query 0: both parts empty
    o, lse = M.merge_states(o_a, lse_a, o_b, lse_b, out=_poisoned(*shape, dtype)[0], lse_out=_poisoned(*shape, dtype)[1])
    exact_o, exact_lse = R.merge_states(o_a, lse_a, o_b, lse_b)
    _check_merge(o, lse, exact_o, exact_lse, dtype)
    assert torch.all(o[:, 0] == 0) and torch.all(lse[..., 0] == float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("splits", [1, 2, 7])
@pytest.mark.parametrize("shape", [(2, 1, 32, 128), (1, 9, 6, 72)], ids=str)
def test_merge_states_list_matches_oracle(shape, splits, dtype):
    os, lses = _states((splits, *shape), dtype, seed=splits + sum(shape), empty_fraction=0.4)
    os = os.transpose(0, 1).contiguous().transpose(0, 1)  # the split dim is not outermost in memory
    lses = lses.transpose(-1, -2).contiguous().transpose(-1, -2)  # lse's last dim is strided
    o, lse = M.merge_states_list(os, lses, out=_poisoned(*shape, dtype)[0], lse_out=_poisoned(*shape, dtype)[1])
    exact_o, exact_lse = R.merge_states_list(os, lses)
    _check_merge(o, lse, exact_o, exact_lse, dtype)


def test_list_merge_writes_the_out_dtype():
    """Split-KV decoding merges float32 partials straight into q's dtype."""
    os, lses = _states((3, 2, 1, 4, 16), torch.float32, seed=5)
    out, lse_out = _poisoned(2, 1, 4, 16, torch.float16)
    o, lse = M.merge_states_list(os, lses, out=out, lse_out=lse_out)
    assert o is out and o.dtype == torch.float16
    exact_o, exact_lse = R.merge_states_list(os, lses)
    _check_merge(o, lse, exact_o, exact_lse, torch.float16)


def test_a_single_non_empty_part_comes_back_bitwise():
    os, lses = _states((4, 2, 3, 2, 24), torch.float32, seed=6, empty_fraction=0.0)
    lses[[0, 1, 3]] = float("-inf")
    o, lse = M.merge_states_list(os, lses)
    assert torch.equal(o, os[2]) and torch.equal(lse, lses[2])
    o, lse = M.merge_states(os[1], lses[1], os[2], lses[2])
    assert torch.equal(o, os[2]) and torch.equal(lse, lses[2])


@pytest.mark.parametrize(
    "backend,dtype", [("torch", torch.float64)] + [(b, d) for b in ("torch", "triton") for d in DTYPES],
    ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x,
)
def test_chunks_of_random_sizes_merge_to_full_attention(dtype, backend):
    """Issue #5's acceptance: attend to chunks of random sizes (some empty) separately, merge, compare with attention
    over all keys under the section 3 rule."""
    g = torch.Generator().manual_seed(7)
    b, sq, sk, hq, hkv, d, dv = 2, 5, 97, 4, 2, 40, 24
    q, k, v = (torch.randn(s, generator=g).to(DEVICE, dtype) for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv)))
    cuts = sorted(torch.randint(0, sk + 1, (5,), generator=g).tolist() + [0, 0, sk, sk])  # repeats: empty chunks
    parts = [onlineattn.attention(q, k[:, a:c], v[:, a:c], return_lse=True, backend=backend)
             for a, c in zip(cuts, cuts[1:])]
    assert any(torch.isneginf(lse).all() for _, lse in parts), "no empty chunk drawn"
    o, lse = onlineattn.merge_states_list(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), backend=backend
    )
    exact_o, exact_lse = R.naive_attention(q, k, v, return_lse=True)
    base_o, base_lse = R.torch_math_attention(q, k, v)
    R.assert_within_rule("o", o, exact_o, base_o, _name(dtype))
    R.assert_within_rule("lse", lse, exact_lse, base_lse, _name(dtype))


def test_public_merge_dispatches_to_the_kernel_when_asked():
    os, lses = _states((2, 1, 3, 2, 8), torch.float16, seed=8)
    kernel = onlineattn.merge_states(os[0], lses[0], os[1], lses[1], backend="triton")
    direct = M.merge_states(os[0], lses[0], os[1], lses[1])
    assert torch.equal(kernel[0], direct[0]) and torch.equal(kernel[1], direct[1])


def test_forced_kernel_refuses_states_that_need_gradients():
    os, lses = _states((2, 1, 3, 2, 8), torch.float32, seed=12)
    with pytest.raises(NotImplementedError, match="no backward"):
        onlineattn.merge_states_list(os.requires_grad_(), lses, backend="triton")
    with torch.no_grad():
        onlineattn.merge_states_list(os, lses, backend="triton")


def test_batches_beyond_the_grid_limit_launch_in_slices(monkeypatch):
    from onlineattn.ops import forward as F

    monkeypatch.setattr(F, "MAX_GRID_Y", 2)  # one launch per 2 batch entries: 3 launches for 5
    os, lses = _states((3, 5, 2, 3, 16), torch.float32, seed=9)
    o, lse = M.merge_states_list(os, lses, out=_poisoned(5, 2, 3, 16, torch.float32)[0],
                                 lse_out=_poisoned(5, 2, 3, 16, torch.float32)[1])
    _check_merge(o, lse, *R.merge_states_list(os, lses), torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16 and decoding-sized merges.


@gpu
@pytest.mark.parametrize("splits", [2, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_name)
def test_list_merge_at_decode_scale(splits, dtype):
    os, lses = _states((splits, 64, 1, 32, 128), torch.float32, seed=splits, device="cuda")
    out, lse_out = _poisoned(64, 1, 32, 128, dtype, device="cuda")
    o, lse = M.merge_states_list(os, lses, out=out, lse_out=lse_out)
    _check_merge(o, lse, *R.merge_states_list(os, lses), dtype)


@gpu
def test_auto_merge_keeps_gradients_on_cuda():
    """States that require grad take the differentiable torch path under backend='auto'."""
    q, k, v = (torch.randn(2, 9, 4, 32, device="cuda", requires_grad=True) for _ in range(3))
    o_a, lse_a = onlineattn.attention(q, k[:, :5], v[:, :5], return_lse=True)
    o_b, lse_b = onlineattn.attention(q, k[:, 5:], v[:, 5:], return_lse=True)
    o, lse = onlineattn.merge_states(o_a, lse_a, o_b, lse_b)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    exact = R.naive_attention_backward(q, k, v, do)
    for name, x, want in zip(("dq", "dk", "dv"), (q, k, v), exact):
        R.assert_within_rule(name, x.grad, want, dtype_name="float32")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_name)
def test_pairwise_merge_large_bf16(dtype):
    shape = (4, 4096, 16, 128)
    (o_a, o_b), (lse_a, lse_b) = zip(*(_states(shape, dtype, seed=s, device="cuda") for s in (10, 11)))
    o, lse = onlineattn.merge_states(o_a, lse_a, o_b, lse_b)
    _check_merge(o, lse, *R.merge_states(o_a, lse_a, o_b, lse_b), dtype)
