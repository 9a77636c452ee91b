"""K smoothing for quantized KV caches, as in SageAttention (arXiv:2410.02367): subtract a fixed
per-(layer, KV head, channel) mean m from post-RoPE K before it is stored or attended to.

Lossless: a query q scores key j as q.(k_j - m) = q.k_j - q.m, and q.m is the same for every key
that q attends to, so softmax (invariant to a common shift) gives exactly the same weights. V is
untouched. What it buys: Qwen2.5's K has large *constant* channels (layer 0: entries ~300 in
rows whose median magnitude is ~1.4, docs/benchmarks.md), and one scale per token per head
is set by them, so int8/fp8 round the rest of the row coarsely. Minus the mean, those channels
are near 0 and the scale fits the signal.

m is calibrated once per model (and kept on it, so engines sharing the weights share it): the
mean of post-RoPE K over the first CALIBRATION_TOKENS tokens of chatserve/data/kv_calibration.txt
(prose, chat and code; not the quality benchmark's eval_text.txt), run through the model with a
small scratch pool in the model dtype. The engine's own pool and block manager are not touched.
Only quantized caches smooth (smoothed_kv_cache); "auto" pools keep the exact unsmoothed path.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from chatserve.batch import BatchItem
from chatserve.kv_cache import CacheShape, KVCache
from chatserve.model_runner import ModelRunner
from quant.kv import is_quantized

CALIBRATION_TEXT = Path(__file__).parent / "data" / "kv_calibration.txt"
CALIBRATION_TOKENS = 256


def calibration_ids(tokenizer) -> list[int]:
    """The calibration tokens: the start of kv_calibration.txt in `tokenizer`'s ids."""
    return tokenizer.encode(CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]


@torch.inference_mode()
def compute_key_means(model, token_ids: list[int], dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """-> [num_layers, num_kv_heads, head_dim] fp32: the mean post-RoPE K of `token_ids` fed at
    positions 0.. in one prefill, read back from a scratch model-dtype pool."""
    n = len(token_ids)
    assert n >= 1
    num_blocks = -(-n // block_size)
    shape = CacheShape(model.num_layers, model.num_kv_heads, model.head_dim, dtype)  # "auto": plain K
    device = next(model.buffers(), torch.empty(0)).device  # a quantized embedding has no .weight
    cache = KVCache(shape, num_blocks, block_size, device)
    ModelRunner(model, cache, "triton" if device.type == "cuda" else "torch").run([BatchItem(list(token_ids), 0, list(range(num_blocks)), 1)])
    k = cache.pool[:, 0].reshape(model.num_layers, num_blocks * block_size, model.num_kv_heads, model.head_dim)
    return k[:, :n].float().mean(dim=1)


def key_means(model, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """compute_key_means, memoized on the model object (benchmarks build many engines on one
    copy of the weights). The seconds the computation took are in model.kv_key_means_seconds."""
    key = (tuple(token_ids), dtype)
    memo = getattr(model, "_kv_key_means", None)
    if memo is None or memo[0] != key:
        start = time.perf_counter()
        means = compute_key_means(model, token_ids, dtype)
        model.kv_key_means_seconds = time.perf_counter() - start
        model._kv_key_means = memo = (key, means)
    return memo[1]


def wants_smoothing(shape: CacheShape, smooth_keys: bool) -> bool:
    """Smooth a quantized cache that has at least one quantized layer, if asked to."""
    return smooth_keys and is_quantized(shape.kv_format) and shape.num_plain_layers < shape.num_layers


def smoothed_kv_cache(model, shape: CacheShape, num_blocks: int, block_size: int, smooth_keys: bool,
                      token_ids: list[int], device: str = "cpu") -> KVCache:
    """A KVCache for `model`; quantized (and smooth_keys) -> with the model's calibrated K means
    on its quantized layers (layers kept in the model dtype stay unsmoothed, see
    KVCache.set_key_means)."""
    cache = KVCache(shape, num_blocks, block_size, device)
    if wants_smoothing(shape, smooth_keys):
        cache.set_key_means(key_means(model, token_ids, shape.dtype))
    return cache


def smoothed_kv_caches(models, shapes: list[CacheShape], num_blocks: int, block_size: int, smooth_keys: bool,
                       tokenizer, device: str = "cpu") -> list[KVCache]:
    """smoothed_kv_cache for each (model, shape) pair (the target's, then the draft's); the
    calibration text is tokenized only when some cache smooths."""
    calib = calibration_ids(tokenizer) if any(wants_smoothing(s, smooth_keys) for s in shapes) else []
    return [smoothed_kv_cache(m, s, num_blocks, block_size, smooth_keys, calib, device) for m, s in zip(models, shapes)]
