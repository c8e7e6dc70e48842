"""Peak extra memory of one call, measured rather than computed.

On CUDA it reads the caching allocator's peak (``torch.cuda.max_memory_allocated``). On the CPU it reads the process's
resident-set high-water mark (``VmHWM`` in ``/proc/self/status``) after resetting it through ``/proc/self/clear_refs``,
so the figure counts every page the call touched, whatever allocated it.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in {_STATUS}")


def cpu_peak_supported() -> bool:
    """Whether this OS lets us reset and read the resident-set peak (Linux 4.0+)."""
    try:
        _CLEAR_REFS.write_text("5")
        _status_bytes("VmHWM:")
    except (OSError, RuntimeError):
        return False
    return True


def _release_freed_heap() -> None:
    """Hand freed heap pages back to the OS. glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB)
    resident, so without this an earlier call's buffers count as "already there" and the peak reads too low."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure is then a lower bound
        pass


def peak_extra_bytes(fn, device: torch.device | str = "cpu"):
    """Run ``fn()`` and return ``(result, bytes)``: how far memory rose above where it stood before the call."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    if not cpu_peak_supported():
        raise RuntimeError("measuring CPU peak memory needs Linux's /proc/self/clear_refs")
    _release_freed_heap()
    _CLEAR_REFS.write_text("5")
    before = _status_bytes("VmRSS:")
    result = fn()
    return result, max(0, _status_bytes("VmHWM:") - before)
