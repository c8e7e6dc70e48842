"""Tile, warp and stage choices as data. Each entry carries the measured reason it was chosen."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Interpreter runs (CPU tensors, TRITON_INTERPRET=1): bigger tiles mean fewer Python-level programs; stages and warps
# have no meaning there.
_INTERPRETER = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)

# H200, bf16/fp16, keyed by padded head dim. Provisional until the sweep in benchmarks/ is recorded.
_FWD_HALF = {
    16: FwdConfig(128, 64, 4, 3),
    32: FwdConfig(128, 64, 4, 3),
    64: FwdConfig(128, 64, 4, 3),
    128: FwdConfig(128, 64, 8, 3),
    256: FwdConfig(64, 64, 4, 2),
}

# fp32 tiles take twice the shared memory and run as ieee fp32 (exactness before speed): smaller tiles.
_FWD_FP32 = {
    16: FwdConfig(64, 32, 4, 2),
    32: FwdConfig(64, 32, 4, 2),
    64: FwdConfig(64, 32, 4, 2),
    128: FwdConfig(64, 32, 4, 2),
    256: FwdConfig(32, 32, 4, 1),
}


def _padded(d: int) -> int:
    p = 16
    while p < d:
        p *= 2
    return p


def fwd_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, causal: bool, device_type: str) -> FwdConfig:
    if device_type != "cuda":
        return _INTERPRETER
    table = _FWD_FP32 if dtype == torch.float32 else _FWD_HALF
    return table[_padded(max(head_dim, head_dim_v))]
