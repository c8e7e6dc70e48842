"""Triton backward kernels against the oracle's exact gradients. Without CUDA they run through Triton's interpreter
(fp32 and fp16); with CUDA on the GPU, plus bf16."""

import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn.ops import backward as B
from onlineattn.ops import forward as F
from onlineattn.ops._configs import BwdConfig, BwdTile, bwd_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _case(b, sq, sk, hq, hkv, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, dv), make(b, sq, hq, dv)


def _baseline_grads(q, k, v, do, causal, dlse=None, scale=None, window=(-1, -1)):
    """Autograd of textbook attention in the inputs' own dtype: the error rule's baseline."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = R.torch_math_attention(*leaves, causal=causal, softmax_scale=scale, window_size=window)
    loss = (o * do).sum()
    if dlse is not None:
        loss = loss + (lse.float().masked_fill(torch.isinf(lse), 0.0) * dlse).sum()
    loss.backward()
    return [x.grad for x in leaves]


SHAPES = [  # b, sq, sk, hq, hkv, d, dv
    (1, 1, 1, 2, 2, 32, 32),
    (2, 17, 17, 4, 1, 40, 40),
    (1, 129, 17, 4, 4, 64, 64),  # Sq > Sk: causal leaves the first rows with no key
    (1, 17, 129, 8, 2, 96, 96),
    (1, 33, 47, 2, 2, 256, 256),
    (1, 31, 45, 4, 2, 72, 40),
    (1, 20, 26, 6, 2, 32, 32),  # group of 3: row tiles split groups unevenly
    (1, 9, 50, 8, 1, 16, 16),  # MQA 8:1
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_oracle(shape, causal, dtype):
    q, k, v, do = _case(*shape, dtype, seed=sum(shape) + causal)
    o, lse = F.forward(q, k, v, shape[5] ** -0.5, causal)
    dq, dk, dv = B.backward(do, q, k, v, o, lse, shape[5] ** -0.5, causal)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    base = _baseline_grads(q, k, v, do, causal)
    for name, got, want, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, base):
        assert got.dtype == dtype and got.shape == ref.shape
        R.assert_within_rule(name, got, want, ref, _name(dtype))


def test_gradient_through_lse_and_non_contiguous_do():
    q, k, v, _ = _case(1, 23, 37, 4, 2, 64, 64, torch.float32, seed=11)
    do = torch.randn(1, 4, 23, 64, device=DEVICE).transpose(1, 2)  # [B, Sq, H, Dv] view, not contiguous
    dlse = torch.randn(1, 4, 23, device=DEVICE)
    o, lse = F.forward(q, k, v, 0.125, True)
    dq, dk, dv = B.backward(do, q, k, v, o, lse, 0.125, True, dlse=dlse)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, lse64 = R.torch_math_attention(*leaves, causal=True, softmax_scale=0.125)
    ((o64 * do.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), (x.grad for x in leaves)):
        R.assert_within_rule(name, got, want, dtype_name="float32")


def test_backward_is_bitwise_deterministic():
    q, k, v, do = _case(2, 45, 70, 8, 2, 64, 64, torch.float16, seed=12)
    o, lse = F.forward(q, k, v, 0.125, True)
    first = B.backward(do, q, k, v, o, lse, 0.125, True)
    for _ in range(3):
        again = B.backward(do, q, k, v, o, lse, 0.125, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2), (6, 2)], ids=["mha", "gqa2", "gqa4", "gqa3-pointer-fallback"])
def test_copy_engine_path_matches_oracle(hq, hkv):
    """Q/dO (dK/dV kernel) and K/V (dQ kernel) through tensor descriptors, which the interpreter emulates."""
    tma = BwdConfig(BwdTile(32, 32, 4, 1, tma=True), BwdTile(32, 32, 4, 1, tma=True))
    _check_config(_case(2, 37, 51, hq, hkv, 40, 24, torch.float16, seed=hq), True, tma)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "copy-engine"])
def test_split_score_tiles_match_oracle(causal, tma):
    """The dK/dV kernel with SPLIT_SCORES (its score products behind an always-taken branch; the d = 256 table entry
    on the GPU): odd lengths, Sq > Sk (causal rows with no key) and GQA."""
    split = BwdConfig(BwdTile(32, 32, 4, 1, tma=tma, split_scores=True), BwdTile(32, 32, 4, 1))
    _check_config(_case(2, 45, 33, 8, 2, 40, 24, torch.float16, seed=20 + causal), causal, split)


def test_split_scores_on_the_dq_tile_is_refused():
    q, k, v, do = _case(1, 9, 13, 4, 2, 40, 24, torch.float16, seed=21)
    o, lse = F.forward(q, k, v, 0.2, True)
    bad = BwdConfig(BwdTile(32, 32, 4, 1), BwdTile(32, 32, 4, 1, split_scores=True))
    with pytest.raises(ValueError, match="config"):
        B.backward(do, q, k, v, o, lse, 0.2, True, config=bad)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_keeps_two_stage_descriptor_tiles_causal(d, dtype):
    """ptxas (Triton 3.6) crashes with exit -11 on non-causal backward kernels that load through tensor descriptors
    with 2 stages (_configs.py); only causal launches may take such a tile (d = 128 dK/dV, measured faster there)."""
    for causal in (False, True):
        config = bwd_config(d, d, dtype, "cuda", causal=causal)
        risky = [t for t in (config.dkdv, config.dq) if t.tma and t.num_stages == 2]
        assert causal or not risky, (d, config)
    assert bwd_config(128, 128, dtype, "cuda", causal=True).dkdv.tma


def _check_config(inputs, causal, config, scale=0.2):
    """float16 gradients with a given tile config against the oracle, under the rule."""
    q, k, v, do = inputs
    o, lse = F.forward(q, k, v, scale, causal)
    grads = B.backward(do, q, k, v, o, lse, scale, causal, config=config)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal, softmax_scale=scale)
    base = _baseline_grads(q, k, v, do, causal, scale=scale)
    for name, got, want, ref in zip(("dq", "dk", "dv"), grads, exact, base):
        R.assert_within_rule(name, got, want, ref, "float16")


def test_causal_head_groups_rule():
    """Causal launches interleave equal groups of at most BWD_CAUSAL_HEAD_GROUP (batch, kv head) columns; a few
    columns (a long sequence's), and non-causal launches, go head after head."""
    from onlineattn.ops._configs import BWD_CAUSAL_HEAD_GROUP as G, bwd_head_group

    assert G == 8
    assert [bwd_head_group(h, True) for h in (1, 2, 8, 9, 16, 17, 24, 25, 256)] == [1, 1, 1, 5, 8, 6, 8, 7, 8]
    assert all(bwd_head_group(h, False) == 1 for h in (1, 9, 256))


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("n", [37] + ([530] if DEVICE == "cuda" else []))
def test_causal_head_groups_cover_every_program(monkeypatch, group, n):
    """The grouped launch order (at most 2 or 3 of 5 batch x kv-head columns a group: groups of 2, 2, 1 and 3, 2)
    gives each program one distinct tile in the dK/dV and dQ kernels (on the GPU at 530 keys, the Hopper dK/dV
    kernel's): the same bits as head after head, and within the rule."""
    from onlineattn.ops import _configs

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q, k, v, do = _case(5, n, n, 2, 1, 64, 64, dtype, seed=n + group)
    o, lse = F.forward(q, k, v, 0.125, True)
    monkeypatch.setattr(B.launch_cache, "enabled", False)  # a kept launch would repeat the first call's group
    taken = []  # (kernel, group) of each launch: the Triton kernels take it by name, sm_90's dK/dV kernel last
    start = B.start

    def recorded(keep, kernel, grid, n_arrays, *args, **kwargs):
        taken.append((getattr(kernel, "fn", kernel).__name__, kwargs.get("head_group")))
        return start(keep, kernel, grid, n_arrays, *args, **kwargs)

    monkeypatch.setattr(B, "start", recorded)
    if B.backward_sm90 is not None:
        sm90_start = B.backward_sm90.start
        monkeypatch.setattr(B.backward_sm90, "start", lambda keep, kernel, grid, n, *a, **kw: taken.append(
            ("sm90_dkdv", a[-2])) or sm90_start(keep, kernel, grid, n, *a, **kw))
    monkeypatch.setattr(_configs, "BWD_CAUSAL_HEAD_GROUP", 1)
    plain = B.backward(do, q, k, v, o, lse, 0.125, True)
    monkeypatch.setattr(_configs, "BWD_CAUSAL_HEAD_GROUP", group)
    grads = B.backward(do, q, k, v, o, lse, 0.125, True)
    groups = [g for _, g in taken if g is not None]  # not the delta pass or dQ's scaling pass
    assert len(groups) == 4 and groups == [1, 1, group, group], taken
    exact = R.naive_attention_backward(q, k, v, do, causal=True, softmax_scale=0.125)
    base = _baseline_grads(q, k, v, do, True, scale=0.125)
    for name, got, same, want, ref in zip(("dq", "dk", "dv"), grads, plain, exact, base):
        assert torch.equal(got, same), name
        R.assert_within_rule(name, got, want, ref, _name(dtype))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_delta_pass_matches_torch(with_dlse):
    """The preprocess kernel (delta before a dK/dV kernel that fuses dQ, where no dQ kernel computes it):
    rowsum(dO ∘ O) − dlse per row in float32, the head dim padded (40 -> 64) adding nothing."""
    o, _, _, do = _case(2, 19, 5, 3, 3, 40, 40, torch.float16, seed=40 + with_dlse)
    dlse = torch.randn(2, 3, 19, device=DEVICE) if with_dlse else None
    delta = torch.full((2, 3, 19), float("nan"), device=DEVICE)
    B._preprocess(o, do, torch.zeros(2, 3, 19, device=DEVICE), dlse, delta)
    want = (do.float() * o.float()).sum(-1).transpose(1, 2) - (0 if dlse is None else dlse)
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [0, 64, 128])
def test_delta_pass_zeroes_what_a_fused_dq_needs(tile):
    """Beside delta, the preprocess kernel zeroes a fused dQ's scratch (``_Zero``): every row of the float32
    accumulator (``[B, rows, Hq, D]``, the padding rows past Sq too: the kernel orders each row tile's memory its
    own way), or the int32 counters of every ``tile``-row tile (``[B, Hq, tiles]``), and nothing else."""
    o, _, _, do = _case(2, 150, 5, 3, 3, 40, 40, torch.float16, seed=43)
    delta = torch.empty(2, 3, 150, device=DEVICE)
    if tile:
        tiles = -(-150 // tile)
        memory = torch.full((2 * 3 * tiles + 1,), 7, dtype=torch.int32, device=DEVICE)
        B._preprocess(o, do, torch.zeros_like(delta), None, delta, B._Zero(memory[:-1], tiles, False, tile))
        assert not memory[:-1].any() and memory[-1] == 7
    else:
        memory = torch.full((2 * 192 * 3 * 40 + 1,), float("nan"), device=DEVICE)
        B._preprocess(o, do, torch.zeros_like(delta), None, delta, B._Zero(memory[:-1].view(2, 192, 3, 40), 192, True,
                                                                           0))
        assert not memory[:-1].any() and memory[-1].isnan()
    torch.testing.assert_close(delta, (do.float() * o.float()).sum(-1).transpose(1, 2), rtol=1e-5, atol=1e-5)


def _nan_scratch(make, *args):
    """``make(*args)`` (backward's ``_dq_accumulator``) with every ``torch.empty`` it calls filled with NaN, as
    memory fresh from the allocator may be: whatever it leaves unzeroed shows."""
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    try:
        return make(*args)
    finally:
        torch.empty = empty


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_dq_scratch_is_zeroed_before_the_kernel(d, ordered, causal):
    """What ``_dq_accumulator`` returns (from NaN-filled memory) once the delta pass has run with its ``_Zero``:
    the ordered tile's counters all zero, and its accumulator zero only in the rows no key block sees (causal,
    Sq - Sk = 150: one 128-row or two 64-row tiles) since its first adds store; the unordered tile's accumulator
    zero, its padding rows too. d = 64 runs 128-row tiles, d = 128 64-row ones."""
    from onlineattn.ops._configs import fused_dq_tile

    tile = fused_dq_tile(d, ordered, causal=causal)
    o, _, _, do = _case(2, 300, 150, 3, 3, d, d, torch.float16, seed=44)
    acc, sem, zero = _nan_scratch(B._dq_accumulator, torch.empty_like(o), tile, causal, 150)
    delta = torch.empty(2, 3, 300, device=DEVICE)
    B._preprocess(o, do, torch.zeros_like(delta), None, delta, zero)
    zeroed = (150 // tile.block_m * tile.block_m if causal else 0) if ordered else acc.shape[1]
    assert not acc[:, :zeroed].any() and acc[:, zeroed:].isnan().all()
    assert (sem is not None) == ordered and (sem is None or not sem.any())


def test_backward_op_schema_and_fake():
    q, k, v, do = _case(1, 9, 13, 4, 2, 40, 24, torch.float16, seed=15)
    o, lse = F.forward(q, k, v, 0.25, True)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(
            torch.ops.onlineattn.attention_bwd, (do, q, k, v, o, lse, dlse, 0.25, True),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_empty_keys_give_zero_gradients():
    q, k, v, do = _case(1, 5, 0, 2, 1, 16, 16, torch.float32, seed=13)
    o, lse = F.forward(q, k, v, 0.25, False)
    dq, dk, dv = B.backward(do, q, k, v, o, lse, 0.25, False)
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16 at scale and determinism over many runs.

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d", [(2, 4096, 4096, 8, 2, 128), (1, 2048, 2048, 4, 4, 256), (1, 3000, 5000, 6, 3, 80)]
)
def test_large_shapes_bf16(b, sq, sk, hq, hkv, d, causal):
    q, k, v, do = _case(b, sq, sk, hq, hkv, d, d, torch.bfloat16, seed=sq + d)
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    grads = B.backward(do, q, k, v, o, lse, d**-0.5, causal)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    (R.torch_math_attention(*leaves, causal=causal)[0] * do.double()).sum().backward()
    base = _baseline_grads(q, k, v, do, causal)
    for name, got, leaf, ref in zip(("dq", "dk", "dv"), grads, leaves, base):
        R.assert_within_rule(name, got, leaf.grad, ref, "bfloat16")


@gpu
def test_backward_is_bitwise_deterministic_over_100_runs():
    q, k, v, do = _case(2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, seed=14)
    o, lse = F.forward(q, k, v, 128**-0.5, True)
    first = B.backward(do, q, k, v, o, lse, 128**-0.5, True)
    for _ in range(100):
        again = B.backward(do, q, k, v, o, lse, 128**-0.5, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
def test_custom_ops_pass_opcheck_on_gpu():
    q, k, v, do = _case(2, 70, 90, 8, 2, 64, 64, torch.bfloat16, seed=16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.onlineattn.attention_fwd, (q, k, v, 0.125, True))
    q, k, v = (x.detach() for x in (q, k, v))  # the backward op itself is not differentiable
    o, lse = F.forward(q, k, v, 0.125, True)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.onlineattn.attention_bwd, (do, q, k, v, o, lse, dlse, 0.125, True))


@gpu
def test_compiled_training_step_has_no_graph_break():
    q, k, v, do = _case(2, 300, 300, 8, 2, 128, 128, torch.bfloat16, seed=17)

    def step(q, k, v):
        o, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True)
        return (o.float() * do.float()).sum() + lse.sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(step, fullgraph=True)(*leaves).backward()  # fullgraph=True raises on any graph break
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    step(*eager).backward()
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad), "compiled and eager runs of the same kernels differ"


@gpu
def test_training_memory_stays_linear():
    """fwd+bwd at B = 1, H = 16, N = 131072, d = 128, causal, bf16 within 1.15 x (inputs + outputs + gradients)."""
    b, n, h, d = 1, 131072, 16, 128
    q, k, v, do = _case(b, n, n, h, h, d, d, torch.bfloat16, seed=18)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    tensor_bytes = q.numel() * q.element_size()
    budget = 8 * tensor_bytes + b * h * n * 4  # q k v o do dq dk dv, + lse
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() - 4 * tensor_bytes  # q, k, v and do are already there
    onlineattn.attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1.15 * budget, f"peak {peak / 2**20:.0f} MiB vs budget {budget / 2**20:.0f} MiB"


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [8, 40, 72, 80, 96, 112, 160, 192])
def test_every_head_dim_bf16(d, causal):
    """Each padded head dim compiles its own tile from the table: every one must build and pass the rule."""
    q, k, v, do = _case(2, 300, 513, 4, 2, d, d, torch.bfloat16, seed=d)
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    grads = B.backward(do, q, k, v, o, lse, d**-0.5, causal)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    base = _baseline_grads(q, k, v, do, causal)
    for name, got, want, ref in zip(("dq", "dk", "dv"), grads, exact, base):
        R.assert_within_rule(name, got, want, ref, "bfloat16")


def _in_register_order(acc, block_m: int):
    """``acc [B, rows, Hq, D]`` laid out as the fused dQ kernel adds it (``backward_sm90_dq._dq_coord``, written out
    here independently of the kernels): per (batch, row tile, head) two parts of 64 rows by ``C`` columns (the tile's
    row halves on 128-row tiles, else its column halves), each in wgmma's register order ([warp, column group of 8,
    lane // 4, lane % 4, row half, column pair] of rows ``16 warp + 8 half + lane // 4`` and columns
    ``8 group + 2 (lane % 4) + pair``), in rows of 128 values; a row tile's memory holds those rows head after head
    in each row."""
    b, rows, hq, d = acc.shape
    tiles, c = rows // block_m, block_m * d // 128
    x = acc.reshape(b, tiles, block_m, hq, d).permute(0, 1, 3, 2, 4)
    parts = x.reshape(b, tiles, hq, 2, 64, d) if block_m == 128 else x.reshape(
        b, tiles, hq, 64, 2, c).permute(0, 1, 2, 4, 3, 5)
    parts = parts.reshape(b, tiles, hq, 2, 4, 2, 8, c // 8, 4, 2).permute(0, 1, 2, 3, 4, 7, 6, 8, 5, 9)
    return parts.reshape(b, tiles, hq, c, 128).permute(0, 1, 3, 2, 4).contiguous().view(b, rows, hq, d)


@pytest.mark.parametrize("d, block_m", [(64, 128), (64, 64), (128, 64)])
def test_fused_dq_scaling_pass(d, block_m):
    """The pass after a fused dQ: the float32 sum (rows padded to whole tiles, each tile in the kernel's register
    order) put back in place times the scale, rounded once into dQ's dtype and strides (a strided view here), as
    torch rounds it; rows past Sq are padding and never stored."""
    g = torch.Generator().manual_seed(d + block_m)
    acc = torch.randn(2, 2 * block_m, 3, d, generator=g).to(DEVICE)
    for dtype in (torch.float16, torch.float32) + ((torch.bfloat16,) if DEVICE == "cuda" else ()):
        wide = torch.full((2, block_m + 50, 3, 2 * d), float("nan"), device=DEVICE, dtype=dtype)
        dq = wide[..., d:]
        B._scale_dq(_in_register_order(acc, block_m), 0.3, dq, block_m)
        assert torch.equal(dq, (acc[:, :block_m + 50] * 0.3).to(dtype)) and wide[..., :d].isnan().all()
