"""Paged attention: the reference against a dense formula, then the CPU torch path and the
Triton kernel (interpreted on CPU) against the reference, over ragged decode / verify /
prefill batches, GQA ratios 1, 3 and 4 (MQA), head dims 64 and 128, fp32/fp16/bf16 and the
KV formats auto, int8, fp8_e4m3, fp8_e5m2."""

import subprocess
import sys

import pytest
import torch

from kernels.attention import paged_attention, paged_attention_ref
from quant.kv import dequantize_kv
from tests.kernels.conftest import TOLERANCES
from tests.kernels.paged_case import make_paged_case

# name -> (seq_lens, q_lens, block_size)
BATCHES = {
    # one-token context, a partial block, a context crossing four blocks
    "decode": ([1, 17, 40], [1, 1, 1], 8),
    # k + 1 = 5 verification rows straddling a block boundary, and ending exactly on one
    "verify": ([23, 16], [5, 5], 8),
    # decode + a whole prompt + a prompt chunk after cached context, in one batch
    "mixed": ([30, 6, 70], [1, 6, 20], 16),
}
CHUNK_BATCH = {"chunk": ([100, 80], [70, 80], 16)}  # q_len >= 64: the CPU path's SDPA branch
FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3, 4 (MQA) at head dims 64 and 128
SHAPES = [(4, 4, 64), (6, 2, 128), (4, 1, 64), (6, 2, 64), (4, 4, 128), (4, 1, 128)]


def _case(batch, fmt, dtype, shape, generator):
    seq_lens, q_lens, block_size = {**BATCHES, **CHUNK_BATCH}[batch]
    num_heads, num_kv_heads, head_dim = shape
    return make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size,
                           dtype, fmt, generator)


def _assert_close(out, ref):
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.cpu(), ref.to(out.dtype), atol=atol, rtol=rtol)


def _dense_attention(case) -> torch.Tensor:
    """Contiguous per-sequence K/V and one masked softmax per sequence, in float64."""
    block_size, num_kv_heads = case.k_cache.shape[1:3]
    group = case.query.shape[1] // num_kv_heads
    outs = []
    for b, seq_len in enumerate(case.seq_lens):
        slots = [int(case.block_tables[b, p // block_size]) * block_size + p % block_size
                 for p in range(seq_len)]
        kv = []
        for cache, scales in ((case.k_cache, case.k_scale), (case.v_cache, case.v_scale)):
            rows = cache.flatten(0, 1)[slots]  # [seq_len, Hkv, D]
            if scales is not None:
                rows = dequantize_kv(rows, scales.flatten(0, 1)[slots])
            kv.append(rows.double().repeat_interleave(group, dim=1).transpose(0, 1))  # [H, S, D]
        q = case.query[case.cu_q_lens[b]:case.cu_q_lens[b + 1]].double().transpose(0, 1)
        q_len = q.shape[1]
        scores = q @ kv[0].transpose(1, 2) * case.scale  # [H, q_len, S]
        causal = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append((scores.softmax(-1) @ kv[1]).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_ref_matches_dense_formula(fmt, generator):
    case = _case("mixed", fmt, torch.float32, (6, 2, 64), generator)
    ref = paged_attention_ref(*case.args(), **case.scales())
    torch.testing.assert_close(ref.double(), _dense_attention(case), atol=1e-5, rtol=1e-5)


CPU_CASES = [(batch, fmt, dtype) for batch in [*BATCHES, *CHUNK_BATCH] for fmt in FORMATS
             for dtype in DTYPES]


@pytest.mark.parametrize("index", range(len(CPU_CASES)),
                         ids=[f"{b}-{f}-{str(d)[6:]}" for b, f, d in CPU_CASES])
def test_cpu_path_matches_ref(index, generator):
    batch, fmt, dtype = CPU_CASES[index]
    shape = SHAPES[index % len(SHAPES)]  # every shape meets every batch and format
    case = _case(batch, fmt, dtype, shape, generator)
    out = paged_attention(*case.args(), **case.scales())
    _assert_close(out, paged_attention_ref(*case.args(), **case.scales()))


# Interpreted Triton costs ~0.1-0.5 s a call: each batch meets each format once and each
# dtype and shape several times, rather than the full product.
TRITON_CASES = [
    (batch, fmt, DTYPES[(i + j) % 3], SHAPES[(i + 2 * j) % len(SHAPES)])
    for i, batch in enumerate(BATCHES) for j, fmt in enumerate(FORMATS)
] + [("verify", "auto", dtype, shape) for dtype in DTYPES for shape in SHAPES[:3]]


@pytest.mark.parametrize("batch,fmt,dtype,shape", TRITON_CASES,
                         ids=[f"{b}-{f}-{str(d)[6:]}-{s[0]}x{s[1]}x{s[2]}" for b, f, d, s in TRITON_CASES])
def test_triton_matches_ref(batch, fmt, dtype, shape, triton_device, generator):
    from kernels.triton_attention import paged_attention_triton

    case = _case(batch, fmt, dtype, shape, generator)
    out = paged_attention_triton(*case.args(triton_device), **case.scales(triton_device))
    _assert_close(out, paged_attention_ref(*case.args(), **case.scales()))


def test_triton_takes_device_metadata(triton_device, generator):
    """seq_lens / cu_q_lens as int32 device tensors, plus max_q_len: no host lists needed."""
    from kernels.triton_attention import paged_attention_triton

    case = _case("verify", "int8", torch.float32, (4, 1, 64), generator)
    query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale = case.args(triton_device)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=triton_device)  # noqa: E731
    out = paged_attention_triton(query, k_cache, v_cache, block_tables, as_tensor(seq_lens),
                                 as_tensor(cu_q_lens), scale, **case.scales(triton_device),
                                 max_q_len=5)
    _assert_close(out, paged_attention_ref(*case.args(), **case.scales()))


def test_cpu_dispatch_never_imports_triton():
    """Importing and calling the kernels on CPU stays free of Triton (and of its import-order
    trap with TRITON_INTERPRET)."""
    code = (
        "import sys, torch\n"
        "from kernels.attention import paged_attention\n"
        "from kernels.kv_store import kv_store\n"
        "k = torch.zeros(2, 4, 1, 64, dtype=torch.int8); s = torch.zeros(2, 4, 1, dtype=torch.bfloat16)\n"
        "kv_store(torch.randn(3, 1, 64), torch.randn(3, 1, 64), k, k.clone(), torch.arange(3), s, s.clone())\n"
        "paged_attention(torch.randn(1, 2, 64), k, k, torch.tensor([[0]], dtype=torch.int32), [3],\n"
        "                [0, 1], 0.125, k_scale=s, v_scale=s)\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def _repo_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[2]
