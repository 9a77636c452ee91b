"""CPU paged attention in torch: the engine's hot path when there is no GPU.

Same layout and contract as kernels/attention.py. What makes it fast here (numbers from
tests/kernels/bench_attention_cpu.py in the module docstring there):
- `index_select` on the block dim gathers a sequence's blocks 4-10x faster than `cache[blocks]`;
- two `bmm`s with the GQA group folded into the rows replace SDPA, whose q_len == 1 path
  costs ~10x more here;
- quantized caches are never dequantized: the gathered int8/fp8 values are widened
  (`quant.kv.kv_to_float`, transposing to [Hkv, S, D] in the same pass) and the per-token
  scales are folded into the scores (q . k_int8 * k_scale) and into the softmax weights
  before P . V. That reads 4x fewer cache bytes, so int8 beats fp32 from ~1k tokens on.
Chunks of q_len >= PREFILL_Q_LEN use SDPA, whose tiles bound the memory the [Hkv, rows, S]
score matrix of the bmm path would take (speed was measured on par), except over a bfloat16
cache on a CPU with AMX: there the C++ rows multiply on the tile unit in ~0.4x SDPA's time, and
a prefill's rows get exactly the numbers its decode rows would (decode_ops.tiles_attend).

With a float32 query, a float32 / float16 / bfloat16 cache and the C++ kernels built, every
sequence with fewer than PREFILL_Q_LEN rows goes instead through
kernels/decode_ops.paged_attention_rows in one call:
one query row per (row, kv head), reading the blocks in place (no gather, no transposed copy).
Each row sees exactly its causal context, so a verification row is computed as its decode step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import decode_ops
from quant.kv import kv_to_float

# From this many query rows on, use SDPA (bounded memory) instead of materialized scores.
PREFILL_Q_LEN = 64
# Up to this many query rows (k + 1 of a verification), attend row by row like decode does.
ROW_BY_ROW_Q_LEN = 9


def paged_attention_cpu(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                        k_scale=None, v_scale=None) -> torch.Tensor:
    """Arguments as kernels.attention.paged_attention; returns [num_tokens, num_heads, head_dim].

    One gather and two bmms per sequence. Padding all decodes into one masked batch was
    measured slower at every size (8 x 256 to 8 x 2048 tokens): the padded gather of the
    whole batch no longer fits in cache, while one sequence's context does.
    """
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if k_scale is None and decode_ops.cache_usable(k_cache) and decode_ops.usable(query, query.shape[-1]):
        return _rows_in_cpp(out, query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = cu_q_lens[b], cu_q_lens[b + 1]
        keys, values, k_mults, v_mults = _gather(
            k_cache, v_cache, k_scale, v_scale, block_tables[b], seq_len)
        _attend(out[q_start:q_end], query[q_start:q_end], keys, values, k_mults, v_mults, scale)
    return out


def _rows_in_cpp(out, query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale) -> torch.Tensor:
    """Sequences with q_len < PREFILL_Q_LEN: all their rows in one C++ call; longer chunks: SDPA,
    unless the rows run on the AMX tiles (decode_ops.tiles_attend), where every row goes to C++."""
    seqs, contexts, rows = [], [], []
    tiles = None  # asked only when a chunk is long (not on decode steps)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = cu_q_lens[b], cu_q_lens[b + 1]
        q_len = q_end - q_start
        if q_len >= PREFILL_Q_LEN and tiles is None:
            tiles = decode_ops.tiles_attend(k_cache, query.shape[-1])
        if q_len >= PREFILL_Q_LEN and not tiles:
            keys, values, _, _ = _gather(k_cache, v_cache, None, None, block_tables[b], seq_len)
            _attend(out[q_start:q_end], query[q_start:q_end], keys, values, None, None, scale)
            continue
        seqs += [b] * q_len
        contexts += range(seq_len - q_len + 1, seq_len + 1)
        rows += range(q_start, q_end)
    if not rows:
        return out
    if len(rows) == query.shape[0]:  # every row (the usual decode / verification step)
        return decode_ops.paged_attention_rows(query.contiguous(), k_cache, v_cache, block_tables, seqs, contexts,
                                               scale, out=out)
    index = torch.tensor(rows)
    out[index] = decode_ops.paged_attention_rows(query[index].contiguous(), k_cache, v_cache, block_tables, seqs,
                                                 contexts, scale)
    return out


def _gather(k_cache, v_cache, k_scale, v_scale, block_table, seq_len):
    """One sequence's context: keys, values [Hkv, seq_len, D] float32 (widened, not scaled)
    and k_mults, v_mults [Hkv, seq_len] float32, or None when the cache is not quantized.

    A float32 cache comes back as a strided view of the gathered copy: another transposing
    copy costs more than the bmm gains from it. Widening (int8, fp8, bf16) writes a new tensor
    anyway, so it also transposes to [Hkv, S, D] contiguous, which the bmms read ~1.7x faster.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks]
    keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    if k_scale is None:
        if keys.dtype != torch.float32:
            keys, values = kv_to_float(keys)[0], kv_to_float(values)[0]
        return keys, values, None, None
    keys, k_mult = kv_to_float(keys)
    values, v_mult = kv_to_float(values)
    k_mults = k_scale.index_select(0, blocks).view(-1, num_kv_heads)[:seq_len].t().float()
    v_mults = v_scale.index_select(0, blocks).view(-1, num_kv_heads)[:seq_len].t().float()
    if k_mult != 1.0:  # e4m3 widening reads value / 2^8
        k_mults, v_mults = k_mults * k_mult, v_mults * v_mult
    return keys, values, k_mults, v_mults


def _attend(out, query, keys, values, k_mults, v_mults, scale) -> None:
    """out, query [q_len, H, D] at positions [S - q_len, S) over keys/values [Hkv, S, D]."""
    q_len, num_heads, head_dim = query.shape
    num_kv_heads, seq_len = keys.shape[:2]
    group = num_heads // num_kv_heads
    if q_len >= PREFILL_Q_LEN:
        out.copy_(_attend_sdpa(query, keys, values, k_mults, v_mults, scale))
        return
    if q_len <= ROW_BY_ROW_Q_LEN and q_len > 1:
        # Verification rows one at a time, each exactly as the decode step for that position
        # would compute it (same shapes, same kernels): otherwise a different bmm blocking
        # rounds differently, which in bf16 flips greedy near-ties between spec on and off.
        for i in range(q_len):
            ctx = seq_len - q_len + i + 1
            _attend(out[i : i + 1], query[i : i + 1], keys[:, :ctx], values[:, :ctx],
                    None if k_mults is None else k_mults[:, :ctx],
                    None if v_mults is None else v_mults[:, :ctx], scale)
        return
    # Row i * group + g of kv head kh's matrix is (query i, head kh * group + g).
    q = (query.float() * scale).view(q_len, num_kv_heads, group, head_dim)
    if q_len > 1:
        q = q.transpose(0, 1)
    q = q.reshape(num_kv_heads, q_len * group, head_dim)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [Hkv, q_len*G, S]
    if k_mults is not None:
        scores.mul_(k_mults[:, None, :])
    if q_len > 1:
        scores.masked_fill_(_hidden_keys(q_len, seq_len, group), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if v_mults is not None:
        probs.mul_(v_mults[:, None, :])
    if q_len == 1 and out.dtype == torch.float32:  # rows are already out's layout
        torch.bmm(probs, values, out=out.view(num_kv_heads, group, head_dim))
        return
    rows = torch.bmm(probs, values)  # [Hkv, q_len*G, D]
    out.copy_(rows.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(out.shape))


def _attend_sdpa(query, keys, values, k_mults, v_mults, scale) -> torch.Tensor:
    """Long chunks, in the query dtype: dequantize the gathered context once (amortized
    over q_len rows); keys, values [Hkv, S, D]."""
    q_len, seq_len = query.shape[0], keys.shape[1]
    if k_mults is not None:
        keys = keys * k_mults[..., None]
        values = values * v_mults[..., None]
    # 4-D, with a batch of one: given 3-D tensors, torch takes its math backend (scores
    # materialized, ~3x slower: 86 vs 27 ms a layer for a 512-row chunk over 2k keys, SmolLM2's
    # shape); 4-D ones take the flash kernel, which also reads the kv heads in place (enable_gqa).
    q = query.transpose(0, 1)[None]  # [1, H, q_len, D]
    k, v = keys.to(query.dtype)[None], values.to(query.dtype)[None]  # [1, Hkv, S, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(q_len, seq_len), scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


@functools.lru_cache(maxsize=64)
def _hidden_keys(q_len: int, seq_len: int, group: int) -> torch.Tensor:
    """[q_len * group, seq_len] bool, True where row i * group + g must not look. Cached: all
    layers of a step ask for the same masks (read-only use)."""
    return ~_causal_mask(q_len, seq_len).repeat_interleave(group, dim=0)


def _causal_mask(q_len: int, seq_len: int) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query i (at position seq_len - q_len + i) may look."""
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    return torch.arange(seq_len)[None, :] <= q_pos
