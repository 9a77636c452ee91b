"""Batch: one ragged batch shape for prefill chunks, decodes and verification.

Each sequence adds q_len query tokens at positions [start_pos, start_pos + q_len): a prefill
chunk (q_len = n), a decode (1) or a verification (1 + k drafts). `logits_indices` picks the
rows that need logits: the last `num_logits` rows of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: list[int]  # [batch] context length including the new tokens
    cu_q_lens: list[int]  # [batch + 1] query row offsets
    kernels: str = "torch"  # attention and KV store: "torch" (CPU: C++ ops, torch) or "triton" (kernels/backend.py)

    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """seqs, contexts [num_tokens] int64: each query row's sequence (block_tables row) and
        how many keys it attends to (its causal context)."""
        seqs: list[int] = []
        contexts: list[int] = []
        for b, seq_len in enumerate(self.seq_lens):
            q_len = self.cu_q_lens[b + 1] - self.cu_q_lens[b]
            seqs += [b] * q_len
            contexts += range(seq_len - q_len + 1, seq_len + 1)
        return torch.tensor(seqs, dtype=torch.int64), torch.tensor(contexts, dtype=torch.int64)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttnMetadata
    logits_indices: torch.Tensor  # [num_logits] int64
    cu_logits: list[int]  # [batch + 1] offsets of each sequence's rows in the logits


@dataclass
class BatchItem:
    token_ids: list[int]  # the q_len tokens to feed
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's block table (must cover start_pos + q_len)
    num_logits: int  # how many of the last rows need logits (0 for a mid-prompt chunk)


def build_batch(items: list[BatchItem], block_size: int, device: torch.device | str = "cpu",
                kernels: str = "torch") -> Batch:
    """Lay out `items` into flat tensors. Worked example, block_size 4:
    items = [([7, 8, 9], start 0, blocks [5], 1), ([3], start 6, blocks [2, 0], 1)]
    -> input_ids [7, 8, 9, 3], positions [0, 1, 2, 6], slot_mapping [20, 21, 22, 2],
       seq_lens [3, 7], cu_q_lens [0, 3, 4], logits_indices [2, 3].
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    cu_q_lens = [0]
    logits_indices: list[int] = []
    cu_logits = [0]
    max_blocks = max(len(it.block_ids) for it in items)
    tables: list[list[int]] = []
    for it in items:
        q_len = len(it.token_ids)
        end = it.start_pos + q_len
        assert q_len >= 1 and len(it.block_ids) * block_size >= end, "block table too short"
        input_ids.extend(it.token_ids)
        positions.extend(range(it.start_pos, end))
        slots.extend(it.block_ids[p // block_size] * block_size + p % block_size for p in range(it.start_pos, end))
        seq_lens.append(end)
        row_end = cu_q_lens[-1] + q_len
        logits_indices.extend(range(row_end - it.num_logits, row_end))
        cu_q_lens.append(row_end)
        cu_logits.append(cu_logits[-1] + it.num_logits)
        tables.append([*it.block_ids, *[0] * (max_blocks - len(it.block_ids))])
    # two tensors made, the int64 ones slices of one: each small torch op costs 10-20 us on a step's
    # cold caches (SmolLM2's head builds a batch every draft position; docs/benchmarks.md, session 46)
    flat = torch.tensor(slots + input_ids + positions + logits_indices, dtype=torch.int64, device=device)
    n = len(slots)
    attn = AttnMetadata(flat[:n], torch.tensor(tables, dtype=torch.int32, device=device), seq_lens, cu_q_lens, kernels)
    return Batch(flat[n : 2 * n], flat[2 * n : 3 * n], attn, flat[3 * n :], cu_logits)
