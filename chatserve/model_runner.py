"""ModelRunner: Batch -> tensors -> model -> logits, for one model and its KV cache.
HeadRunner: the same for an EAGLE head, which reads target features besides token ids."""

from __future__ import annotations

import itertools
import time

import torch

from chatserve.batch import Batch, BatchItem, build_batch
from chatserve.kv_cache import KVCache
from chatserve.models.eagle_head import EagleHead
from chatserve.models.llama import DecoderLM

FEATURE_NORM_EPS = 1e-6  # of the weightless RMS norm on captured layers (benchmarks/head_features.py's)


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, kernels: str = "torch"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.kernels = kernels  # "torch" | "triton" (kernels/backend.py)
        self.device = kv_cache.device
        # layers whose outputs run_with_features returns before the final feature (an EAGLE-3 head's)
        self.feature_layers: tuple[int, ...] = ()
        self._ones: torch.Tensor | None = None  # the feature norm's weight

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [num_logits, vocab] float32 on the host, the rows batch.logits_indices asks
        for. (On CUDA they are copied over: the sampler, its generators and the grammar masks
        run on the host; sampling on the device is left for when a GPU can measure it.)"""
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_cache.layers)
        return self.model.compute_logits(hidden[batch.logits_indices]).cpu()

    def run(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        batch = build_batch(items, self.block_size, self.device, self.kernels)
        return self.forward(batch), batch.cu_logits

    @torch.inference_mode()
    def run_with_features(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """run(), plus features [num_tokens, (len(feature_layers) + 1) x hidden] for every fed row,
        in the items' order: the residual stream after each of feature_layers, RMS-normalized
        without weights (so they enter an EAGLE-3 head's fuse at one scale), then the final norm's
        output (what the LM head reads). Logits only for the rows asked for."""
        batch = build_batch(items, self.block_size, self.device, self.kernels)
        hidden, features = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_cache.layers,
                                      capture=self.feature_layers, norms=(self._feature_ones(), FEATURE_NORM_EPS))
        return self.model.compute_logits(hidden[batch.logits_indices]).cpu(), batch.cu_logits, features

    def _feature_ones(self) -> torch.Tensor:
        """The weightless feature norm's weight: ones of the hidden size (x 1.0 is exact)."""
        width = self.model.norm.weight.shape[0]
        if self._ones is None or self._ones.shape[0] != width:
            self._ones = torch.ones(width)
        return self._ones


class HeadRunner:
    """An EagleHead with its one-layer cache on the pool's block ids, the target's embedding
    (shared) and block_features [num_blocks, hidden]: per block, the target's feature at its
    last position (kv_cache.FeatureShape)."""

    def __init__(self, head: EagleHead, embed: torch.nn.Module, kv_cache: KVCache, kernels: str = "torch"):
        self.head = head
        self.embed = embed
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.kernels = kernels
        self.device = kv_cache.device
        self.block_features = torch.zeros(kv_cache.num_blocks, head.hidden_size, dtype=kv_cache.shape.dtype,
                                          device=self.device)

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.num_bytes + self.block_features.nbytes

    @torch.inference_mode()
    def input_features(self, raw: torch.Tensor) -> torch.Tensor:
        """The target runner's raw features [rows, width] -> the head's f [rows, hidden] (EagleHead.
        input_features), in the pool's dtype."""
        return self.head.input_features(raw).to(self.block_features.dtype)

    @torch.inference_mode()
    def run(self, items: list[BatchItem], features: torch.Tensor) -> torch.Tensor:
        """items: row i feeds token t_i at position i; features [num_tokens, hidden]: f_{i-1} per
        row, in the items' order -> the head's output before its norm, [num_tokens, hidden]."""
        batch = build_batch(items, self.block_size, self.device, self.kernels)
        embeds = self.embed(batch.input_ids)  # [num_tokens, hidden]
        return self.head(features, embeds, batch.positions, batch.attn, self.kv_cache.layers[0])

    @torch.inference_mode()
    def greedy_chain(self, items: list[BatchItem], features: torch.Tensor, ks: list[int], keep_below: list[float],
                     go_on_below: list[float]) -> tuple[list[list[int]], list[tuple[int, float]]] | None:
        """EagleMethod.propose's greedy chain in one C++ call (DecodeStack.draft_chain): items, one a
        request with its newest token last, and features [rows, hidden] as run() takes them; ks,
        keep_below, go_on_below per request as propose reads them. -> (each request's drafts, each
        forward's (rows, seconds), the first with this call's own glue), or None where the head
        has no C++ path (then propose drafts with the modules)."""
        if not self.head.stack.takes(features, self.kernels):  # features: a row per fed token
            return None
        start = time.perf_counter()
        stack = self.head.chain_stack(self.embed, self.kv_cache.layers[0], self.block_size)
        if stack is None:
            return None
        batch = build_batch(items, self.block_size, self.device, self.kernels)
        last_rows = list(itertools.accumulate(len(it.token_ids) for it in items))
        drafts, counts, rows, seconds = stack.draft_chain(
            batch.input_ids, features, batch.positions, batch.attn.slot_mapping, batch.attn.block_tables,
            [len(it.block_ids) for it in items], *batch.attn.query_rows(), [n - 1 for n in last_rows], ks,
            keep_below, go_on_below)
        seconds[0] += time.perf_counter() - start - sum(seconds)  # build_batch and the call's own
        return [d[:n] for d, n in zip(drafts.tolist(), counts)], list(zip(rows, seconds))
