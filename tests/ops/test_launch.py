"""The launch cache (ops/_launch.py): its key must determine Triton's own cache key, and its bound arguments must be the
ones ``JITFunction.run`` passes to the launcher.

The cases call the real launchers (forward, backward, decode) with their launch entry points (``start``,
``prepare``) replaced by a recorder, so no kernel runs and the checks hold on CPU. Triton's key for each recorded call comes from Triton's own binder for an sm_90 backend,
as ``run`` computes it. benchmarks/probe_launch.py ``check`` replays the same cases through compiled sm_90 kernels.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

from onlineattn._mods import PLAIN, Mods
from onlineattn.dropout import draw_rng_state
from onlineattn.ops import _launch, backward, decode, forward
from onlineattn.ops._configs import bwd_config, fwd_config
from onlineattn.ops._decode_configs import decode_config


@dataclass(frozen=True)
class Case:
    d: int = 64
    dv: int = 0  # 0: d
    dtype: torch.dtype = torch.float16
    causal: bool = False
    b: int = 2
    sq: int = 33
    sk: int = 33
    hq: int = 4
    hkv: int = 2
    offset: int = 0  # elements before q, k, v, do in their storage: 8 keeps fp16/bf16 pointers 16-byte aligned, 1 not
    transposed: bool = False  # q, k, v, do as [B, H, S, D] storage seen as [B, S, H, D]
    variant: str = ""  # "", window, softcap, alibi, bias, sinks, dropout, varlen, dlse
    device_type: str = "cuda"  # the config tables: cuda (descriptors where allowed) or cpu (interpreter tiles)
    num_splits: int = 1  # decode


CASES = [
    Case(),
    Case(causal=True),
    Case(offset=8),
    Case(offset=1),
    Case(offset=1, causal=True, dtype=torch.bfloat16),
    Case(transposed=True),
    Case(d=40, hq=3, hkv=1, sq=17, sk=49),  # odd strides, one kv head (heads_kv == 1 is a constexpr to Triton)
    Case(d=40, offset=1, sq=16, sk=16),  # seqlens % 16 == 0
    Case(d=128, hq=8, hkv=2, causal=True, dtype=torch.bfloat16),
    Case(d=128, hq=8, hkv=8, b=1, sq=1, sk=64),  # batch 1, one query
    Case(causal=True, b=5),  # 10 (batch, kv head) columns: the backward's causal head groups (bwd_head_group)
    Case(d=256, hq=2, hkv=2, dtype=torch.bfloat16),
    Case(d=256, hq=2, hkv=2, causal=True, offset=1),
    Case(d=64, dv=128, hq=6, hkv=2),  # group of 3: the dK/dV kernel reads Q through pointers
    Case(dtype=torch.float32),
    Case(dtype=torch.float32, d=128, offset=1),
    Case(device_type="cpu"),
    Case(device_type="cpu", offset=1, causal=True),
    *[Case(variant=variant) for variant in ("window", "softcap", "alibi", "bias", "sinks", "dropout", "varlen",
                                            "dlse")],
    Case(variant="varlen", causal=True, offset=1),
    Case(variant="bias", causal=True, d=128, dtype=torch.bfloat16),
    Case(num_splits=4),
    Case(num_splits=3, causal=True, offset=1, d=128, dtype=torch.bfloat16),
]


def _tensor(case: Case, shape, device, seed):
    """Fresh storage of ``shape`` starting ``case.offset`` elements in; ``[B, S, H, D]`` over ``[B, H, S, D]`` storage
    when ``case.transposed``."""
    g = torch.Generator().manual_seed(seed)
    stored = (shape[0], shape[2], shape[1], shape[3]) if case.transposed else shape
    flat = torch.randn(case.offset + torch.Size(stored).numel(), generator=g).to(device=device, dtype=case.dtype)
    x = flat[case.offset:].view(stored)
    return x.transpose(1, 2) if case.transposed else x


def _mods(case: Case, b: int, device) -> Mods:
    g = torch.Generator().manual_seed(4)
    to = lambda x: x.to(device)  # noqa: E731
    if case.variant == "window":
        return Mods(window_left=8, window_right=0)
    if case.variant == "softcap":
        return Mods(softcap=30.0)
    if case.variant == "alibi":
        return Mods(alibi_slopes=to(torch.rand(case.hq, generator=g)))
    if case.variant == "bias":
        return Mods(attn_bias=to(torch.randn(b, case.hq, case.sq, case.sk, generator=g).to(case.dtype)))
    if case.variant == "sinks":
        return Mods(sinks=to(torch.randn(case.hq, generator=g)))
    if case.variant == "dropout":
        return Mods(dropout_p=0.1, rng=to(draw_rng_state(g)))
    if case.variant == "varlen":
        cu_q = to(torch.tensor([0, 5, case.sq * b], dtype=torch.int32))
        cu_k = to(torch.tensor([0, 7, case.sk * b], dtype=torch.int32))
        return Mods(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=case.sq * b - 5, max_seqlen_k=case.sk * b - 7)
    return PLAIN


def call_case(case: Case, device="cpu") -> list:
    """Forward, backward and decode launches of one case, on fresh tensors drawn from fixed seeds; their outputs."""
    b, dv = case.b, case.dv or case.d
    q, k, v = (_tensor(case, (b, s, h, d), device, seed=i)
               for i, (s, h, d) in enumerate(((case.sq, case.hq, case.d), (case.sk, case.hkv, case.d),
                                               (case.sk, case.hkv, dv))))
    do = _tensor(case, (b, case.sq, case.hq, dv), device, seed=3)
    mods, scale = _mods(case, b, device), case.d ** -0.5
    if mods.varlen:
        q, k, v, do = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v, do))
    fcfg = fwd_config(case.d, dv, case.dtype, case.causal, case.device_type, seqlen_q=case.sq,
                      variants=mods is not PLAIN)
    o, lse = forward.forward(q, k, v, scale, case.causal, config=fcfg, mods=mods)
    dlse = None
    if case.variant == "dlse":
        dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5)).to(device)
    bcfg = bwd_config(case.d, dv, case.dtype, case.device_type, causal=case.causal)
    outputs = [o, lse, *backward.gradients(do, q, k, v, o, lse, scale, case.causal, dlse, config=bcfg, mods=mods)]
    if mods is PLAIN:
        delta = torch.empty(lse.shape, dtype=torch.float32, device=device)  # the delta pass before a fused dQ (the
        backward._preprocess(o, do, lse, dlse, delta)  # dQ kernel computes delta otherwise)
        outputs.append(delta)
        dcfg = decode_config(case.d, dv, case.dtype, case.device_type, batch_heads=b * case.hkv,
                             max_seqlen_k=case.sk, num_sms=132)
        seqlens = torch.full((b,), case.sk, dtype=torch.int32, device=device)
        outputs += decode.attention_with_kvcache(q[:, :1], k, v, None, None, seqlens, None, scale, case.causal,
                                                 case.num_splits, config=dcfg)
    return [x for x in outputs if x is not None]


@pytest.fixture
def recorded(monkeypatch):
    """Every launch of the launchers (``start`` in forward and backward, ``prepare`` in decode), as (kernel, grid,
    args, kwargs); nothing runs."""
    calls = []

    def record(kernel, grid, *args, **kwargs):
        calls.append((kernel, grid, args, kwargs))

    def record_prepare(kernel, grid, n_arrays, *args, **kwargs):
        record(kernel, grid, *args, **kwargs)
        assert all(isinstance(x, (torch.Tensor, TensorDescriptor)) for x in args[:n_arrays])

    def record_start(keep, kernel, grid, n_arrays, *args, **kwargs):
        record_prepare(kernel, grid, n_arrays, *args, **kwargs)

    for module in (forward, backward):  # no kept launch of an earlier test may bypass the recorder
        monkeypatch.setattr(module, "start", record_start)
        monkeypatch.setattr(module, "_STEPS", {})
    monkeypatch.setattr(decode, "prepare", record_prepare)
    return calls


_JIT = {}
_SM90 = make_backend(GPUTarget("cuda", 90, 32))


def _jit(kernel) -> JITFunction:
    """The kernel as a JITFunction (under TRITON_INTERPRET=1 the decorator made an InterpretedFunction); a Gluon
    kernel as it is (Gluon has no interpreter)."""
    if type(kernel) in _launch._KERNEL_TYPES:
        return kernel
    if kernel.fn not in _JIT:
        _JIT[kernel.fn] = JITFunction(kernel.fn)
    return _JIT[kernel.fn]


def triton_bind(kernel, args, kwargs):
    """``(bound values, Triton's cache key)`` as ``JITFunction.run`` computes them for an sm_90 device."""
    binder = create_function_from_signature(kernel.signature, kernel.params, _SM90)
    kwargs = dict(kwargs, debug=kernel.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    return tuple(bound.values()), compute_cache_key({}, specialization, options)


def _keys(calls):
    """(our key, Triton's key, specialisation string) per recorded call, after checking the bound arguments."""
    rows = []
    for kernel, grid, args, kwargs in calls:
        jit = _jit(kernel)
        ours = _launch.bind(jit, args, kwargs)
        assert ours is not None, f"{jit.fn.__name__}: the launch cache would leave this call to run()"
        _, bound, key = ours
        triton_values, triton_key = triton_bind(jit, args, kwargs)
        assert len(bound) == len(triton_values) and all(a is b for a, b in zip(bound, triton_values)), (
            f"{jit.fn.__name__}: the cached path would pass other arguments than run()")
        rows.append((jit.fn.__name__, key, triton_key))
    return rows


# The cases' CPU tensors reach launches the recorder does not replace (the sinks' gradient kernel, for one): Triton's
# interpreter runs them on a CPU machine, a CUDA machine's launcher refuses CPU pointers.
_INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the real launchers")


@_INTERPRETER_ONLY
def test_every_launch_is_cacheable_and_binds_as_run(recorded):
    for case in CASES:
        call_case(case)
    rows = _keys(recorded)
    assert {name for name, _, _ in rows} == {"attention_fwd_kernel", "attention_bwd_preprocess_kernel",
                                             "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel", "decode_kernel"}


@_INTERPRETER_ONLY
def test_key_determines_triton_key(recorded):
    """One of our keys never stands for two Triton keys: equal keys launch the same compiled kernel. The cases must
    reach every kind of specialisation Triton makes, or the check would prove little."""
    for case in CASES:
        call_case(case)
    triton_of = {}
    for name, key, triton_key in _keys(recorded):
        assert triton_of.setdefault((name, key), triton_key) == triton_key, f"{name}: one key, two Triton keys"
    specs = " ".join(triton_of.values())
    for kind in ("('*fp16', 'D')", "('*fp16', '')", "('*bf16', '')", "('*fp32', 'D')", "('i32', 'D')",
                 "('i32', '')", "('constexpr', 1)", "('constexpr', None)", "tensordesc<bf16", "tensordesc<fp16",
                 "('fp32', None)", "('*i32', 'D')", "('*i64', 'D')"):
        assert kind in specs, f"no case reaches the specialisation {kind}"
    assert len(set(triton_of.values())) >= 80  # distinct Triton keys the cases cover


@_INTERPRETER_ONLY
def test_same_shapes_give_the_same_keys(recorded):
    """Fresh tensors of the same shapes (new pointers) hit: the key holds no pointer, only its alignment."""
    for case in CASES:
        call_case(case)
    first = [key for _, key, _ in _keys(recorded)]
    recorded.clear()
    for case in CASES:
        call_case(case)
    assert [key for _, key, _ in _keys(recorded)] == first


def _unaligned(x):
    return torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)  # x's shape and strides, 2 bytes off


def test_every_specialisation_splits_keys(recorded):
    """One forward launch with K/V descriptors, changed one argument at a time in each way Triton specialises on
    (pointer alignment and dtype, descriptor dtype and block, ints equal to 1, multiples of 16 and past int32, None
    against a tensor, bool against int, float against int, options): wherever Triton's key changes, ours does."""
    call_case(Case(d=128, dtype=torch.bfloat16, causal=True))
    kernel, grid, args, kwargs = recorded[0]
    jit = _jit(kernel)
    q, k_desc = args[0], args[1]
    assert isinstance(k_desc, TensorDescriptor)
    desc = lambda base, block, **kw: TensorDescriptor(base, list(base.shape), list(base.stride()), block, **kw)  # noqa
    block = list(k_desc.block_shape)
    positional = [
        (0, _unaligned(q)), (0, q.half()), (0, q.float()),
        (1, desc(k_desc.base, [1, 32, 1, block[3]])), (1, desc(k_desc.base.half(), block)),
        (1, desc(k_desc.base, block, padding="nan")), (1, desc(k_desc.base.clone(), block)),
        *[(5, stride) for stride in (1, 16, 17, 2**31, 2**31 + 16, -16)], (len(args) - 1, 1), (len(args) - 1, 2),
    ]
    keyword = [("window_left", w) for w in (0, 1, 16, 17, True)] + [
        ("CU_Q", torch.zeros(3, dtype=torch.int32)), ("CU_Q", torch.zeros(3, dtype=torch.int64)),
        ("VARLEN", 0), ("VARLEN", True), ("dropout_p", 0), ("num_warps", 8), ("num_stages", 2),
    ]
    calls = [(args, kwargs)]
    calls += [(args[:i] + (value,) + args[i + 1:], kwargs) for i, value in positional]
    calls += [(args, {**kwargs, name: value}) for name, value in keyword]
    triton_of, ours_of = {}, {}
    for a, kw in calls:
        ours, (_, triton_key) = _launch.bind(jit, a, kw)[2], triton_bind(jit, a, kw)
        assert triton_of.setdefault(ours, triton_key) == triton_key, "one key, two Triton keys"
        ours_of.setdefault(triton_key, ours)
    # Every perturbation changes Triton's key but seven, in a class Triton does not split: stride 16 and -16 (as the
    # base's 16896, i32 % 16 == 0), 2^31 + 16 (as 2^31), window_left 0 and 16 (as the base's 0), the padding and
    # another base of the same dtype.
    assert len(ours_of) == len(calls) - 7


# ---------------------------------------------------------------------------------------------------------------
# Gluon kernels (forward_sm90, backward_sm90): the same checks on their launches, recorded on CPU tensors.


def _gluon_calls(monkeypatch) -> list:
    """(kernel, grid, args, kwargs) of the Gluon forward (both schedules) and dK/dV launches over dtypes, head dims,
    masks, GQA groups (1 is a constexpr to Triton), odd lengths and lse/delta/dk/dv pointers off 16-byte alignment
    (the forward's o goes by descriptor: aligned, as ``forward.py`` routes it)."""
    from onlineattn.ops import backward_sm90, forward_sm90
    from onlineattn.ops._configs import _BWD_WS_DKDV, _FWD_WS, fused_dq_tile

    calls = []

    def record(keep, kernel, grid, n_arrays, *args, **kwargs):
        calls.append((kernel, grid, args, kwargs))

    monkeypatch.setattr(forward_sm90, "start", record)
    monkeypatch.setattr(backward_sm90, "start", record)
    shapes = ((2, 300, 300, 8, 2), (1, 256, 1024, 4, 4), (1, 17, 40, 2, 1))  # b, sq, sk, hq, hkv
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for causal in (False, True):
                for i, (b, sq, sk, hq, hkv) in enumerate(shapes):
                    case = Case(dtype=dtype, offset=8 * (i == 0) + (i == 1))  # outputs: aligned, or 2 bytes off
                    q, do = (torch.randn(b, sq, hq, d, dtype=dtype) for _ in range(2))
                    k, v = (torch.randn(b, sk, hkv, d, dtype=dtype) for _ in range(2))
                    o, dk, dv = torch.empty_like(q), _tensor(case, k.shape, "cpu", 1), _tensor(case, k.shape, "cpu", 2)
                    lse, delta = (torch.randn(b * hq * sq + case.offset)[case.offset:].view(b, hq, sq)
                                  for _ in range(2))
                    tile = _FWD_WS[causal][d]
                    for cfg in (tile, replace(tile, persistent=not tile.persistent)):
                        forward_sm90.launch(q, k, v, o, lse, 0.1, causal, cfg)
                    backward_sm90.launch_dkdv(q, k, v, do, lse, delta, dk, dv, 0.1, causal, _BWD_WS_DKDV[d])
                    if d < 256 and i == 0:  # the fused dQ, with its adds ordered (int32 counters: one more array)
                        tile = fused_dq_tile(d, ordered=True, causal=causal)
                        tiles = -(-sq // tile.block_m)
                        backward_sm90.launch_dkdv(q, k, v, do, lse, delta, dk, dv, 0.1, causal, tile,
                                                  dq_acc=torch.zeros(b, tiles * tile.block_m, hq, d),
                                                  dq_sem=torch.zeros(b, hq, tiles, dtype=torch.int32))
    return calls


def test_gluon_launches_bind_as_run_and_key_as_triton(monkeypatch):
    """Each Gluon launch is one the cache keeps, binds as ``run`` would, and one key never stands for two Triton keys;
    the cases reach Gluon's descriptor specialisation (its shared-memory layout) in both dtypes."""
    calls = _gluon_calls(monkeypatch)
    rows = _keys(calls)
    assert {name for name, _, _ in rows} == {"attention_fwd_sm90_kernel", "attention_bwd_dkdv_sm90_kernel"}
    triton_of = {}
    for name, key, triton_key in rows:
        assert triton_of.setdefault((name, key), triton_key) == triton_key, f"{name}: one key, two Triton keys"
    specs = " ".join(triton_of.values())
    for kind in ("tensordesc<bf16[1, 128, 1, 128],NVMMASharedLayout", "tensordesc<fp16[1, 64, 1, 64],NVMMASharedLayout",
                 "tensordesc<bf16[1, 64, 1, 256],NVMMASharedLayout",
                 "('*fp32', 'D')", "('*fp32', '')", "('*bf16', '')", "('constexpr', 1)"):
        assert kind in specs, f"no case reaches the specialisation {kind}"


def test_gluon_descriptor_layout_splits_keys(monkeypatch):
    """Two Gluon descriptors alike but for their shared-memory layout specialise apart in Triton: so do our keys."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    kernel, grid, args, kwargs = _gluon_calls(monkeypatch)[0]
    q_desc = args[0]
    other = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=4)
    assert other != q_desc.layout
    moved = GluonDescriptor(q_desc.base, q_desc.shape, q_desc.strides, q_desc.block_shape, other)
    keys = [_launch.bind(kernel, a, kwargs)[2] for a in (args, (moved, *args[1:]))]
    triton_keys = [triton_bind(kernel, a, kwargs)[1] for a in (args, (moved, *args[1:]))]
    assert triton_keys[0] != triton_keys[1] and keys[0] != keys[1]


# ---------------------------------------------------------------------------------------------------------------
# launch() itself, with a stand-in compiled kernel: hits, misses and the cases left to run().


class _Compiled:
    """Stands in for a CompiledKernel: records what its launcher is given."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Driver:
    def __init__(self, backend="cuda"):
        self.backend = backend

    def get_current_target(self):
        return GPUTarget(self.backend, 90 if self.backend == "cuda" else "gfx942", 32 if self.backend == "cuda" else 64)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7


@pytest.fixture
def fake_run(monkeypatch, recorded):
    """The first recorded forward launch on a JITFunction whose run() is a stand-in counting its calls."""
    call_case(Case())
    kernel, grid, args, kwargs = recorded[0]
    jit = JITFunction(kernel.fn)
    runs = []

    def run(*a, grid, warmup, **kw):
        runs.append(grid)
        return compiled

    compiled = _Compiled()
    monkeypatch.setattr(jit, "run", run)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(_launch, "enabled", True)
    monkeypatch.setattr(_launch, "_CUDA_TARGET", {})
    return jit, grid, args, kwargs, runs, compiled


def test_launch_hits_after_one_run(fake_run):
    jit, grid, args, kwargs, runs, compiled = fake_run
    assert _launch.launch(jit, grid, *args, **kwargs) is compiled
    assert runs == [grid] and compiled.launches == []
    assert _launch.launch(jit, grid, *args, **kwargs) is compiled
    assert runs == [grid]  # no second run()
    (launched,) = compiled.launches
    bound = _launch.bind(jit, args, kwargs)[1]
    assert launched[:9] == (grid[0], grid[1], 1, 7, "function", "packed", None, None, None)
    assert all(a is b for a, b in zip(launched[9:], bound)) and len(launched) == 9 + len(bound)
    q = args[0]
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # the same strides, 2 bytes off
    _launch.launch(jit, grid, unaligned, *args[1:], **kwargs)
    assert len(runs) == 2


@pytest.mark.parametrize("unusual", ["hook", "disabled", "default_left_out", "odd_type", "callable_grid",
                                     "unhashable_option", "hip_target"])
def test_unusual_calls_take_run(fake_run, monkeypatch, unusual):
    jit, grid, args, kwargs, runs, compiled = fake_run
    if unusual == "unhashable_option":
        kwargs = {**kwargs, "num_warps": [kwargs["num_warps"]]}
    elif unusual == "hip_target":  # ROCm also specialises on storage size, which the key does not hold
        monkeypatch.setattr(triton.runtime.driver, "_active", _Driver("hip"))
    elif unusual == "hook":
        monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [print])
    elif unusual == "disabled":
        monkeypatch.setattr(_launch, "enabled", False)
    elif unusual == "default_left_out":
        kwargs = {name: value for name, value in kwargs.items() if name != "DROPOUT"}
    elif unusual == "odd_type":
        kwargs = {**kwargs, "window_left": np.int64(0)}
    elif unusual == "callable_grid":
        g = grid
        grid = lambda meta: g  # noqa: E731
    for _ in range(3):
        _launch.launch(jit, grid, *args, **kwargs)
    assert len(runs) == 3 and compiled.launches == []


def test_interpreted_kernels_take_run():
    if not knobs.runtime.interpret:
        pytest.skip("the kernels are compiled here (TRITON_INTERPRET is not set), not interpreted")
    assert _launch.bind(forward.attention_fwd_kernel, (), {}) is None


def test_kept_descriptor_holds_no_reference_to_its_tensor():
    """keep_by_address: the descriptor's base becomes the tensor's address and dtype (all a launch and the cache key
    read of it), so a kept descriptor (the decode step's caches, forward_sm90's) does not keep the memory alive."""
    x = torch.zeros(2, 32, 2, 16)
    ptr, alive = x.data_ptr(), weakref.ref(x)
    d = _launch.keep_by_address(TensorDescriptor.from_tensor(x, [1, 16, 1, 16]), ptr)
    assert d.base.data_ptr() == ptr and d.launch_args == {}
    assert _launch._descriptor_key(d) == (torch.float32, (1, 16, 1, 16), "zero", None)
    del x
    gc.collect()
    assert alive() is None


def test_host_arithmetic_matches_triton():
    assert [_launch.next_power_of_2(n) for n in range(4097)] == [triton.next_power_of_2(n) for n in range(4097)]
    assert all(_launch.cdiv(a, b) == triton.cdiv(a, b) for a in range(300) for b in range(1, 70))


# ---------------------------------------------------------------------------------------------------------------
# prepare() and Relaunch: the decode launcher repeats one launch with new tensors.


@pytest.fixture
def fake_decode(monkeypatch, recorded):
    """The recorded decode launch of the plain case, on a JITFunction whose run() is a stand-in (d = 64: pointer
    loads, so every array is a tensor; d = 128's tiles pass tensor descriptors of the caches)."""
    call_case(Case(d=64, hq=8, hkv=2, dtype=torch.bfloat16))
    kernel, grid, args, kwargs = next(c for c in recorded if c[0].fn.__name__ == "decode_kernel")
    jit = JITFunction(kernel.fn)
    runs = []
    compiled = _Compiled()
    monkeypatch.setattr(jit, "run", lambda *a, grid, warmup, **kw: runs.append(grid) or compiled)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(_launch, "enabled", True)
    monkeypatch.setattr(_launch, "_CUDA_TARGET", {})
    return jit, grid, args, kwargs, runs, compiled


def _like(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A fresh tensor of x's shape, strides and dtype, ``offset`` elements into its storage."""
    flat = torch.empty(offset + x.untyped_storage().nbytes() // x.element_size() + 8, dtype=x.dtype)
    return flat[offset:].as_strided(x.shape, x.stride())


def test_relaunch_binds_new_tensors_as_run(fake_decode):
    jit, grid, args, kwargs, runs, compiled = fake_decode
    n = 9  # q, k_cache, v_cache, cache_seqlens, table, o, lse, work, counts
    relaunch = _launch.prepare(jit, grid, n, *args, **kwargs)
    assert runs == [grid] and relaunch is not None and relaunch.compiled is compiled
    tensors = tuple(_like(x) for x in args[:n])
    assert relaunch(grid, tensors) and runs == [grid]  # launched without run()
    (launched,) = compiled.launches
    bound = _launch.bind(jit, tensors + tuple(args[n:]), kwargs)[1]  # what run() would be given for that call
    assert launched[:9] == (grid[0], grid[1], grid[2], 7, "function", "packed", None, None, None)
    assert len(launched) == 9 + len(bound) and all(a is b for a, b in zip(launched[9:], bound))


@pytest.mark.parametrize("change", ["alignment", "debug", "device", "disabled", "hook", "pre_run_hook", "subclass"])
def test_relaunch_refuses_what_could_specialise_otherwise(fake_decode, monkeypatch, change):
    jit, grid, args, kwargs, runs, compiled = fake_decode
    relaunch = _launch.prepare(jit, grid, 9, *args, **kwargs)
    tensors = list(args[:9])
    if change == "pre_run_hook":
        monkeypatch.setattr(jit, "pre_run_hooks", [print])
    elif change == "subclass":

        class Sub(torch.Tensor):
            pass

        tensors[0] = tensors[0].as_subclass(Sub)
    elif change == "alignment":
        tensors[0] = _like(tensors[0], offset=1)  # 2 bytes off: Triton would specialise the pointer otherwise
    elif change == "debug":
        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    elif change == "device":
        monkeypatch.setattr(_Driver, "get_current_device", lambda self: 1)
    elif change == "disabled":
        monkeypatch.setattr(_launch, "enabled", False)
    elif change == "hook":
        monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [print])
    assert not relaunch(grid, tuple(tensors)) and compiled.launches == []


def test_prepare_needs_leading_tensors(fake_decode):
    jit, grid, args, kwargs, runs, compiled = fake_decode
    assert _launch.prepare(jit, grid, 8, *args, **kwargs) is None  # the ninth argument is a tensor too


def test_bounded_put_starts_over_when_full():
    table = {}
    for i in range(3):
        assert _launch.bounded_put(table, i, str(i), 3) == str(i)
    assert table == {0: "0", 1: "1", 2: "2"}
    _launch.bounded_put(table, 3, "3", 3)  # full: emptied, then the new entry
    assert table == {3: "3"}
    _launch.bounded_put(table, 3, "x", 1)  # at the limit even for a key it holds
    assert table == {3: "x"}


# ---------------------------------------------------------------------------------------------------------------
# A Relaunch's direct launch: Triton 3.6's CudaLauncher minus its Python, with the C launcher a recorder.


class _TensorMaps:
    """Stands in for the driver's ``fill_tma_descriptor``: a new map object per call, counted."""

    def __init__(self):
        self.calls = 0

    def fill_tma_descriptor(self, *args):
        self.calls += 1
        return ["map", *args]  # equal by value, a new object each time


def _cuda_launcher(recorder, types: tuple, n_rest: int, swizzle: int = 3):
    """A ``CudaLauncher`` as Triton 3.6 builds it (not compiled): ``recorder`` is its C launch, every descriptor
    argument has metadata (``swizzle`` in it), and it launches cooperative grids but not PDL ones."""
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

    signature = {i: "tensordesc<bf16[1, 128, 1, 128]>" if t in _launch._DESCRIPTOR_TYPES else "i32"
                 for i, t in enumerate(types + (int,) * n_rest)}
    n_desc = sum(t in _launch._DESCRIPTOR_TYPES for t in types)
    meta = [dict(swizzle=swizzle, elem_size=2, elem_type=i, block_size=[1, 128, 1, 128], fp4_padded=False)
            for i in range(n_desc)]
    launcher = object.__new__(CudaLauncher)
    launcher.launch = wrap_handle_tensordesc(recorder, signature, meta)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, True, False
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.profile_scratch_align = launcher.global_scratch_align = 1
    return launcher


def _as_pointers(args: tuple) -> tuple:
    """A launch's arguments with each tensor as its data pointer: what the C launcher reads of it (``getPointer``)."""
    return tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in args)


def test_direct_relaunch_passes_what_triton_launcher_would(monkeypatch):
    """The direct launch gives the C launcher exactly the arguments ``CudaLauncher`` would (tensor maps and all,
    tensors as their data pointers); a descriptor kept by address builds its tensor map once per kernel metadata,
    one over a tensor every launch (as Triton's)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    kernel, grid, args, kwargs = _gluon_calls(monkeypatch)[0]
    bound = _launch.bind(kernel, args, kwargs)[1]
    q_desc = args[0]
    assert "launch_args" in q_desc.__dict__  # kept by address (forward_sm90.descriptor)
    over_tensor = GluonDescriptor(torch.empty(q_desc.shape, dtype=torch.bfloat16), q_desc.shape, q_desc.strides,
                                  q_desc.block_shape, q_desc.layout)
    arrays, rest = (over_tensor, *bound[1:5]), tuple(bound[5:])
    maps = _TensorMaps()
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(_Driver, "utils", maps, raising=False)
    launches = []
    relaunches = []
    for swizzle in (3, 2):  # two kernels whose metadata for the same descriptors differ
        launcher = _cuda_launcher(lambda *a: launches.append(a), tuple(map(type, arrays)), len(rest), swizzle)
        compiled = _Compiled()
        compiled.run = launcher
        relaunches.append(_launch.Relaunch(kernel, compiled, arrays, rest, 0, (None, None), {}))
        assert relaunches[-1].direct is not None
        launcher(grid[0], 1, 1, 7, "function", "packed", None, None, None, *arrays, *rest)  # Triton's own path
        relaunches[-1].go(grid, arrays)
        assert any(isinstance(x, torch.Tensor) for x in launches[-2])
        assert launches[-1] == _as_pointers(launches[-2]) and len(launches[-1]) == 13 + 4 * (1 + 4 + 4) + 1 + len(rest)
    assert maps.calls == 16 and launches[0][5:7] == (True, False)  # cooperative, not PDL
    maps_at = [13 + 9 * i for i in range(4)]
    assert all(launches[1][i] != launches[3][i] for i in maps_at)  # each kernel its own maps
    for first, relaunch in zip((1, 3), relaunches):  # again: the kept descriptors reuse their maps, kernel by kernel
        relaunch.go(grid, arrays)
        assert launches[-1] == launches[first] and launches[-1][maps_at[0]] is not launches[first][maps_at[0]]
        assert all(launches[-1][i] is launches[first][i] for i in maps_at[1:])
    assert maps.calls == 18


def test_direct_relaunch_of_tensors_calls_the_c_launcher(fake_decode, monkeypatch, capsys):
    """A kernel without descriptors: ``CudaLauncher``'s launch is the C launcher itself (here ``print``, a builtin),
    which the direct launch calls with the same arguments, its tensors as their data pointers (which the C launcher
    takes as they are). It declines tensors off the GPU, whose pointers the C launcher would have refused."""
    jit, grid, args, kwargs, runs, compiled = fake_decode
    bound = _launch.bind(jit, args, kwargs)[1]
    arrays, rest = tuple(bound[:9]), tuple(bound[9:])
    compiled.run = _cuda_launcher(print, tuple(map(type, arrays)), len(rest))
    assert compiled.run.launch is print
    knob_values = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    relaunch = _launch.Relaunch(jit, compiled, arrays, rest, 0, knob_values, {})
    assert relaunch.direct is not None
    compiled.run(grid[0], grid[1], grid[2], 7, "function", "packed", None, None, None, *_as_pointers(arrays), *rest)
    triton_path = capsys.readouterr().out
    relaunch.go(grid, arrays)
    assert capsys.readouterr().out == triton_path and "True False" in triton_path
    assert not relaunch.ready(arrays) and not relaunch(grid, arrays)  # CPU tensors
    assert capsys.readouterr().out == ""


def test_direct_relaunch_declines_scratch_and_other_launchers(monkeypatch):
    kernel, grid, args, kwargs = _gluon_calls(monkeypatch)[0]
    bound = _launch.bind(kernel, args, kwargs)[1]
    arrays, rest = tuple(bound[:5]), tuple(bound[5:])
    compiled = _Compiled()  # its run() is not a CudaLauncher: go() calls it
    assert _launch.Relaunch(kernel, compiled, arrays, rest, 0, (None, None), {}).direct is None
    compiled.run = _cuda_launcher(print, tuple(map(type, arrays)), len(rest))
    compiled.run.global_scratch_size = 64  # scratch is allocated per launch by CudaLauncher.__call__
    assert _launch.Relaunch(kernel, compiled, arrays, rest, 0, (None, None), {}).direct is None
    compiled.run.global_scratch_size = 0
    assert _launch.Relaunch(kernel, compiled, arrays, rest, 0, (None, None), {}).direct is not None
    types = (torch.Tensor, *map(type, arrays[1:]))  # the launcher's descriptors are not where the arrays' are
    compiled.run = _cuda_launcher(print, types, len(rest))
    assert _launch.Relaunch(kernel, compiled, arrays, rest, 0, (None, None), {}).direct is None
