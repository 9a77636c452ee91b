"""The Triton kernels compile for real GPU targets (sm80, sm90) without a GPU.

The interpreter accepts things a GPU rejects (tl.dot below 16, fp8e4nv before sm89); this
compiles each kernel variant to PTX in a subprocess where TRITON_INTERPRET is off.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (capability, query dtype, cache dtype, head_dim, group, block_m)
ATTENTION_VARIANTS = [
    (80, "fp16", "fp16", 64, 3, 16),
    (80, "bf16", "i8", 128, 4, 64),
    (80, "fp32", "fp8e5", 64, 1, 16),
    (90, "bf16", "fp8e4nv", 128, 2, 64),
]
STORE_VARIANTS = [(80, "i8", 1), (90, "fp8e4nv", 2)]


def compile_all() -> None:
    """Runs in the subprocess (TRITON_INTERPRET unset)."""
    import triton.language as tl
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton_attention import _paged_attention_kernel
    from kernels.triton_kv_store import _kv_store_kernel

    def build(kernel, types, constexprs, capability):
        names = kernel.arg_names
        signature = dict(zip(names, types)) | {name: "constexpr" for name in constexprs}
        constants = {(names.index(name),): value for name, value in constexprs.items()}
        src = ASTSource(kernel, signature, constexprs=constants)
        assert "ptx" in triton_compile(src, target=GPUTarget("cuda", capability, 32)).asm

    for capability, q_dtype, c_dtype, head_dim, group, block_m in ATTENTION_VARIANTS:
        types = [f"*{q_dtype}"] * 2 + [f"*{c_dtype}"] * 2 + ["*fp32"] * 2 + ["*i32"] * 3
        types += ["fp32"] + ["i32"] * 12
        build(_paged_attention_kernel, types, dict(
            BLOCK_SIZE=16, HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, TILE_N=64,
            IS_QUANTIZED=c_dtype in ("i8", "fp8e5", "fp8e4nv"),
            DOT_DTYPE={"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[q_dtype]), capability)
    for capability, c_dtype, quant in STORE_VARIANTS:
        types = ["*bf16"] * 2 + [f"*{c_dtype}"] * 2 + ["*fp32"] * 2 + ["*i64"] + ["i32"] * 7
        build(_kv_store_kernel, types, dict(
            HEADS=4, HEAD_DIM=64, QUANT=quant, QMAX=127.0, MIN_AMAX=1e-20, MANT_BITS=3,
            MIN_EXP=-6, RINT_MAGIC=12582912.0), capability)


def test_kernels_compile_for_gpu_targets():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = "from tests.kernels.test_triton_compile import compile_all; compile_all()"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
