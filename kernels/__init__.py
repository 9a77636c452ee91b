"""Attention and KV-cache kernels: Triton on CUDA, torch on CPU, each with a plain-torch `_ref`.

Importing this package never imports triton: the Triton modules (triton_*.py) load on the
first CUDA call, so TRITON_INTERPRET can still be set before triton's first import (tests).
"""
