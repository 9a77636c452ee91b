"""Attention and KV-cache kernels: Triton on CUDA, torch on CPU, each with a plain-torch `_ref`."""
