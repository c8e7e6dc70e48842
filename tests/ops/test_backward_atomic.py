"""The atomic-dQ backward (``deterministic=False``; ``BwdConfig.atomic_dq``: the dK/dV kernel adds each row tile's
dS·K into a zeroed float32 dQ with atomics, then one scale-and-cast) against the oracle's gradients, and the plumbing
of ``deterministic`` from the public API down to the launch. Without CUDA the kernels run in Triton's interpreter
(fp32 and fp16), one program at a time, so the atomics there are plain adds in launch order."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import onlineattn
from onlineattn import api
from onlineattn import reference as R
from onlineattn._mods import PLAIN, Mods
from onlineattn.ops import _configs as C
from onlineattn.ops import backward as B
from onlineattn.ops import forward as F
from onlineattn.ops._configs import BwdConfig, BwdTile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
_UNUSED = BwdTile(32, 32, 4, 1)  # the dQ kernel's tile: the atomic path launches no dQ kernel
# Row tiles smaller and larger than key blocks: each row tile takes adds from several key blocks either way.
TILES = {"16x32": BwdTile(16, 32, 4, 1), "32x16": BwdTile(32, 16, 4, 1)}
# A head dim whose table entry is atomic with deterministic=False: any in the interpreter, 256 on CUDA.
D_ATOMIC = 256 if DEVICE == "cuda" else 32


def _atomic(tile: BwdTile) -> BwdConfig:
    return BwdConfig(tile, _UNUSED, atomic_dq=True)


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _case(b, sq, sk, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, d), make(b, sq, hq, d)


def _check(shape, causal, dtype, cfg, seed):
    b, sq, sk, hq, hkv, d = shape
    q, k, v, do = _case(*shape, dtype, seed)
    o, lse = F.forward(q, k, v, d**-0.5, causal)
    poisoned = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    grads = B.backward(do, q, k, v, o, lse, d**-0.5, causal, config=cfg, out=poisoned)
    exact = R.naive_attention_backward(q, k, v, do, causal=causal)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    (R.torch_math_attention(*leaves, causal=causal)[0] * do).sum().backward()
    for name, got, want, leaf in zip(("dq", "dk", "dv"), grads, exact, leaves):
        assert got.dtype == dtype
        R.assert_within_rule(name, got, want, leaf.grad, _name(dtype))
    return grads


SHAPES = [  # b, sq, sk, hq, hkv, d
    (1, 1, 1, 2, 2, 32),
    (2, 17, 17, 4, 1, 40),  # MQA, odd lengths, d = 40
    (1, 129, 17, 4, 4, 64),  # Sq > Sk: causal leaves the first rows with no key (masked rows, dQ = 0)
    (1, 17, 129, 8, 2, 24),  # Sq < Sk: many key blocks add to each row tile
    (1, 20, 26, 6, 2, 32),  # group of 3: row tiles split groups unevenly
    (1, 33, 47, 2, 2, 256),
    (1, 45, 20, 4, 2, 256),  # d = 256, GQA, Sq > Sk
]


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_atomic_matches_oracle(shape, causal, dtype, tile):
    _check(shape, causal, dtype, _atomic(TILES[tile]), seed=sum(shape) + causal)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2)], ids=["gqa2", "gqa3-pointer-fallback"])
def test_atomic_copy_engine_rows_match_oracle(hq, hkv):
    """Q and dO through tensor descriptors, as most candidates load them (group 3 falls back to pointers)."""
    _check((2, 37, 51, hq, hkv, 40), True, torch.float16, _atomic(BwdTile(32, 32, 4, 1, tma=True)), seed=hq)


def test_atomic_out_buffers_in_float32():
    """Ring attention's float32 out buffers take the atomic dQ too: rounded, they are the default-dtype run."""
    q, k, v, do = _case(1, 23, 37, 4, 2, 32, torch.float16, seed=5)
    o, lse = F.forward(q, k, v, 0.2, True)
    cfg = _atomic(TILES["16x32"])
    out = tuple(torch.full(x.shape, float("nan"), device=DEVICE) for x in (q, k, v))
    wide = B.backward(do, q, k, v, o, lse, 0.2, True, config=cfg, out=out)
    narrow = B.backward(do, q, k, v, o, lse, 0.2, True, config=cfg)
    for w, n in zip(wide, narrow):
        assert w.dtype == torch.float32 and torch.equal(w.half(), n)


def test_atomic_gradient_through_lse():
    q, k, v, do = _case(1, 23, 37, 4, 2, 64, torch.float32, seed=11)
    dlse = torch.randn(1, 4, 23, device=DEVICE)
    o, lse = F.forward(q, k, v, 0.125, True)
    dq, dk, dv = B.backward(do, q, k, v, o, lse, 0.125, True, dlse=dlse, config=_atomic(TILES["32x16"]))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, lse64 = R.torch_math_attention(*leaves, causal=True, softmax_scale=0.125)
    ((o64 * do.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    for name, got, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        R.assert_within_rule(name, got, leaf.grad, dtype_name="float32")


# ---- the table and the flag ------------------------------------------------------------------------------------


def test_table_entries_are_atomic_and_listed_as_candidates():
    assert all(cfg.atomic_dq for tiles in C.BWD_ATOMIC_CANDIDATES.values() for cfg in tiles)
    for d, cfg in C._BWD_CUDA_ATOMIC.items():
        assert cfg in C.BWD_ATOMIC_CANDIDATES[d]
        assert C.bwd_config(d, d, torch.bfloat16, "cuda", deterministic=False) is cfg
        assert not C.bwd_config(d, d, torch.float32, "cuda", deterministic=False).atomic_dq  # fp32: exactness
    for d in (64, 128, 256):
        assert not C.bwd_config(d, d, torch.bfloat16, "cuda").atomic_dq  # the default stays deterministic
    assert C.bwd_config(64, 64, torch.float16, "cpu", deterministic=False).atomic_dq  # CI runs the atomic kernel


def test_mods_carry_the_flag_and_plain_calls_stay_plain():
    assert api._mods(torch.zeros(1), 1, 2, 3, 3, (-1, -1), 0.0, None, 0.0, None, None, None) is PLAIN
    loose = api._mods(torch.zeros(1), 1, 2, 3, 3, (-1, -1), 0.0, None, 0.0, None, None, None, False)
    assert loose is not PLAIN and not loose.deterministic
    assert loose.for_kernels() is PLAIN  # the kernels launch it as plain
    assert Mods.from_op_args(loose.op_args()).deterministic is False  # through a custom op's arguments
    windowed = Mods(window_left=3, deterministic=False)
    assert windowed.for_kernels().window_left == 3 and windowed.for_kernels().deterministic
    assert Mods(window_left=3).for_kernels().window_left == 3


class _Spy:
    """Records the config and the kernels of every backward launch."""

    def __init__(self, monkeypatch):
        self.configs, self.kernels = [], []
        launch = B._launch

        def spy_launch(*args, **kwargs):
            self.configs.append(args[11])
            return launch(*args, **kwargs)

        monkeypatch.setattr(B, "_launch", spy_launch)
        for name in ("attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"):
            monkeypatch.setattr(B, name, self._kernel(name, getattr(B, name)))

    def _kernel(self, name, kernel):
        spy = self

        class Wrapped:
            def __getitem__(self, grid):
                spy.kernels.append(name)
                return kernel[grid]

        return Wrapped()


def _api_grads(deterministic, **kw):
    q, k, v, do = _case(2, 19, 33, 4, 2, D_ATOMIC, torch.float16, seed=8)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    onlineattn.attention(*leaves, causal=True, deterministic=deterministic, backend="triton", **kw).backward(do)
    return [x.grad for x in leaves]


def test_default_is_the_two_kernel_path(monkeypatch):
    spy = _Spy(monkeypatch)
    _api_grads(True)
    assert [c.atomic_dq for c in spy.configs] == [False]
    assert spy.kernels == ["attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]


@pytest.mark.parametrize("kw", [{}, {"window_size": (5, 0), "softcap": 3.0}], ids=["plain", "window-softcap"])
def test_deterministic_false_reaches_the_atomic_kernel(monkeypatch, kw):
    spy = _Spy(monkeypatch)
    grads = _api_grads(False, **kw)
    assert [c.atomic_dq for c in spy.configs] == [True]
    assert spy.kernels == ["attention_bwd_dkdv_kernel"]  # no dQ kernel
    spy.configs.clear()
    for got, want in zip(grads, _api_grads(True, **kw)):  # same math: equal to rounding
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_backward_op_takes_the_flag(monkeypatch):
    """The backward custom op (what torch.compile and functorch reach) reads the flag from its arguments, and its
    schema and fake implementation hold with it."""
    q, k, v, do = _case(1, 9, 13, 4, 2, D_ATOMIC, torch.float16, seed=15)
    o, lse = F.forward(q, k, v, 0.25, True)
    loose = Mods(deterministic=False).op_args()
    checks = ("test_schema", "test_faketensor")
    args = (do, q, k, v, o, lse, None, 0.25, True, *loose, False)
    torch.library.opcheck(torch.ops.onlineattn.attention_bwd, args, test_utils=checks)
    torch.library.opcheck(torch.ops.onlineattn.attention_fwd, (q, k, v, 0.25, True, *loose), test_utils=checks)
    spy = _Spy(monkeypatch)
    torch.ops.onlineattn.attention_bwd(*args)
    assert [c.atomic_dq for c in spy.configs] == [True]


def test_torch_path_ignores_the_flag():
    q, k, v, do = _case(1, 11, 14, 4, 2, 16, torch.float32, seed=2)
    grads = []
    for deterministic in (True, False):
        leaves = [x.cpu().clone().requires_grad_() for x in (q, k, v)]
        onlineattn.attention(*leaves, causal=True, deterministic=deterministic, backend="torch").backward(do.cpu())
        grads.append([x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---- the score variants and varlen, through the public API with deterministic=False ----------------------------

_spec = importlib.util.spec_from_file_location("_variants", Path(__file__).parent.parent / "test_variants.py")
V = sys.modules.setdefault("_variants", importlib.util.module_from_spec(_spec))  # dataclasses look it up there
_spec.loader.exec_module(V)


@pytest.fixture
def atomic_table(monkeypatch):
    """deterministic=False takes an atomic config with 16-key blocks (the variants' short sequences still span
    several key blocks, so row tiles take adds from more than one); the flag must arrive for that to happen."""
    table = C.bwd_config
    seen = []

    def bwd_config(d, dv, dtype, device_type, deterministic=True):
        seen.append(deterministic)
        return table(d, dv, dtype, device_type) if deterministic else _atomic(BwdTile(16, 16, 4, 1))

    monkeypatch.setattr(B, "bwd_config", bwd_config)
    yield
    assert seen and not any(seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
@pytest.mark.parametrize("name", ["window", "window-causal-masked-rows", "window-causal-gqa3-softcap", "alibi",
                                  "alibi-window-sinks", "bias-softcap-causal", "sinks-dropout-causal", "everything"])
def test_atomic_variants_match_oracle(name, dtype, atomic_table):
    V.run_case(V.CASES[name], "triton", dtype, seed=len(name), deterministic=False)


@pytest.mark.parametrize("name", list(V.VARLEN_CASES))
def test_atomic_varlen_matches_oracle(name, atomic_table):
    V.run_varlen(V.VARLEN_CASES[name], [5, 0, 33, 3, 17], [9, 4, 20, 0, 17], "triton", torch.float32,
                 seed=len(name), deterministic=False)


@pytest.mark.parametrize("given,passed", [({}, False), ({"deterministic": True}, True)], ids=["default", "true"])
def test_compat_passes_the_flag(monkeypatch, given, passed):
    """flash-attn's default is deterministic=False, and the drop-ins hand it on as given."""
    from onlineattn.compat.flash_attn import flash_attn_func, flash_attn_varlen_func

    seen = []
    for name in ("attention", "attention_varlen"):
        real = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _real=real, **kw: seen.append(kw["deterministic"]) or _real(*a, **kw))
    q, k, v, _ = _case(1, 7, 9, 4, 2, 16, torch.float32, seed=3)
    flash_attn_func(q.cpu(), k.cpu(), v.cpu(), causal=True, **given)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    flash_attn_varlen_func(q[0].cpu(), k[0].cpu()[:7], v[0].cpu()[:7], cu, cu, 7, 7, **given)
    assert seen == [passed, passed]


# ---- GPU: bf16 at scale ----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d", [(2, 2048, 2048, 8, 2, 256), (1, 1500, 2600, 6, 3, 256),
                                              (2, 2048, 2048, 16, 4, 128)])
def test_atomic_against_deterministic_bf16_gpu(b, sq, sk, hq, hkv, d, causal):
    """Both schemes through the public API against float64 under the rule, and against each other: dK and dV come
    from the same math with other tiles, dQ from the same products summed in another order."""
    q, k, v, do = _case(b, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + d)
    runs = {}
    for deterministic in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        onlineattn.attention(*leaves, causal=causal, deterministic=deterministic).backward(do)
        runs[deterministic] = [x.grad for x in leaves]
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    (R.torch_math_attention(*exact, causal=causal)[0] * do.double()).sum().backward()
    base = [x.clone().requires_grad_() for x in (q, k, v)]
    (R.torch_math_attention(*base, causal=causal)[0] * do).sum().backward()
    for grads in runs.values():
        for name, got, want, ref in zip(("dq", "dk", "dv"), grads, exact, base):
            R.assert_within_rule(name, got, want.grad, ref.grad, "bfloat16")
    for a, b_ in zip(runs[True], runs[False]):
        err = ((a.float() - b_.float()).abs().max() / a.float().abs().max()).item()
        assert err < 2e-2, err


@gpu
def test_compiled_step_with_deterministic_false_has_no_graph_break_gpu():
    q, k, v, do = _case(2, 300, 300, 8, 2, 256, torch.bfloat16, seed=17)

    def step(q, k, v):
        return (onlineattn.attention(q, k, v, causal=True, deterministic=False).float() * do.float()).sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(step, fullgraph=True)(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    step(*eager).backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)
