"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value), names the argument
and says what was expected and what came. Nothing here touches tensor data, so checks cost no device work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "torch", "triton")


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


def check_scale(softmax_scale, head_dim: int) -> float:
    """Return the softmax scale as a float: ``None`` means ``1/sqrt(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_backend(backend) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_not_yet(name: str, value, default, issue: int) -> None:
    """Reject a keyword whose feature has not landed yet (it is tracked by ``issue``).

    Only plain Python values can equal the default; a tensor or array is rejected without comparing it (its ``==``
    is elementwise), and the message names its type, not its contents.
    """
    if value is default or (type(value) is type(default) and value == default):
        return
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool) and value == default:
        return
    shown = f"a {type(value).__name__}" if hasattr(value, "shape") else repr(value)
    raise NotImplementedError(f"{name}={shown} is not supported yet (tracked by issue #{issue})")


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
