"""bench/rows.py's GPU warm-up: it holds a CUDA device busy for the time asked and frees what it allocated; without
CUDA it does nothing."""

import time

import pytest
import torch

from onlineattn.bench import rows


def test_warm_up_without_cuda_returns_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    start = time.perf_counter()
    rows.warm_up_gpu(5.0)
    assert time.perf_counter() - start < 1.0


@pytest.mark.gpu
def test_warm_up_keeps_the_gpu_busy_and_frees_its_memory():
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    rows.warm_up_gpu(0.2)
    assert time.perf_counter() - start >= 0.2
    assert torch.cuda.memory_allocated() == before
