"""CPU paged-attention timings: the seed implementation (kept below) against kernels.attention.

Not collected by pytest. Run: PYTHONPATH=. python tests/kernels/bench_attention_cpu.py [--threads 1]
Shapes are SmolLM2-135M's (H=9, Hkv=3, D=64, block 16); each number is ms for 30 calls
(one per layer, each layer its own cache, so the working set exceeds L3 at long contexts).
Rounds are interleaved across variants; min and median over rounds are printed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kernels.attention import paged_attention
from kernels.kv_store import kv_store
from quant.kv import SCALE_DTYPE, kv_storage_dtype

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def seed_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale):
    """The first CPU path (gather with cache[blocks], one SDPA with enable_gqa per sequence)."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = cu_q_lens[b], cu_q_lens[b + 1]
        q_len = q_end - q_start
        blocks = block_tables[b, : (seq_len + block_size - 1) // block_size]
        keys = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        values = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            mask = torch.arange(seq_len)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(
            query[q_start:q_end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=num_kv_heads != num_heads)
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def make_case(seq_lens, q_lens, fmt, dtype):
    """Random K/V written through kv_store into shuffled blocks, one cache per layer."""
    blocks_per_seq = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    max_blocks = max(blocks_per_seq)
    order = torch.randperm(num_blocks)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping, used = [], 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[used:used + n]
        used += n
        slot_mapping += [int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                         for p in range(seq_lens[b])]
    slots = torch.tensor(slot_mapping)
    layers = []
    for _ in range(NUM_LAYERS):
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.zeros(shape, dtype=kv_storage_dtype(fmt, dtype))
        v_cache = torch.zeros_like(k_cache)
        scales = {}
        if fmt != "auto":
            scales = {"k_scale": torch.zeros(shape[:3], dtype=SCALE_DTYPE),
                      "v_scale": torch.zeros(shape[:3], dtype=SCALE_DTYPE)}
        kv = torch.randn(2, len(slots), NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        kv_store(kv[0], kv[1], k_cache, v_cache, slots, **scales)
        layers.append((k_cache, v_cache, scales))
    cu_q_lens = [0]
    for q_len in q_lens:
        cu_q_lens.append(cu_q_lens[-1] + q_len)
    query = torch.randn(cu_q_lens[-1], NUM_HEADS, HEAD_DIM, dtype=dtype)
    return query, layers, block_tables, list(seq_lens), cu_q_lens


def step(fn, case):
    query, layers, block_tables, seq_lens, cu_q_lens = case
    for k_cache, v_cache, scales in layers:
        fn(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, 0.125, **scales)


def compare(title, variants, rounds):
    """variants: name -> (fn, case). Prints min / median ms per 30-layer step."""
    times = {name: [] for name in variants}
    for fn, case in variants.values():
        step(fn, case)
    for _ in range(rounds):
        for name, (fn, case) in variants.items():
            start = time.perf_counter()
            step(fn, case)
            times[name].append((time.perf_counter() - start) * 1e3)
    cells = []
    for name, ts in times.items():
        ts.sort()
        cells.append(f"{name} {ts[0]:.1f}/{ts[len(ts) // 2]:.1f}")
    print(f"{title:<34} " + "  ".join(cells), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-seed", action="store_true", help="skip the (slow) seed path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads} load={os.getloadavg()[0]:.2f}; ms per 30 layers, min/median")
    f32 = torch.float32
    for seq_lens, q_lens in [([256], [1]), ([2048], [1]), ([4096], [1]), ([2048], [5]),
                             ([256] * 8, [1] * 8), ([2048] * 8, [1] * 8),
                             ([300, 900, 1500, 2048, 100, 700, 1200, 1800], [1] * 8),
                             ([2048, 2048, 512], [1, 5, 128])]:
        title = f"B={len(seq_lens)} ctx={'<=' if len(set(seq_lens)) > 1 else ''}{max(seq_lens)} q_len={max(q_lens)}"
        variants = {}
        if not args.no_seed:
            variants["seed"] = (seed_paged_attention, make_case(seq_lens, q_lens, "auto", f32))
        variants["fp32"] = (paged_attention, make_case(seq_lens, q_lens, "auto", f32))
        variants["int8"] = (paged_attention, make_case(seq_lens, q_lens, "int8", f32))
        variants["e4m3"] = (paged_attention, make_case(seq_lens, q_lens, "fp8_e4m3", f32))
        variants["e5m2"] = (paged_attention, make_case(seq_lens, q_lens, "fp8_e5m2", f32))
        variants["bf16"] = (paged_attention, make_case(seq_lens, q_lens, "auto", torch.bfloat16))
        compare(title, variants, args.rounds)
    print(f"load={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
