"""What this x86 CPU can do, read once from /proc/cpuinfo (empty elsewhere): picks kernels and dtypes."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _first_line(prefix: str) -> str | None:
    """The value of /proc/cpuinfo's first line starting with prefix (the first CPU's), or None."""
    text = _cpuinfo()
    line = next((ln for ln in text.splitlines() if ln.startswith(prefix)), None) if text else None
    return None if line is None else line.split(":", 1)[-1].strip()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    return frozenset((_first_line("flags") or "").split())


def cpu_name() -> str:
    """The CPU's model name, as benchmarks record the machine (platform.processor() where none is given)."""
    return _first_line("model name") or platform.processor()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """bf16 matmuls run in hardware (AVX-512 BF16 or AMX) on this CPU (or one listing `flags`). Without
    it torch emulates them: on an AVX2-only Zen 3 a bf16 GEMM ran at ~18 GFLOP/s against ~100 for fp32
    (benchmarks/int4_kernels.py)."""
    return bool((cpu_flags() if flags is None else flags) & {"avx512_bf16", "amx_bf16"})


AMX_FLAGS = {  # the tile unit with what its kernels here use beside it
    "bf16": frozenset({"amx_tile", "amx_bf16", "avx512_bf16"}),  # attention over a bf16 cache, train-head's step
    "int8": frozenset({"amx_tile", "amx_int8", "avx512_vnni"}),  # the Q4_K matmul from 64 rows
}


def has_amx(kind: str = "bf16", flags: frozenset[str] | None = None) -> bool:
    """The CPU (or `flags`) lists AMX for `kind` ("bf16" or "int8"). The C++ kernels decide for
    themselves (CPUID, XCR0 and Linux's permission for the tile state: amx_enabled(),
    amx_int8_enabled()); this is the same question for Python's choices and the tests."""
    return AMX_FLAGS[kind] <= (cpu_flags() if flags is None else flags)


def default_dtype(quantized_kernels: bool = False) -> str:
    """The activation dtype the CLI uses when none is given: float32 where the C++ int4 / int8
    kernels run the weights (they take float32 activations, and the decode stack, every layer of a
    step in one call, is float32 only: on a Xeon with AVX-512 BF16, Qwen2.5-Coder-1.5B int4 decoded
    in 50 ms at float32 and 63 ms at bfloat16, and prefilled 160 against 125 tokens/s); otherwise
    bfloat16 where the CPU computes it natively (dense weights: half the bytes), else float32."""
    if quantized_kernels:
        return "float32"
    return "bfloat16" if has_native_bf16() else "float32"
