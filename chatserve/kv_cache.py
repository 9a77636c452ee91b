"""KVCache: one preallocated tensor pool per model (plus a scale pool when quantized), with
per-layer views. Storage only.

Layout: pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in the storage
dtype (the model dtype for "auto", int8 / float8 otherwise, see quant/kv.py); a quantized cache
also has scales [num_layers, 2, num_blocks, block_size, num_kv_heads] (quant.kv.SCALE_DTYPE).
Layer l's K is pool[l, 0] (scales[l, 0]) and its V pool[l, 1]. The target and the draft each
have one, with the same num_blocks, so one block id addresses both; each may use its own
format. Views are made once here, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quant.kv import SCALE_DTYPE, is_quantized, kv_bytes_per_token, kv_storage_dtype


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model dtype
    kv_format: str = "auto"  # quant.kv.KV_FORMATS

    def bytes_per_block(self, block_size: int) -> int:
        """K, V and (quantized) their scales, all layers: what one block id costs this model."""
        per_token = kv_bytes_per_token(self.kv_format, self.num_kv_heads, self.head_dim, self.dtype)
        return self.num_layers * block_size * per_token


class LayerCache(NamedTuple):
    """One layer's views into the pool; the scales are None for an unquantized cache."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None


class KVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int):
        self.shape = shape
        self.num_blocks, self.block_size = num_blocks, block_size
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads)
        self.pool = torch.empty((*dims, shape.head_dim), dtype=kv_storage_dtype(shape.kv_format, shape.dtype))
        self.scales = torch.empty(dims, dtype=SCALE_DTYPE) if is_quantized(shape.kv_format) else None
        self.layers = [self._layer(i) for i in range(shape.num_layers)]

    def _layer(self, i: int) -> LayerCache:
        if self.scales is None:
            return LayerCache(self.pool[i, 0], self.pool[i, 1], None, None)
        return LayerCache(self.pool[i, 0], self.pool[i, 1], self.scales[i, 0], self.scales[i, 1])

    @property
    def num_bytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.nbytes
        return self.pool.nbytes + scale_bytes


def plan_num_blocks(budget_bytes: int, shapes: list[CacheShape], block_size: int) -> int:
    """How many blocks fit in `budget_bytes` when every block holds all models' layers
    (and their scales)."""
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
