"""build_batch lays a step's items out as the docstring's worked example says: the flat int64
tensors (slices of one), the int32 block tables padded with zeros, the offsets as lists."""

import torch

from chatserve.batch import BatchItem, build_batch


def test_the_worked_example():
    items = [BatchItem([7, 8, 9], 0, [5], 1), BatchItem([3], 6, [2, 0], 1)]
    batch = build_batch(items, block_size=4)
    assert batch.input_ids.tolist() == [7, 8, 9, 3] and batch.positions.tolist() == [0, 1, 2, 6]
    assert batch.attn.slot_mapping.tolist() == [20, 21, 22, 2]
    assert batch.attn.seq_lens == [3, 7] and batch.attn.cu_q_lens == [0, 3, 4]
    assert batch.logits_indices.tolist() == [2, 3] and batch.cu_logits == [0, 1, 2]
    assert batch.attn.block_tables.tolist() == [[5, 0], [2, 0]] and batch.attn.block_tables.dtype == torch.int32
    for t in (batch.input_ids, batch.positions, batch.attn.slot_mapping, batch.logits_indices):
        assert t.dtype == torch.int64 and t.is_contiguous()


def test_a_mid_prompt_chunk_has_no_logits_and_rows_keep_their_own_values():
    items = [BatchItem([1, 2], 4, (3, 1), 0), BatchItem([5, 6, 7], 1, [0], 2)]  # a tuple of block ids too
    batch = build_batch(items, block_size=4)
    assert batch.logits_indices.tolist() == [3, 4] and batch.cu_logits == [0, 0, 2]
    assert batch.attn.slot_mapping.tolist() == [4, 5, 1, 2, 3]
    batch.input_ids.add_(100)  # the int64 tensors share a storage: writing one leaves the others
    assert batch.positions.tolist() == [4, 5, 1, 2, 3] and batch.attn.slot_mapping.tolist() == [4, 5, 1, 2, 3]
