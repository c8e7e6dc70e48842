"""Triton forward kernel against the oracle. Without CUDA these run through Triton's interpreter on CPU tensors
(fp32 and fp16; the interpreter's bf16 dot is wrong); with CUDA they run on the GPU, plus bf16 and large shapes."""

from dataclasses import replace

import pytest
import torch

import onlineattn
from onlineattn import reference as R
from onlineattn._mods import Mods
from onlineattn.ops import forward as F
from onlineattn.ops._configs import FwdConfig, fwd_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
gpu = pytest.mark.gpu


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype, *, seed, q_scale=1.0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32)
    q = (make(b, sq, hq, d) * q_scale).to(device=device, dtype=dtype)
    k = make(b, sk, hkv, d).to(device=device, dtype=dtype)
    v = make(b, sk, hkv, dv).to(device=device, dtype=dtype)
    return q, k, v


def _run_poisoned(q, k, v, causal, scale=None, config=None, window=(-1, -1), sinks=None):
    """Launch into NaN-filled outputs, so an element the kernel never writes fails the comparison."""
    b, sq, hq, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.full((b, sq, hq, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    mods = Mods(window_left=window[0], window_right=window[1], sinks=sinks).canonical()
    return F.forward(q, k, v, scale, causal, out=o, lse_out=lse, config=config, mods=mods)


def _check(q, k, v, causal, o, lse, scale=None, window=(-1, -1), sinks=None):
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window,
                                           sinks=sinks, return_lse=True)
    base_o, base_lse = R.torch_math_attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window,
                                              sinks=sinks)
    R.assert_within_rule("o", o, exact_o, base_o, _name(q.dtype))
    R.assert_within_rule("lse", lse, exact_lse, base_lse, _name(q.dtype))


SHAPES = [  # b, sq, sk, hq, hkv, d, dv
    (2, 1, 1, 2, 2, 64, 64),
    (1, 17, 17, 4, 1, 40, 40),
    (2, 129, 17, 4, 4, 64, 64),  # Sq > Sk: with causal, the first rows see no key
    (1, 17, 129, 8, 2, 96, 96),  # Sk > Sq
    (1, 65, 100, 8, 1, 128, 128),  # MQA 8:1
    (1, 33, 47, 2, 2, 256, 256),
    (1, 31, 45, 4, 2, 72, 40),  # Dv != D, neither a power of two
    (1, 20, 24, 2, 1, 8, 8),
    (1, 20, 26, 6, 2, 32, 32),  # group of 3: row tiles split groups unevenly
]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_oracle(shape, causal, dtype):
    q, k, v = _inputs(*shape, dtype, seed=hash((shape, causal)) % 2**31)
    o, lse = _run_poisoned(q, k, v, causal)
    _check(q, k, v, causal, o, lse)


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    q, k, v = _inputs(1, 40, 8, 4, 2, 64, 64, torch.float16, seed=1)
    o, lse = _run_poisoned(q, k, v, causal=True)
    hidden = 40 - 8  # rows 0..31 see no key: j <= i + (8 - 40) < 0
    assert torch.all(o[:, :hidden] == 0)
    assert torch.all(lse[:, :, :hidden] == float("-inf"))
    assert torch.isfinite(lse[:, :, hidden:]).all()


def _empty_first_block_call(case, sq, sk, h, device, dtype):
    """A call in which some rows see no key in their first key block(s) and keys after: ``(kwargs, hidden rows)``."""
    if case == "left-padding bias":
        bias = torch.zeros(1, 1, sq, sk)
        bias[:, :, 0::2, :40] = float("-inf")  # a left-padding mask over the first key blocks of the even rows
        bias[:, :, 1, 10:50] = float("-inf")  # visible, hidden, visible
        bias[:, :, 3] = float("-inf")  # a row that sees nothing: o = 0, lse = -inf
        return dict(attn_bias=bias.to(device, dtype)), [3]
    if case == "window, sink -inf":
        return dict(window_size=(5, 0), sinks=torch.full((h,), float("-inf"), device=device)), []
    return dict(window_size={"window (0, 0)": (0, 0), "window (5, 0)": (5, 0), "window (3, 9)": (3, 9)}[case]), []


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=_name)
@pytest.mark.parametrize("level", [4.0, 1.5], ids=["scores -128", "scores -18"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain loop", "pipelined"])
@pytest.mark.parametrize("case", ["window (0, 0)", "window (5, 0)", "window (3, 9)", "left-padding bias",
                                  "window, sink -inf"])
def test_rows_past_an_empty_block_keep_their_true_max(case, pipeline, level, dtype):
    """A row whose first key block hides all its keys (a window's left edge with Sq < Sk, a left-padding bias)
    starts its running max at -inf, not 0. Held at 0, the max made p = 2^s rather than 2^(s - max): with every score
    near -18 (natural log) p flushed to 0 in the 16-bit P·V operand while l kept it (o = 0 with a finite lse), and
    near -128 p and l flushed in float32 (o = 0, lse = -inf). The row's one key under a (0, 0) window gives o = v
    bitwise (p = 2^0). Half precision only: float32's rule (1e-5 of max |o|) is finer than the rounding of scores
    of -128 (|s log2 e| ~ 2^7.5) for any kernel."""
    b, sq, sk, h, d = 1, 70, 100, 2, 64
    g = torch.Generator().manual_seed(3)
    q = (level + 0.1 * torch.randn(b, sq, h, d, generator=g)).to(DEVICE, dtype)
    k = (-level + 0.1 * torch.randn(b, sk, h, d, generator=g)).to(DEVICE, dtype)
    v = torch.randn(b, sk, h, d, generator=g).to(DEVICE, dtype)
    kw, hidden = _empty_first_block_call(case, sq, sk, h, DEVICE, dtype)
    causal = "window" in case
    window = kw.get("window_size", (-1, -1))
    mods = Mods(window_left=window[0], window_right=window[1], attn_bias=kw.get("attn_bias"), sinks=kw.get("sinks"))
    cfg = fwd_config(d, d, dtype, causal, DEVICE, seqlen_q=sq, seqlen_k=sk, variants=True, ws_ok=False)
    cfg = replace(cfg, block_n=32, pipeline=True) if pipeline else cfg
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    F.forward(q, k, v, d**-0.5, causal, out=o, lse_out=lse, config=cfg, mods=mods)
    seen = [i for i in range(sq) if i not in hidden]
    assert torch.isfinite(lse[:, :, seen]).all() and (o[:, seen].abs().amax(dim=-1) > 0).all()
    assert (lse[:, :, hidden] == float("-inf")).all() and (o[:, hidden] == 0).all()
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=causal, return_lse=True, **kw)
    base_o, base_lse = R.torch_math_attention(q, k, v, causal=causal, **kw)
    R.assert_within_rule("o", o, exact_o, base_o, _name(dtype))
    R.assert_within_rule("lse", lse, exact_lse, base_lse, _name(dtype))
    if window == (0, 0):
        assert torch.equal(o, v[:, sk - sq:])


def test_non_contiguous_inputs_and_explicit_scale():
    base_q, base_k, base_v = _inputs(2, 37, 53, 8, 4, 128, 128, torch.float16, seed=2)
    q = base_q[:, :, ::2, :64]  # every other head, first half of the head dim
    k = base_k[:, :, ::2, 32:96]
    v = base_v.transpose(1, 2).contiguous().transpose(1, 2)[:, :, ::2, :64]  # a [B, S, H, D] view of [B, H, S, D]
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    o, lse = _run_poisoned(q, k, v, causal=True, scale=0.3)
    _check(q, k, v, True, o, lse, scale=0.3)


def test_last_dim_not_contiguous_is_copied():
    q, k, v = _inputs(1, 16, 16, 2, 2, 32, 32, torch.float32, seed=3)
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qt.stride(-1) != 1
    o, lse = _run_poisoned(qt, kt, v, causal=False)
    _check(q, k, v, False, o, lse)


def test_logits_near_fp16_overflow():
    q, k, v = _inputs(1, 33, 65, 4, 2, 64, 64, torch.float16, seed=4, q_scale=60.0)
    o, lse = _run_poisoned(q, k, v, causal=True)
    _check(q, k, v, True, o, lse)


def test_public_api_uses_kernel_and_differentiates():
    q, k, v = _inputs(1, 24, 40, 4, 2, 32, 32, torch.float32, seed=5)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = onlineattn.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    do = torch.randn_like(o)
    (o * do).sum().backward()
    exact = R.naive_attention_backward(q, k, v, do, causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), exact):
        R.assert_within_rule(name, got, want, dtype_name="float32")


def test_triton_backend_rejects_float64():
    q = torch.randn(1, 4, 2, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        onlineattn.attention(q, q, q, backend="triton")


def test_fake_impl_matches_real_shapes():
    q, k, v = _inputs(2, 9, 13, 4, 2, 40, 24, torch.float16, seed=6)
    torch.library.opcheck(torch.ops.onlineattn.attention_fwd, (q, k, v, 0.25, True), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------------------
# GPU only: bf16 at scale, long sequences, memory.


def _check_rows(q, k, v, causal, o, lse, rows: slice, scale=None):
    """Check query rows ``rows`` against float64 math on the GPU. For bottom-right causal, rows [a, c) equal attention
    of q[a:c] over the first ``c + Sk - Sq`` keys, so long sequences are checked without an N×N float64 matrix."""
    sq, sk = q.shape[1], k.shape[1]
    stop_k = min(sk, rows.stop + sk - sq) if causal else sk
    qs, ks, vs = q[:, rows], k[:, :stop_k], v[:, :stop_k]
    exact_o, exact_lse = R.torch_math_attention(qs.double(), ks.double(), vs.double(), causal=causal,
                                                softmax_scale=scale)
    base_o, base_lse = R.torch_math_attention(qs, ks, vs, causal=causal, softmax_scale=scale)
    R.assert_within_rule("o", o[:, rows], exact_o, base_o, _name(q.dtype))
    R.assert_within_rule("lse", lse[:, :, rows], exact_lse, base_lse, _name(q.dtype))


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "b,n,hq,hkv,d",
    [(4, 16384, 2, 2, 256), (4, 16384, 4, 4, 128), (2, 8192, 8, 8, 64), (1, 32768, 32, 8, 128), (3, 4099, 6, 2, 160)],
)
def test_large_shapes_bf16(b, n, hq, hkv, d, causal):
    q, k, v = _inputs(b, n, n, hq, hkv, d, d, torch.bfloat16, seed=n + d, device="cuda")
    o, lse = _run_poisoned(q, k, v, causal)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten elements"
    for rows in (slice(0, 256), slice(n // 2 - 128, n // 2 + 128), slice(n - 256, n)):
        _check_rows(q, k, v, causal, o, lse, rows)


@gpu
@pytest.mark.parametrize("d", [8, 40, 72, 80, 96, 112, 160, 192])
def test_every_head_dim_bf16(d):
    q, k, v = _inputs(2, 300, 513, 4, 2, d, d, torch.bfloat16, seed=d, device="cuda")
    o, lse = _run_poisoned(q, k, v, causal=True)
    _check(q, k, v, True, o, lse)


@gpu
def test_forward_memory_is_linear():
    b, n, h, d = 1, 65536, 16, 128
    q, k, v = _inputs(b, n, n, h, h, d, d, torch.bfloat16, seed=7, device="cuda")
    budget = 4 * q.numel() * q.element_size() + b * h * n * 4  # q + k + v + o, + lse
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    onlineattn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak < 1.1 * budget, f"peak {peak / 2**20:.0f} MiB vs budget {budget / 2**20:.0f} MiB"


def test_inference_and_autograd_paths_agree_bitwise():
    q, k, v = _inputs(1, 33, 40, 4, 2, 64, 64, torch.float16, seed=8)
    with torch.no_grad():
        direct = onlineattn.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    through_op = onlineattn.attention(
        q.requires_grad_(), k, v, causal=True, return_lse=True, backend="triton"
    )
    assert torch.equal(direct[0], through_op[0]) and torch.equal(direct[1], through_op[1])


def test_eager_training_skips_the_custom_ops_and_matches_them(monkeypatch):
    """A plain eager call that needs a graph runs the kernels under an autograd.Function, not through the custom ops
    (whose dispatch costs more host time than the launches); its outputs and gradients equal the op path's bitwise."""
    q, k, v = _inputs(1, 33, 40, 4, 2, 64, 64, torch.float16, seed=10)
    do = torch.randn(1, 33, 4, 64, dtype=torch.float16, device=DEVICE)
    through_op = [x.clone().requires_grad_() for x in (q, k, v)]
    o_op, lse_op = torch.ops.onlineattn.attention_fwd(*through_op, 0.125, True)
    o_op.backward(do)

    def refuse(*args, **kwargs):
        raise AssertionError("the custom op was called")

    monkeypatch.setattr(F, "attention_fwd", refuse)
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = onlineattn.attention(*eager, causal=True, softmax_scale=0.125, return_lse=True, backend="triton")
    o.backward(do)
    assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
    for a, b in zip(eager, through_op):
        assert torch.equal(a.grad, b.grad)


def test_eager_training_refuses_double_backward():
    q, k, v = (x.requires_grad_() for x in _inputs(1, 9, 9, 2, 2, 16, 16, torch.float32, seed=11))
    o = onlineattn.attention(q, k, v, causal=True, backend="triton")
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises((NotImplementedError, RuntimeError), match="double backward|does not require grad"):
        torch.autograd.grad(dq.sum(), q)


def test_vmap_runs_through_the_op():
    """Under torch.func.vmap the tensors have no storage of their own: the call goes through the custom op (whose
    batching falls back to a loop) rather than to the launcher, and equals attention per example."""
    q, k, v = (torch.stack([x] * 2) for x in _inputs(1, 9, 11, 2, 2, 16, 16, torch.float32, seed=12))
    q = q * torch.tensor([1.0, -0.5], device=DEVICE)[:, None, None, None, None]
    out = torch.func.vmap(lambda a, b, c: onlineattn.attention(a, b, c, causal=True, backend="triton"))(q, k, v)
    for i in range(2):
        assert torch.equal(out[i], onlineattn.attention(q[i], k[i], v[i], causal=True, backend="triton"))


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_kernel_bf16(causal):
    """The public API's gradients on CUDA: the forward custom op's autograd formula runs the Triton backward."""
    q, k, v = _inputs(2, 300, 513, 8, 2, 128, 128, torch.bfloat16, seed=9, device="cuda")
    do = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    onlineattn.attention(*ours, causal=causal).backward(do)
    base = [x.clone().requires_grad_() for x in (q, k, v)]
    R.torch_math_attention(*base, causal=causal)[0].backward(do)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    for name, got, want, ref in zip(("dq", "dk", "dv"), ours, exact, base):
        R.assert_within_rule(name, got.grad, want, ref.grad, "bfloat16")


def test_batches_beyond_the_grid_limit_launch_in_slices(monkeypatch):
    """CUDA allows 65535 program columns; with a small stand-in limit the batch is split over several launches."""
    monkeypatch.setattr(F, "MAX_GRID_Y", 4)  # 2 kv heads -> 2 batch entries per launch, 3 launches for 5
    q, k, v = _inputs(5, 19, 23, 4, 2, 32, 32, torch.float16, seed=10)
    o, lse = _run_poisoned(q, k, v, causal=True)
    _check(q, k, v, True, o, lse)


@pytest.mark.parametrize("heads_per_group", [2, 3, 8])
def test_longest_first_order_covers_every_tile(heads_per_group):
    """Grouped longest-first orders (5 batch x kv-head columns: groups of 2 and 3 leave a short last group, 8 is
    larger than the grid) still give each program one distinct tile: every element is written and right."""
    q, k, v = _inputs(5, 70, 75, 2, 1, 32, 32, torch.float16, seed=13)
    cfg = fwd_config(32, 32, q.dtype, True, q.device.type)
    cfg = FwdConfig(32, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma, heads_per_group=heads_per_group)
    o = torch.full((5, 70, 2, 32), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((5, 2, 70), float("nan"), dtype=torch.float32, device=q.device)
    F.forward(q, k, v, 32**-0.5, True, out=o, lse_out=lse, config=cfg)
    _check(q, k, v, True, o, lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[2:], ids=lambda s: "x".join(map(str, s)))
def test_pipelined_key_loop_matches_oracle(shape, causal):
    """The software-pipelined unmasked loop (softmax of block j beside P·V of block j-1): same rule as the plain
    loop, on shapes with zero, one and several unmasked key blocks per tile (32-key blocks)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q, k, v = _inputs(*shape, dtype, seed=sum(shape))
    cfg = fwd_config(shape[5], shape[6], dtype, causal, q.device.type)
    o, lse = _run_poisoned(q, k, v, causal, config=replace(cfg, block_n=32, pipeline=True))
    _check(q, k, v, causal, o, lse)


def test_long_plain_launches_take_the_pipelined_loops():
    """The table's choice (ops/_configs.py): d = 128 and 256 from PIPELINE_MIN_KEYS keys on, plain launches only."""
    from onlineattn.ops._configs import PIPELINE_MIN_KEYS

    pick = lambda d, sk, **kw: fwd_config(d, d, torch.bfloat16, True, "cuda", seqlen_q=sk, seqlen_k=sk, **kw)
    assert pick(128, PIPELINE_MIN_KEYS).pipeline and pick(256, 4 * PIPELINE_MIN_KEYS).pipeline
    assert pick(128, PIPELINE_MIN_KEYS).heads_per_group == 4  # otherwise the causal d = 128 tile
    assert not pick(128, PIPELINE_MIN_KEYS - 1).pipeline and not pick(64, PIPELINE_MIN_KEYS).pipeline
    assert not pick(128, PIPELINE_MIN_KEYS, variants=True).pipeline and not pick(128, None).pipeline
    assert not fwd_config(128, 128, torch.float32, True, "cuda", seqlen_k=PIPELINE_MIN_KEYS).pipeline


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_pipelined_key_loop_large_bf16(d, causal):
    q, k, v = _inputs(2, 2053, 2053, 4, 2, d, d, torch.bfloat16, seed=d, device="cuda")
    cfg = fwd_config(d, d, torch.bfloat16, causal, "cuda")
    o, lse = _run_poisoned(q, k, v, causal, config=replace(cfg, pipeline=True))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "unwritten elements"
    for rows in (slice(0, 256), slice(1000, 1256), slice(2053 - 256, 2053)):
        _check_rows(q, k, v, causal, o, lse, rows)


def test_offsets_beyond_int32_are_refused_before_launch():
    n = 2**22 + 1  # one row past 2^31 elements in one batch entry
    q = torch.empty(1, n, 8, 64, dtype=torch.float16, device="meta")
    o = torch.empty_like(q)
    lse = torch.empty(1, 8, n, device="meta")
    with pytest.raises(ValueError, match="int32"):
        F.forward(q, q[:, :8], q[:, :8], 0.125, False, out=o, lse_out=lse)


def test_no_keys_gives_empty_rows():
    """Sk = 0 (an empty chunk of a split): every row is empty, and no zero-sized tensor descriptor is built."""
    q, k, v = _inputs(2, 5, 0, 4, 2, 64, 64, torch.float16, seed=12)
    o, lse = _run_poisoned(q, k, v, causal=False)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
