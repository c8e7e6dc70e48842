"""The fused-dQ backward (``BwdConfig.fused_dq``: the dK/dV kernel adds each row tile's dS·K into a float32 dQ, in
key-block order) against the oracle's gradients, forced through the ``config=`` override. Without CUDA the kernels run
in Triton's interpreter, one program at a time in launch order; there a counter that is not what the order says
poisons dQ with NaN, so every test here also checks the ordering logic (which key block waits for which)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from onlineattn import reference as R
from onlineattn.ops import backward as B
from onlineattn.ops import forward as F
from onlineattn.ops._configs import BWD_FUSED_D256_CANDIDATES, BwdConfig, BwdTile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
_UNUSED = BwdTile(32, 32, 4, 1)  # the dQ kernel's tile: the fused path launches no dQ kernel
# Row tiles smaller, equal and larger than key blocks: the key blocks a row tile waits on follow from both.
TILES = {"16x32": BwdTile(16, 32, 4, 1), "32x16": BwdTile(32, 16, 4, 1), "32x32": BwdTile(32, 32, 4, 1)}


def _fused(tile: BwdTile) -> BwdConfig:
    return BwdConfig(tile, _UNUSED, fused_dq=True)


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
    (2, 17, 17, 4, 1, 40),  # MQA, odd lengths
    (1, 129, 17, 4, 4, 16),  # Sq > Sk: causal leaves the first rows with no key (masked rows, dQ = 0)
    (1, 17, 129, 8, 2, 24),  # Sq < Sk: many key blocks add to each row tile
    (1, 20, 26, 6, 2, 32),  # group of 3: row tiles split groups unevenly
    (1, 33, 47, 2, 2, 256),
    (1, 45, 20, 4, 2, 256),  # d = 256, GQA, Sq > Sk
]


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_matches_oracle(shape, causal, dtype, tile):
    _check(shape, causal, dtype, _fused(TILES[tile]), seed=sum(shape) + causal)


def test_fused_copy_engine_rows_match_oracle():
    """Q and dO through tensor descriptors, as every d = 256 candidate loads them."""
    _check((2, 37, 51, 4, 2, 40), True, torch.float16, _fused(BwdTile(32, 32, 4, 1, tma=True)), seed=3)


def test_fused_is_bitwise_deterministic_and_equals_two_kernels_where_the_order_matches():
    """Two runs agree bit for bit. With the tile of the two-kernel scheme (row tile and key block the same) the fused
    sum adds the same per-block products in the same order, so dQ is identical to the dQ kernel's."""
    q, k, v, do = _case(1, 45, 70, 4, 2, 32, torch.float16, seed=12)
    o, lse = F.forward(q, k, v, 0.125, True)
    tile = BwdTile(32, 32, 4, 1)
    first = B.backward(do, q, k, v, o, lse, 0.125, True, config=_fused(tile))
    again = B.backward(do, q, k, v, o, lse, 0.125, True, config=_fused(tile))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    if DEVICE == "cpu":  # the interpreter's dots are the same numpy products in both kernels
        two = B.backward(do, q, k, v, o, lse, 0.125, True, config=BwdConfig(tile, tile))
        assert all(torch.equal(a, b) for a, b in zip(first, two))


def test_fused_out_buffers_in_float32():
    """Ring attention passes float32 out buffers: they get the gradients before rounding, so rounding them to the
    inputs' dtype gives the default run's gradients bit for bit."""
    q, k, v, do = _case(1, 23, 37, 4, 2, 32, torch.float16, seed=5)
    o, lse = F.forward(q, k, v, 0.2, True)
    cfg = _fused(TILES["16x32"])
    out = tuple(torch.full(x.shape, float("nan"), device=DEVICE) for x in (q, k, v))
    wide = B.backward(do, q, k, v, o, lse, 0.2, True, config=cfg, out=out)
    narrow = B.backward(do, q, k, v, o, lse, 0.2, True, config=cfg)
    for w, n in zip(wide, narrow):
        assert w.dtype == torch.float32 and torch.equal(w.half(), n)


def test_candidates_are_fused_d256_tiles():
    assert BWD_FUSED_D256_CANDIDATES and all(c.fused_dq for c in BWD_FUSED_D256_CANDIDATES)


# ---- the score variants and varlen, through the public API with the fused config forced -------------------------

_spec = importlib.util.spec_from_file_location("_variants", Path(__file__).parent.parent / "test_variants.py")
V = sys.modules.setdefault("_variants", importlib.util.module_from_spec(_spec))  # dataclasses look it up there
_spec.loader.exec_module(V)


@pytest.fixture
def fused_table(monkeypatch):
    """Every backward launch takes the fused config, with 16-key blocks: the variants' short sequences still span
    several key blocks, so row tiles take adds from more than one."""
    monkeypatch.setattr(B, "bwd_config", lambda *args: _fused(BwdTile(16, 16, 4, 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
@pytest.mark.parametrize("name", ["window", "window-causal-masked-rows", "window-causal-gqa3-softcap",
                                  "alibi-window-sinks", "bias-softcap-causal", "sinks-dropout-causal", "everything"])
def test_fused_variants_match_oracle(name, dtype, fused_table):
    V.run_case(V.CASES[name], "triton", dtype, seed=len(name))


@pytest.mark.parametrize("name", list(V.VARLEN_CASES))
def test_fused_varlen_matches_oracle(name, fused_table):
    V.run_varlen(V.VARLEN_CASES[name], [5, 0, 33, 3, 17], [9, 4, 20, 0, 17], "triton", torch.float32, seed=len(name))


def test_fused_window_row_tiles_bigger_than_key_blocks(monkeypatch):
    """A sliding window whose row tiles span several key blocks: the first key block of a tile is not block 0."""
    monkeypatch.setattr(B, "bwd_config", lambda *args: _fused(TILES["32x16"]))
    V.run_case(V.Case(window=(9, 2), causal=False, sq=70, sk=61, hq=4, hkv=2, d=16, dv=16), "triton", torch.float32)
