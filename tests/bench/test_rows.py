"""bench/rows.py's GPU warm-up: it holds a CUDA device busy for the time asked and frees what it allocated; without
CUDA it does nothing. And ``time_cold``: the events time the device work, not the host path before it."""

import time

import pytest
import torch

from onlineattn.bench import rows


def test_warm_up_without_cuda_returns_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    start = time.perf_counter()
    assert rows.warm_up_gpu(5.0) == 0
    assert time.perf_counter() - start < 1.0


@pytest.mark.gpu
def test_warm_up_keeps_the_gpu_busy_and_frees_its_memory():
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    x @ x  # cuBLAS keeps its workspace in the caching allocator from the first matmul on: not the warm-up's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    done = rows.warm_up_gpu(0.2)
    elapsed = time.perf_counter() - start
    # 8192^3 bf16 matmuls take about 1.4 ms each on an H200: the time went to them, not to waiting on the host
    assert elapsed >= 0.2 and done >= 8 and done >= 0.5 * elapsed / 2e-3
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_cold_timing_times_the_device_work():
    """80 µs of host work before a launch, longer than do_bench's L2 clear (~66 µs on the H200) but shorter than the
    clear plus the ~100 µs hold, adds nothing to what ``time_cold`` reads; with a longer hold, 400 µs of host work
    adds nothing either (a training step's host path at N = 512 is several hundred µs on the H200 machine)."""

    def slow_host(seconds):
        def call():
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
            torch.cuda._sleep(20_000)
        return call

    # Other processes on the GPU (the suite runs under xdist) time-slice with this one and only ever add time between
    # the events, so each reading is the least of three medians.
    def cold(fn, **kw):
        return min(rows.time_cold(fn, reps=50, **kw) for _ in range(3))

    fast = cold(lambda: torch.cuda._sleep(20_000))
    assert cold(slow_host(80e-6)) < fast + 0.01
    assert cold(slow_host(400e-6), hold_cycles=4_000_000) < fast + 0.01
