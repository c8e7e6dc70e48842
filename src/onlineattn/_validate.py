"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value), names the argument
and says what was expected and what came. Nothing here touches tensor data, so checks cost no device work, except
``check_kvcache_indices``, which reads the cache lengths and the block table, and ``check_varlen``, which reads the
``cu_seqlens`` offsets (one device-to-host copy each).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace

import torch

from ._mods import UNBOUNDED

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # scale and softcap reach the kernels as float32
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the least normal float32 (GPUs flush smaller ones to 0)
LOG2E = 1.4426950408889634  # the kernels fold it into the scale and the softcap (exp2): float32 must hold the product
BACKENDS = ("auto", "torch", "triton")
PAGE_MULTIPLE = 16  # paged caches: the page size must be a multiple of this (a key block of the decode kernel)
MAX_NUM_SPLITS = 65535  # split-KV decoding launches one program column per split; CUDA caps a grid dim there


@dataclass(frozen=True)
class Dims:
    """Sizes of one attention call: q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def check_tensor(name: str, x, *, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {'nested' if x.is_nested else x.layout} one")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected one of {allowed}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {x.dim()} (shape {tuple(x.shape)})")


def check_qkv(q, k, v) -> Dims:
    """Check q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` and return their sizes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q has {b}, k has {k.shape[0]}, v has {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v must have the same sequence length, got k {k.shape[1]} and v {v.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, got k {k.shape[2]} and v {v.shape[2]}")
    hkv = k.shape[2]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"k has {hkv} heads, which does not divide q's {hq} heads")
    if k.shape[3] != d:
        raise ValueError(f"k's head dim must equal q's: expected {d}, got {k.shape[3]}")
    for name, dim in (("q", d), ("v", v.shape[3])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}'s head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    return Dims(b, sq, k.shape[1], hq, hkv, d, v.shape[3])


def check_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """Return the softmax scale as a float: ``None`` means ``1/sqrt(head_dim)``. ``name``: the caller's keyword. Any
    sign; 0, or a magnitude that stays a normal float32 times log2 e (the kernels' exp2 folds it in; a subnormal one
    flushes to 0 on the GPU)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(softmax_scale).__name__}")
    if softmax_scale and not FLOAT32_TINY <= abs(softmax_scale) <= FLOAT32_MAX / LOG2E:  # NaN fails it too
        raise ValueError(f"{name} must be 0 or finite with a magnitude in [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX / LOG2E:.4g}] (times log2 e a normal float32), got {softmax_scale}")
    return float(softmax_scale)


def positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``(q', scale')`` with ``scale' > 0`` and the same scaled scores, for the kernels, which take a row's maximum
    of the raw scores before scaling (so need ``scale > 0``): ``scale · q·k = |scale| · (−q)·k`` exactly, and scale 0
    gives the scores of ``q · 0`` (all 0: uniform over the visible keys). On q's autograd graph, so dq follows."""
    if scale > 0:
        return q, scale
    return (-q, -scale) if scale < 0 else (q * 0, 1.0)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        kind = type(value)
        shown = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name} must be a Python bool, got {shown}")
    return value


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """A string keyword that takes one of a few names (``backend``, ``layout``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {choices}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_backend(backend) -> str:
    return check_choice("backend", backend, BACKENDS)


def check_unsupported(name: str, value, default, reason: str) -> None:
    """Reject a keyword that an entry point accepts only at its default (``reason`` completes "is not supported").

    Only plain Python values can equal the default; a tensor or array is rejected without comparing it (its ``==``
    is elementwise), and the message names its type, not its contents.
    """
    if value is default or (type(value) is type(default) and value == default):
        return
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool) and value == default:
        return
    if isinstance(default, tuple) and isinstance(value, list) and tuple(value) == default:
        return
    shown = f"a {type(value).__name__}" if hasattr(value, "shape") else repr(value)
    raise NotImplementedError(f"{name}={shown} is not supported {reason}")


def check_not_yet(name: str, value, default, issue: int) -> None:
    """Reject a keyword whose feature has not landed yet (it is tracked by ``issue``)."""
    check_unsupported(name, value, default, f"yet (tracked by issue #{issue})")


# ---- score variants (issue #6) -------------------------------------------------------------------------------------


def check_window(window_size) -> tuple[int, int]:
    """``(left, right)``: two ints, each -1 (unbounded) or >= 0; a side of ``UNBOUNDED`` or more reaches past every
    index, so it is returned as -1 (the kernels' int32 index arithmetic would overflow on it)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    for side, x in zip(("left", "right"), window_size):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"window_size's {side} side must be an int, got {type(x).__name__}")
        if x < -1:
            raise ValueError(f"window_size's {side} side must be -1 (unbounded) or >= 0, got {x}")
    left, right = (-1 if x >= UNBOUNDED else int(x) for x in window_size)
    return left, right


def check_softcap(softcap) -> float:
    """``softcap``: 0 (off), or a normal float32 number that stays one times log2 e (it divides the scores in
    float32: a subnormal one flushes to 0 on the GPU; the kernels multiply it by log2 e)."""
    value = check_nonnegative_float("softcap", softcap)
    if value and not FLOAT32_TINY <= value <= FLOAT32_MAX / LOG2E:
        raise ValueError(f"softcap must be 0 or a normal float32 number, in [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX / LOG2E:.4g}] (times log2 e too), got {value}")
    return value


def check_nonnegative_float(name: str, value, *, below_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0 <= value <= sys.float_info.max or (below_one and value >= 1):  # NaN and huge ints fail too
        raise ValueError(f"{name} must be finite and in [0, {'1)' if below_one else 'inf)'}, got {value}")
    return float(value)


def _check_float_tensor(name: str, x, shapes: list[tuple[int, ...]], device) -> None:
    check_tensor(name, x)
    if tuple(x.shape) not in shapes:
        wanted = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")


def check_alibi_slopes(slopes, batch: int, heads_q: int, device) -> None:
    """``[Hq]`` or ``[B, Hq]`` on q's device; slopes get no gradient (as in flash-attn)."""
    _check_float_tensor("alibi_slopes", slopes, [(heads_q,), (batch, heads_q)], device)
    if torch.is_grad_enabled() and slopes.requires_grad:
        raise NotImplementedError("alibi_slopes has no gradient in onlineattn (fixed slopes, as in flash-attn); "
                                  "pass alibi_slopes.detach(), or an attn_bias, which has one")


def check_sinks(sinks, heads_q: int, device, name: str = "sinks") -> None:
    """One logit per query head (``name``: the caller's keyword)."""
    _check_float_tensor(name, sinks, [(heads_q,)], device)


def check_attn_bias(bias, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device) -> None:
    """Broadcastable to ``[B, Hq, Sq, Sk]``: at most 4 dims, each 1 or the full size (counted from the right)."""
    check_tensor("attn_bias", bias)
    full = (batch, heads_q, seqlen_q, seqlen_k)
    if bias.dim() > 4 or any(n not in (1, want) for n, want in zip(reversed(bias.shape), reversed(full))):
        raise ValueError(f"attn_bias of shape {tuple(bias.shape)} does not broadcast to (B, Hq, Sq, Sk) = {full}: "
                         "each of its dims (counted from the right) must be 1 or the full size")
    if bias.device != device:
        raise ValueError(f"attn_bias must be on q's device {device}, got {bias.device}")


@dataclass(frozen=True)
class VarlenDims:
    """Sizes of one ``attention_varlen`` call: ``batch`` sequences, packed ``total_q`` / ``total_k`` tokens."""

    batch: int
    total_q: int
    total_k: int
    dims: Dims  # as check_qkv gives them for the packed tensors viewed as one batch entry


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> VarlenDims:
    """Packed q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, Dv]``; int32 ``cu_seqlens`` of
    ``B + 1`` offsets on q's device, starting at 0, non-decreasing, ending at the totals; ``max_seqlen_*`` at least
    every sequence's length (the kernels' grid is sized by them). Reads the offsets back to the host once."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=3)
    dims = check_qkv(q[None], k[None], v[None])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, ndim=1, dtypes=(torch.int32,))
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
        if cu.shape[0] == 0:
            raise ValueError(f"{name} must hold B + 1 offsets (at least the leading 0), got an empty tensor")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (B + 1), got {cu_seqlens_q.shape[0]} "
                         f"and {cu_seqlens_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    offsets = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    for name, cu, total, max_len, given in (
        ("cu_seqlens_q", offsets[0], q.shape[0], "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", offsets[1], k.shape[0], "max_seqlen_k", max_seqlen_k),
    ):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if any(n < 0 for n in lengths):
            i = next(i for i, n in enumerate(lengths) if n < 0)
            raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}] = {cu[i + 1]} < {name}[{i}] = {cu[i]}")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal the packed length {total} (dim 0 of "
                             f"{'q' if name.endswith('q') else 'k'}), got {cu[-1]}")
        if lengths and given < max(lengths):
            raise ValueError(f"{max_len} = {given} is less than the longest sequence, {max(lengths)} tokens")
    return VarlenDims(cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], dims)


def check_states(o_a, lse_a, o_b, lse_b) -> None:
    """Check two partial attention states: ``o [B, S, H, D]`` and ``lse [B, H, S]``, each pair of one shape."""
    for name, x, ndim in (("o_a", o_a, 4), ("lse_a", lse_a, 3), ("o_b", o_b, 4), ("lse_b", lse_b, 3)):
        check_tensor(name, x, ndim=ndim)
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have one shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    if o_a.dtype != o_b.dtype:
        raise TypeError(f"o_a and o_b must share one dtype, got {o_a.dtype} and {o_b.dtype}")
    if lse_a.dtype != lse_b.dtype:
        raise TypeError(f"lse_a and lse_b must share one dtype, got {lse_a.dtype} and {lse_b.dtype}")
    b, s, h, _ = o_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != (b, h, s):
            raise ValueError(f"{name} must have shape (B, H, S) = {(b, h, s)}, got {tuple(lse.shape)}")
    devices = {o_a.device, lse_a.device, o_b.device, lse_b.device}
    if len(devices) != 1:
        raise ValueError(f"o_a, lse_a, o_b and lse_b must be on one device, got {sorted(map(str, devices))}")


def check_states_list(os, lses) -> None:
    """Check ``S`` partial states stacked on a leading split dim: ``os [S, B, Sq, H, Dv]``, ``lses [S, B, H, Sq]``."""
    check_tensor("os", os, ndim=5)
    check_tensor("lses", lses, ndim=4)
    splits, b, s, h, _ = os.shape
    if splits == 0:
        raise ValueError("os must hold at least one state (its split dim 0 has size 0)")
    if tuple(lses.shape) != (splits, b, h, s):
        raise ValueError(f"lses must have shape (S, B, H, Sq) = {(splits, b, h, s)}, got {tuple(lses.shape)}")
    if os.device != lses.device:
        raise ValueError(f"os and lses must be on one device, got {os.device} and {lses.device}")


# ---- decoding against a KV cache ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheDims:
    """Sizes of one ``attention_with_kvcache`` call. ``page_size`` is 0 for a contiguous cache ``[B, L_max, Hkv, D]``;
    a paged cache is ``[num_pages, page_size, Hkv, D]``. ``capacity`` is the most tokens one sequence can hold."""

    batch: int
    seqlen_q: int
    seqlen_new: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    page_size: int
    num_pages: int
    capacity: int
    # Stands for the metadata these sizes were checked under (check_kvcache's memo key): a MetaToken, None where it
    # was not memoised. The metadata determines every launch choice that depends on metadata alone, so the launcher
    # keys its own memo with the token, which hashes and compares by identity (no tuple of shapes hashed per call).
    meta_key: object = field(default=None, compare=False, repr=False)


class MetaToken:
    """One entry of check_kvcache's memo: a new token each time the memo learns a metadata key, so two tokens are
    equal only where they stand for the same key (a memo started over gives the same metadata a new token)."""

    __slots__ = ()


def _same_device(**tensors) -> None:
    devices = {name: x.device for name, x in tensors.items() if x is not None}
    if len(set(devices.values())) > 1:
        shown = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {shown}")


_CHECKED_KVCACHE: dict = {}  # metadata of a passing call -> its CacheDims
MAX_CHECKED = 256  # a decoding process sees few shapes; past this the table starts over


def bounded_put(table: dict, key, value, limit: int):
    """``table[key] = value``, emptying the table first where it already holds ``limit`` entries: the per-metadata
    tables of checks and kept launches (shapes a process sees are few; a stream of new ones must not grow them).
    Returns value."""
    if len(table) >= limit:
        table.clear()
    table[key] = value
    return value


def _tensor_meta(x):
    """What the checks read of a tensor argument (``()`` for None); None for anything else, which is checked."""
    if x is None:
        return ()
    if type(x) is not torch.Tensor or x.layout is not torch.strided or x.is_nested:  # subclasses, sparse, nested,
        return None  #                                                                     other types: checked
    return x.shape, x.stride(), x.dtype, x.device


def _same_address(a, b) -> bool:
    """Whether two plain, non-empty tensors start at one address (not read under tracing or functorch transforms,
    where tensors have no storage)."""
    return (type(a) is torch.Tensor and type(b) is torch.Tensor and not a.is_nested and not b.is_nested
            and a.numel() > 0 and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active() and a.data_ptr() == b.data_ptr())


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table) -> CacheDims:
    """Check the tensors of ``attention_with_kvcache`` (shapes, dtypes, devices; an int ``cache_seqlens`` against the
    capacity) and return their sizes. Tensor-valued lengths and page ids are checked by ``check_kvcache_indices``.

    The checks read only metadata, so a call whose metadata (shapes, strides, dtypes, devices, an int length) equals
    that of a call that passed returns the same sizes without repeating them: one decoding step after another costs
    a dictionary lookup (~1 µs) instead of the checks (~7 µs on the CPU machine)."""
    if k is not None and _same_address(k_cache, v_cache):  # only writes need them apart; reads may share memory
        raise ValueError("k_cache and v_cache must be separate memory when k and v are written into them, got views "
                         "that start at the same address")
    metas = tuple([_tensor_meta(x) for x in (q, k_cache, v_cache, k, v, block_table)])
    seqlens = cache_seqlens if type(cache_seqlens) is int else _tensor_meta(cache_seqlens)
    key = None if None in metas or seqlens is None else (metas, seqlens)
    dims = _CHECKED_KVCACHE.get(key) if key is not None else None
    if dims is None:
        dims = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        if key is not None:
            dims = bounded_put(_CHECKED_KVCACHE, key, replace(dims, meta_key=MetaToken()), MAX_CHECKED)
    return dims


def _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table) -> CacheDims:
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, x, ndim=4)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype} and {v_cache.dtype}")
    b, sq, hq, d = q.shape
    paged = block_table is not None
    if paged:
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must have one row per sequence: q has batch {b}, block_table has "
                             f"{block_table.shape[0]} rows")
        num_pages, page_size = k_cache.shape[:2]
        if page_size == 0 or page_size % PAGE_MULTIPLE:
            raise ValueError(f"k_cache's page size (dim 1 of a paged cache) must be a positive multiple of "
                             f"{PAGE_MULTIPLE}, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        num_pages, page_size, capacity = 0, 0, k_cache.shape[1]
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache must have q's batch size {b} (dim 0 of a contiguous cache), got "
                             f"{k_cache.shape[0]}; pass block_table for a paged cache")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in its first three dims: k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"k_cache has {hkv} heads, which does not divide q's {hq} heads")
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache's head dim must equal q's: expected {d}, got {k_cache.shape[3]}")
    dv = v_cache.shape[3]
    for name, dim in (("q", d), ("v_cache", dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}'s head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim (it is written in place, so it cannot be "
                             f"copied), got strides {x.stride()}")
    new = _check_new_tokens(k, v, b, hkv, d, dv, k_cache.dtype)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if new and any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride())):  # expanded: a write lands many times
            raise ValueError(f"{name} takes k and v's tokens in place, so its elements must not share memory, got "
                             f"shape {tuple(x.shape)} with strides {x.stride()}")
    if new > capacity:
        raise ValueError(f"k has {new} new tokens, more than the cache holds ({capacity} tokens a sequence)")
    _same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                 cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None)
    _check_cache_seqlens(cache_seqlens, b, new, capacity)
    return CacheDims(b, sq, new, hq, hkv, d, dv, page_size, num_pages, capacity)


def _check_new_tokens(k, v, b: int, hkv: int, d: int, dv: int, dtype) -> int:
    """k ``[B, S_new, Hkv, D]`` and v ``[B, S_new, Hkv, Dv]``, both or neither, in the cache's dtype; returns S_new."""
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise ValueError(f"k and v are new tokens and come together: {given} was given, {missing} is None")
    if k is None:
        return 0
    check_tensor("k", k, ndim=4, dtypes=(dtype,))
    check_tensor("v", v, ndim=4, dtypes=(dtype,))
    new = k.shape[1]
    for name, x, want in (("k", k, (b, new, hkv, d)), ("v", v, (b, new, hkv, dv))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape (B, S_new, Hkv, {'D' if name == 'k' else 'Dv'}) = {want}, "
                             f"got {tuple(x.shape)}")
    return new


def _check_cache_seqlens(cache_seqlens, b: int, new: int, capacity: int) -> None:
    if isinstance(cache_seqlens, torch.Tensor):
        check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,))
        if tuple(cache_seqlens.shape) != (b,):
            raise ValueError(f"cache_seqlens must have shape (B,) = ({b},), got {tuple(cache_seqlens.shape)}")
        return
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape ({b},), got "
                        f"{type(cache_seqlens).__name__}")
    if not 0 <= cache_seqlens <= capacity - new:
        raise ValueError(f"cache_seqlens = {cache_seqlens} with {new} new tokens does not fit the cache: expected "
                         f"0 <= cache_seqlens <= {capacity - new} (capacity {capacity} tokens)")


def check_kvcache_indices(cache_seqlens, block_table, dims: CacheDims) -> int:
    """Check the values of ``cache_seqlens`` (in ``[0, capacity − S_new]``) and of the block-table entries that the
    call uses (the first ``ceil((cache_seqlens[b] + S_new) / page_size)`` of row b, in ``[0, num_pages)``), before any
    kernel runs. Unused entries may hold anything (-1 padding, say). Reads the data with one device-to-host copy.

    Returns the longest key length ``max(cache_seqlens) + S_new``.
    """
    if dims.batch == 0:
        return 0
    lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if lens is None and block_table is None:
        return cache_seqlens + dims.seqlen_new  # an int was checked on the host already
    device = block_table.device if lens is None else lens.device
    lens = torch.full((dims.batch,), cache_seqlens, device=device) if lens is None else lens.long()
    stats = [lens.min(), lens.max()]
    if block_table is not None:
        pages_used = (lens.clamp(0, dims.capacity - dims.seqlen_new) + dims.seqlen_new + dims.page_size - 1) // dims.page_size
        used = torch.arange(block_table.shape[1], device=device)[None, :] < pages_used[:, None]
        bad_pages = used & ((block_table < 0) | (block_table >= dims.num_pages))
        stats.append(bad_pages.sum())
    lo, hi, *n_bad = torch.stack(stats).tolist()
    if lo < 0 or hi > dims.capacity - dims.seqlen_new:
        i = int(((lens < 0) | (lens > dims.capacity - dims.seqlen_new)).nonzero()[0, 0])
        raise ValueError(f"cache_seqlens[{i}] = {int(lens[i])} with {dims.seqlen_new} new tokens does not fit the "
                         f"cache: expected 0 <= cache_seqlens <= {dims.capacity - dims.seqlen_new} "
                         f"(capacity {dims.capacity} tokens)")
    if n_bad and n_bad[0]:
        i, j = (int(x) for x in bad_pages.nonzero()[0])
        raise ValueError(f"block_table[{i}, {j}] = {int(block_table[i, j])} is not a page of k_cache, which has "
                         f"{dims.num_pages} pages (valid ids 0..{dims.num_pages - 1}); sequence {i} uses its first "
                         f"{int(pages_used[i])} entries")
    return hi + dims.seqlen_new


def check_num_splits(num_splits) -> int:
    """``0`` chooses automatically; otherwise the number of key chunks per (sequence, kv head)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be between 0 (automatic) and {MAX_NUM_SPLITS}, got {num_splits}")
    return num_splits
