"""KVCache: one preallocated tensor per model, with per-layer views. Storage only.

Layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; layer l's K is
pool[l, 0] and its V pool[l, 1]. The target and the draft each have one, with the same
num_blocks, so one block id addresses both. Views are made once here, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int):
        self.shape = shape
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = torch.empty(
            (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim), dtype=shape.dtype
        )
        self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(shape.num_layers)]


def plan_num_blocks(budget_bytes: int, shapes: list[CacheShape], block_size: int) -> int:
    """How many blocks fit in `budget_bytes` when every block holds all models' layers."""
    per_block = sum(s.bytes_per_block(block_size) for s in shapes)
    return budget_bytes // per_block


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
