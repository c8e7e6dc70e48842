"""Triton kernels, one module per op."""
