"""The memory claim, measured: the torch path's peak extra memory is O(N), the textbook's O(N²).

Each measurement runs in a fresh Python process, so pages that earlier tests left with the allocator cannot hide
(or inflate) what a call touches. Both sides run once on a small input first, so loading kernels' code pages is not
counted against whichever runs first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from onlineattn.bench.memory import cpu_peak_supported

pytestmark = pytest.mark.skipif(
    not cpu_peak_supported(), reason="CPU peak memory needs Linux's /proc/self/clear_refs and VmHWM"
)

_MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch
    import onlineattn
    from onlineattn import reference as R
    from onlineattn.bench.memory import peak_extra_bytes

    train = sys.argv[1] == "train"
    sizes = [int(n) for n in sys.argv[2].split(",")]
    which = sys.argv[3].split(",")
    H, D = 4, 64

    def run(impl, q, k, v, do):
        if not train:
            with torch.no_grad():
                return impl(q, k, v)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        impl(*leaves).backward(do)
        return [x.grad for x in leaves]

    impls = {
        "ours": lambda q, k, v: onlineattn.attention(q, k, v, backend="torch"),
        "naive": lambda q, k, v: R.torch_math_attention(q, k, v)[0],
    }
    gen = torch.Generator().manual_seed(0)
    make = lambda n: [torch.randn(1, n, H, D, generator=gen) for _ in range(4)]
    for name in which:  # warm-up: first-use code pages and thread pools
        run(impls[name], *make(300))
    out = {}
    for n in sizes:
        for name in which:
            q, k, v, do = make(n)
            result, extra = peak_extra_bytes(lambda: run(impls[name], q, k, v, do))
            del result, q, k, v, do
            out[f"{name}@{n}"] = extra
    print(json.dumps(out))
    """
)


def _measure(mode: str, sizes, which) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode, ",".join(map(str, sizes)), ",".join(which)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(x: int) -> str:
    return f"{x / 2**20:.1f} MiB"


def test_forward_peak_memory_below_one_twentieth_of_naive():
    """Sq = Sk = 8192, H = 4, d = 64, B = 1, float32, forward."""
    n = 8192
    got = _measure("forward", [n], ["ours", "naive"])
    ours, naive = got[f"ours@{n}"], got[f"naive@{n}"]
    scores = 4 * n * n * 4  # one [H, Sq, Sk] float32 score matrix
    assert naive >= scores, f"naive touched {_mib(naive)}, less than its own score matrix: the measurement is broken"
    assert ours * 20 < naive, f"ours {_mib(ours)} vs naive {_mib(naive)}: ratio 1/{naive / max(ours, 1):.1f}"


def test_training_peak_memory_is_linear_in_length():
    """Forward + backward: ours grows ~2x from N = 2048 to 4096 (O(N)), and stays far below naive's O(N²)."""
    got = _measure("train", [2048, 4096], ["ours"]) | _measure("train", [4096], ["naive"])
    small, big, naive = got["ours@2048"], got["ours@4096"], got["naive@4096"]
    detail = f"ours {_mib(small)} at 2048, {_mib(big)} at 4096; naive {_mib(naive)} at 4096"
    assert naive >= 4 * 4096 * 4096 * 4, f"naive below one score matrix: {detail}"
    assert big < 3 * small, f"ours grew faster than linearly: {detail}"
    assert big * 5 < naive, f"ours is not far below naive: {detail}"
