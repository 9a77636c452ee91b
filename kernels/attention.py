"""Paged attention over a ragged batch: each sequence brings q_len >= 1 new query tokens.

Layout (one layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], in the
model dtype or quantized (int8 / float8, see quant/kv.py) with k_scale, v_scale:
[num_blocks, block_size, num_kv_heads] bfloat16. Sequence b owns query rows
cu_q_lens[b]:cu_q_lens[b+1]; its context is seq_lens[b] tokens (cached + new), stored in blocks
block_tables[b, :ceil(seq_lens[b] / block_size)]. The new tokens sit at positions
[seq_len - q_len, seq_len) and attend causally:

    context  [0 ........................ seq_len)
    queries                    [seq_len - q_len, seq_len)   query i sees keys <= its position

Dispatch (kernels/backend.py): CUDA tensors, or kernels="triton" -> kernels/triton_attention.py
(on CPU tensors that needs Triton's interpreter); anything else -> kernels/attention_cpu.py.
The Triton module is imported lazily, on the first CUDA call: Triton's interpreter
(TRITON_INTERPRET=1, how tests run the kernel on CPU) only works if the variable is set before
`triton` is first imported, so importing `kernels` must not import it.
"""

from __future__ import annotations

import torch

from kernels.attention_cpu import paged_attention_cpu
from quant.kv import kv_format_of


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: list[int],  # [batch] context length including the new tokens
    cu_q_lens: list[int],  # [batch + 1] query row offsets
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] bf16, quantized only
    v_scale: torch.Tensor | None = None,
    kernels: str = "torch",  # "triton": the Triton kernel whatever the device (kernels/backend.py)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of the new tokens over their paged context; CUDA -> Triton, else torch.

    seq_lens and cu_q_lens are Python lists (the runner has them on the host anyway), so the
    CPU path never syncs; the CUDA path copies them to the device (one small copy per call).
    """
    if query.is_cuda or kernels == "triton":
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens,
                                      scale, k_scale, v_scale)
    assert (k_scale is None) == (kv_format_of(k_cache.dtype) == "auto"), (
        "pass k_scale and v_scale with an int8 / float8 cache, and only then")
    return paged_attention_cpu(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                               k_scale, v_scale)


def paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                        k_scale=None, v_scale=None):
    """Token by token, head by head, in fp32: softmax(q . k * scale) . v over visible keys,
    with k = k_stored * k_scale and v = v_stored * v_scale when the cache is quantized."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    for b, seq_len in enumerate(seq_lens):
        q_len = cu_q_lens[b + 1] - cu_q_lens[b]
        for i in range(q_len):
            row = cu_q_lens[b] + i
            pos = seq_len - q_len + i
            slots = [(int(block_tables[b, p // block_size]), p % block_size) for p in range(pos + 1)]
            keys = torch.stack([_load(k_cache, k_scale, blk, off) for blk, off in slots])  # [pos+1, Hkv, D]
            values = torch.stack([_load(v_cache, v_scale, blk, off) for blk, off in slots])
            for h in range(num_heads):
                kh = h // group
                weights = torch.softmax(keys[:, kh] @ query[row, h].float() * scale, dim=0)
                out[row, h] = weights @ values[:, kh]
    return out.to(query.dtype)


def _load(cache, scales, block, offset) -> torch.Tensor:
    """One cached token [num_kv_heads, head_dim] as fp32, dequantized when scales are given."""
    row = cache[block, offset].float()
    return row if scales is None else row * scales[block, offset][:, None]
