"""Suite-wide hooks: tests marked ``gpu`` are skipped, with a reason, where CUDA is absent; under pytest-xdist on a
machine with several GPUs, worker ``gwN`` makes GPU ``N mod count`` its current device, so ``-n`` spreads the GPU
tests over every visible GPU."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="marked gpu: needs a CUDA device and torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
