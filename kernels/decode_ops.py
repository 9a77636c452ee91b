"""The decode step's small operations in C++ (kernels/decode_ops_cpu.cpp), with plain-torch references.

A batch-1 decode step of Qwen2.5-1.5B spent ~30 ms of ~87 outside its weight matmuls, in ~20
small torch ops per layer, each costing microseconds of dispatch and an OpenMP region for a few
kilobytes of work: RMSNorm alone took ~95 us a call (benchmarks/decode_step.py --profile). Here
each is one call: RMSNorm (optionally adding the residual first), rotate-half RoPE in place,
the KV store, SiLU(gate) * up, and one-query-row paged attention that reads the cache blocks in
place instead of gathering the context into a new tensor per layer.

All of them take float32 activations only (`usable`), and the KV store and attention a float32,
float16 or bfloat16 cache (`cache_usable`): other dtypes, quantized KV caches and CUDA tensors take
the torch paths in models/layers.py and kernels/attention_cpu.py, which are also the references
the tests hold these against. Each op computes a row the same way whatever the row count, so
verification rows equal decode rows bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ext


# DecodeStack (kernels/decode_stack_cpu.cpp): the decoder's layers in one call for steps of up to
# STACK_MAX_ROWS float32 rows; a linear layer is (kind, a, b, c, bias), kinds as below.
STACK_MAX_ROWS = 32
LINEAR_INT4, LINEAR_Q4K, LINEAR_F32, LINEAR_INT8, LINEAR_INT8X8, LINEAR_INT4X8 = range(6)
NO_TENSOR = torch.empty(0)


def decode_stack(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                 cos: torch.Tensor, sin: torch.Tensor):
    """An empty DecodeStack; add_layer(ln1, ln2, k_cache, v_cache, [qkv, o, gate_up, down]) fills it
    and forward(x, positions, slot_mapping, block_tables, seqs, contexts) runs it."""
    return cpu_ext.extension().DecodeStack(num_heads, num_kv_heads, head_dim, eps, scale, cos, sin)


def usable(x: torch.Tensor, *dims: int) -> bool:
    """Whether the C++ ops take this activation: float32, on the CPU, with the extension built,
    and the given sizes (hidden, head dim, intermediate) multiples of 16 (whole AVX2 vectors)."""
    return (x.dtype == torch.float32 and not x.is_cuda and all(d % 16 == 0 for d in dims)
            and cpu_ext.is_available())


# Unquantized KV cache dtypes the C++ store and attention read and write (16 bits: half the
# bytes a long context's attention reads; widened to float32 exactly before any arithmetic).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cache_usable(cache: torch.Tensor) -> bool:
    """Whether the C++ KV store and attention take this (unquantized) cache."""
    return cache.dtype in CACHE_DTYPES and not cache.is_cuda and cache.is_contiguous()


def tiles_attend(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether paged_attention_rows over this cache runs on the AMX tiles (the extension's own
    condition: a bfloat16 cache in blocks of 16+ keys, head_dim % 32 == 0, AMX on). There a prefill chunk's
    rows cost ~0.4x SDPA's over the widened context (Qwen 1.5B's shape, 256 rows at 2k keys: 7.0
    against 16.4 ms a layer) and equal the decode rows' numbers."""
    return cpu_ext.is_available() and cpu_ext.extension().attention_on_tiles(cache, head_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.rms_norm over the last dim in float32; with `residual`, x += residual (in place) first."""
    return cpu_ext.extension().rms_norm(x, weight, eps, residual)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x += residual
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    return cpu_ext.extension().silu_mul(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on heads [0, heads) of x [T, N, D] (x[t] may be strided, heads
    contiguous); cos, sin [max_positions, D/2], positions [T] int64."""
    cpu_ext.extension().rope_(x, heads, positions, cos, sin)


def rope_ref(x: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    a, b = x[:, :heads, :half], x[:, :heads, half:]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    a_new, b_new = a * c - b * s, b * c + a * s
    a.copy_(a_new)
    b.copy_(b_new)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] float32 into caches [num_blocks, block_size, Hkv, D] (CACHE_DTYPES,
    rounded as .to(dtype) rounds) at slots (block * block_size + offset; < 0 skipped).
    kernels/kv_store.kv_store_ref is the reference."""
    cpu_ext.extension().store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seqs: list[int], contexts: list[int], scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = attention of query row t [H, D] over the first contexts[t] tokens of sequence
    seqs[t]'s blocks (block_tables row) in caches of one of CACHE_DTYPES; query, out [T, H, D].
    kernels/attention.paged_attention_ref is the reference (with one row per causal position).
    A bfloat16 cache on a CPU with AMX multiplies on the tile unit, the query and the attention
    weights rounded to bfloat16 (cpu_ext.extension().set_amx(False) keeps the float32 loops)."""
    if out is None:
        out = torch.empty_like(query)
    cpu_ext.extension().paged_attention_rows(out, query, k_cache, v_cache, block_tables,
                                             torch.tensor(seqs, dtype=torch.int64),
                                             torch.tensor(contexts, dtype=torch.int64), scale)
    return out
