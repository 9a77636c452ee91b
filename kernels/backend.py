"""Where the engine runs and which kernels run its attention and KV store.

device: "cpu", "cuda", or "auto" (CUDA when torch sees one, else the CPU).
kernels: "torch" (the CPU path: kernels/attention_cpu.py, the C++ decode ops and decode stack),
"triton" (kernels/triton_attention.py, kernels/triton_kv_store.py: paged attention over the
ragged batch and the quantizing KV store), or "auto" (Triton on CUDA, torch on the CPU).
"triton" on the CPU runs the same kernels through Triton's interpreter (TRITON_INTERPRET=1,
set before triton is first imported): slow, but it is how CI proves the GPU path's wiring
without a GPU. The choice travels with each batch (AttnMetadata.kernels), not in a global,
so engines with different kernels can share a process.
"""

from __future__ import annotations

import os

DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "torch", "triton")


def resolve_device(choice: str) -> str:
    """"cpu" or "cuda"; a clear error for "cuda" where torch sees none."""
    import torch  # here, so that chatserve.config can read the choices without importing torch

    if choice not in DEVICES:
        raise ValueError(f"device: one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU wheel)"
        raise ValueError(f"device cuda: torch {torch.__version__} (built with {build}) sees no CUDA device; "
                         "run with --device cpu, or --device auto to use a GPU only when there is one")
    return choice


def resolve_kernels(choice: str, device: str) -> str:
    """"torch" or "triton" for a resolved device; errors for pairs that cannot run."""
    if choice not in KERNELS:
        raise ValueError(f"kernels: one of {', '.join(KERNELS)}, got {choice!r}")
    if choice == "auto":
        return "triton" if device == "cuda" else "torch"
    if choice == "torch" and device == "cuda":
        raise ValueError("kernels torch is the CPU path; on CUDA the attention and KV store are Triton's "
                         "(kernels auto or triton)")
    if choice == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels triton on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 in the "
                         "environment before starting (slow; for testing the GPU path without a GPU)")
    return choice
