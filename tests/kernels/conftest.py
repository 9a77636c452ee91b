"""Kernel-test fixtures. Triton kernels run on CUDA when present, else through the interpreter.

The interpreter must be switched on before `triton` is first imported anywhere in the process
(tests/conftest.py does it for the whole tree; the setdefault below covers running this
directory on its own). If something imported triton earlier, the Triton tests fail with a
clear message instead of a confusing "Cannot call @triton.jit'd outside of the scope".
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# (atol, rtol) for a kernel's output against the fp32 reference cast to the output dtype.
# fp16/bf16 allow a few ulps of values up to ~4: kernels round the softmax weights (and the
# SDPA path the dequantized K/V) to the model dtype, and the interpreter truncates bf16 casts.
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (8e-3, 4e-3),
    torch.bfloat16: (6e-2, 3e-2),
}


@pytest.fixture(scope="session")
def triton_device() -> str:
    """"cuda" with a GPU; else "cpu" once the Triton interpreter is known to be active."""
    if torch.cuda.is_available():
        return "cuda"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.zeros, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: set the variable at the "
                    "very top of tests/conftest.py (and in .ci/run) so no import precedes it")
    return "cpu"
