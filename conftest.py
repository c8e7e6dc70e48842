"""Root pytest setup. Without a GPU, Triton kernels run under its interpreter: TRITON_INTERPRET must be set before
triton is first imported, and doctest collection of src/ imports it, so it is set here, ahead of everything."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
