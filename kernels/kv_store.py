"""Scatter new K/V rows into the paged cache by slot mapping, quantizing on the way in.

Layout (one layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in the
model dtype, or int8 / float8 with k_scale, v_scale: [num_blocks, block_size, num_kv_heads]
bfloat16 (quant.kv.SCALE_DTYPE: one scale per token per head, see quant/kv.py).
slot = block_id * block_size + offset; a slot of -1 is skipped.
Dispatch: CUDA, or kernels="triton" -> kernels/triton_kv_store.py (imported lazily, see
kernels/attention.py);
a float32 key into a float32 / float16 / bfloat16 cache on a CPU with the C++ kernels ->
kernels/decode_ops.store_kv; otherwise
torch `index_copy_`.
"""

from __future__ import annotations

import torch

from kernels import decode_ops
from quant.kv import kv_format_of, quantize_kv


def kv_store(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] bf16, quantized only
    v_scale: torch.Tensor | None = None,
    kernels: str = "torch",  # "triton": the Triton kernel whatever the device (kernels/backend.py)
) -> None:
    """Write key/value (and, for an int8/fp8 cache, their per-token-per-head scales) in place."""
    if key.is_cuda or kernels == "triton":
        from kernels.triton_kv_store import kv_store_triton

        return kv_store_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    assert key.shape == value.shape and key.dim() == 3
    assert k_cache.shape[2:] == key.shape[1:], (k_cache.shape, key.shape)
    assert slot_mapping.shape == (key.shape[0],)
    fmt = kv_format_of(k_cache.dtype)
    assert (fmt == "auto") == (k_scale is None), "k_scale/v_scale go with (only) a quantized cache"
    if decode_ops.cache_usable(k_cache) and decode_ops.usable(key, key.shape[-1]) and value.dtype == torch.float32:
        return decode_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)  # skips slots < 0 itself
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = key.shape[1:]
    if fmt != "auto":
        # K and V in one call: half the small ops, which dominate a decode step's store.
        quantized, scales = quantize_kv(torch.stack((key, value)), fmt)  # [2, T, Hkv, D], [2, T, Hkv]
        key, value = quantized
        k_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales[0])
        v_scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales[1])
        # index_copy_ has no float8 kernel on CPU: move the bytes.
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def kv_store_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """One row at a time; obviously right. Quantized rows go through quant.kv.quantize_kv."""
    block_size = k_cache.shape[1]
    fmt = kv_format_of(k_cache.dtype)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = slot // block_size, slot % block_size
        for src, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
            if fmt == "auto":
                cache[block, offset] = src[i]
            else:
                q, s = quantize_kv(src[i : i + 1], fmt)
                cache[block, offset] = q[0]
                scales[block, offset] = s[0]
