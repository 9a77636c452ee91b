"""ModelRunner: Batch -> tensors -> model -> logits, for one model and its KV cache."""

from __future__ import annotations

import torch

from chatserve.batch import Batch, BatchItem, build_batch
from chatserve.kv_cache import KVCache
from chatserve.models.llama import DecoderLM


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [num_logits, vocab] float32, the rows batch.logits_indices asks for."""
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_cache.layers)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def run(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        batch = build_batch(items, self.block_size)
        return self.forward(batch), batch.cu_logits
