"""KVCache: one preallocated tensor pool per model (plus a scale pool when quantized), with
per-layer views. Storage only.

Layout: pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in the storage
dtype (the model dtype for "auto", int8 / float8 otherwise, see quant/kv.py); a quantized cache
also has scales [num_layers, 2, num_blocks, block_size, num_kv_heads] (quant.kv.SCALE_DTYPE).
Layer l's K is pool[l, 0] (scales[l, 0]) and its V pool[l, 1]. The target and the draft each
have one, with the same num_blocks, so one block id addresses both; each may use its own
format. With num_unquantized_layers = n, the first n layers live in a second pool in the model
dtype and the others in the quantized pool (an escape hatch for outlier layers; Qwen2.5's
layer-0 K outlier channels are handled by K smoothing instead, see docs/benchmarks.md). A
quantized cache may also carry per-layer K means (set_key_means, chatserve/kv_smooth.py): the
attention layer subtracts them from post-RoPE K before storing it; they take no pool bytes.
Views are made once here, never per step.

The pool is zeroed when it is made, so its pages are committed (resident) from the start, as
llama.cpp and vLLM hold theirs. torch.empty would map them lazily: the prefix cache keeps freed
blocks' contents and hands out never-used blocks first, so the set of touched pages grows with
traffic until the whole pool is resident. That read as a leak under a soak (issue #15: resident
memory growing ~65 MiB per long conversation on SmolLM2 for hours) and hid the server's real
footprint until then.
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
    num_unquantized_layers: int = 0  # the first n layers keep the model dtype

    def __post_init__(self) -> None:
        if not 0 <= self.num_unquantized_layers <= self.num_layers:
            raise ValueError(f"num_unquantized_layers: must be in [0, {self.num_layers}]")

    @property
    def num_plain_layers(self) -> int:
        """Layers kept out of a quantized pool, in the model dtype (0 for "auto": one pool)."""
        return self.num_unquantized_layers if is_quantized(self.kv_format) else 0

    def bytes_per_block(self, block_size: int) -> int:
        """K, V and (quantized) their scales, all layers: what one block id costs this model."""
        plain = kv_bytes_per_token("auto", self.num_kv_heads, self.head_dim, self.dtype)
        quantized = kv_bytes_per_token(self.kv_format, self.num_kv_heads, self.head_dim, self.dtype)
        num_plain = self.num_plain_layers
        return block_size * (num_plain * plain + (self.num_layers - num_plain) * quantized)


@dataclass(frozen=True)
class FeatureShape:
    """One target feature per block, beside an EAGLE head's KV (chatserve/spec_methods/eagle.py):
    the feature at the block's last position, which the head's row at the next block's first
    position reads when a request starts there from the prefix cache."""

    hidden_size: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return self.hidden_size * self.dtype.itemsize


class LayerCache(NamedTuple):
    """One layer's views into the pool; the scales are None for an unquantized cache."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None
    k_mean: torch.Tensor | None = None  # [num_kv_heads, head_dim] model dtype: K smoothing, or None


class KVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, device: str = "cpu"):
        self.shape = shape
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        num_plain = shape.num_plain_layers
        dims = (2, num_blocks, block_size, shape.num_kv_heads)
        # [num_plain, 2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype
        self.plain_pool = torch.zeros((num_plain, *dims, shape.head_dim), dtype=shape.dtype, device=device)
        # [num_pooled, 2, num_blocks, block_size, num_kv_heads, head_dim] in the storage dtype
        num_pooled = shape.num_layers - num_plain
        self.pool = torch.zeros((num_pooled, *dims, shape.head_dim), dtype=kv_storage_dtype(shape.kv_format, shape.dtype),
                                device=device)
        self.scales = (torch.zeros((num_pooled, *dims), dtype=SCALE_DTYPE, device=device)
                       if is_quantized(shape.kv_format) else None)
        self.layers = [LayerCache(p[0], p[1], None, None) for p in self.plain_pool]
        if self.scales is None:
            self.layers += [LayerCache(p[0], p[1], None, None) for p in self.pool]
        else:
            self.layers += [LayerCache(p[0], p[1], s[0], s[1]) for p, s in zip(self.pool, self.scales)]
        self.key_means: torch.Tensor | None = None

    def set_key_means(self, means: torch.Tensor | None) -> None:
        """K smoothing (chatserve/kv_smooth.py): layer l subtracts means[l] ([num_layers,
        num_kv_heads, head_dim], any float dtype; kept in the model dtype) from its post-RoPE K
        before storing or attending; None turns it off. Layers kept in the model dtype
        (num_plain_layers) get no mean: they stay bit for bit as in an unquantized pool. Call
        on an empty pool only: K already stored would mix two conventions."""
        shape = self.shape
        if means is not None:
            assert means.shape == (shape.num_layers, shape.num_kv_heads, shape.head_dim), means.shape
            means = means.to(device=self.pool.device, dtype=shape.dtype)
        self.key_means = means
        self.layers = [
            layer._replace(k_mean=None if means is None or i < shape.num_plain_layers else means[i])
            for i, layer in enumerate(self.layers)
        ]

    @property
    def num_bytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.nbytes
        return self.plain_pool.nbytes + self.pool.nbytes + scale_bytes


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
