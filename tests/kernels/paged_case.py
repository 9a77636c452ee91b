"""Random paged-attention inputs: a ragged batch laid out in shuffled cache blocks.

Unused cache slots hold NaN (float caches) or NaN scales (quantized caches), and block-table
entries past a sequence's last block hold -1: a path that reads past seq_len fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_store import kv_store_ref
from quant.kv import SCALE_DTYPE, is_quantized, kv_storage_dtype


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32, -1 past the end
    seq_lens: list[int]
    cu_q_lens: list[int]
    scale: float
    k_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads] SCALE_DTYPE
    v_scale: torch.Tensor | None

    def args(self, device="cpu") -> tuple:
        tensors = (self.query, self.k_cache, self.v_cache, self.block_tables)
        return (*(t.to(device) for t in tensors), self.seq_lens, self.cu_q_lens, self.scale)

    def scales(self, device="cpu") -> dict:
        if self.k_scale is None:
            return {}
        return {"k_scale": self.k_scale.to(device), "v_scale": self.v_scale.to(device)}


def make_paged_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, fmt,
                    generator) -> PagedCase:
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens))
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks nobody owns
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    slots, used = [], 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[used:used + n]
        used += n
        slots += [int(block_tables[b, p // block_size]) * block_size + p % block_size
                  for p in range(seq_lens[b])]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = kv_storage_dtype(fmt, dtype)
    if not is_quantized(fmt):
        k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
        k_scale = v_scale = None
    else:
        k_cache = torch.randint(-128, 128, shape, dtype=torch.int8).view(cache_dtype)
        k_scale = torch.full(shape[:3], float("nan"), dtype=SCALE_DTYPE)
        v_scale = k_scale.clone()
    v_cache = k_cache.clone()
    # Per-token magnitudes vary, so per-token scales matter.
    magnitudes = torch.rand(len(slots), num_kv_heads, 1, generator=generator) * 3 + 0.1
    keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator) * magnitudes
    values = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator) * magnitudes
    kv_store_ref(keys.to(dtype), values.to(dtype), k_cache, v_cache, torch.tensor(slots),
                 k_scale, v_scale)
    cu_q_lens = [0]
    for q_len in q_lens:
        cu_q_lens.append(cu_q_lens[-1] + q_len)
    query = torch.randn(cu_q_lens[-1], num_heads, head_dim, generator=generator).to(dtype)
    return PagedCase(query, k_cache, v_cache, block_tables, list(seq_lens), cu_q_lens,
                     head_dim**-0.5, k_scale, v_scale)
