"""KV store: the CPU path and the Triton kernel (interpreted on CPU) write exactly what the
row-by-row reference writes, quantized formats included, and skip slot -1."""

import pytest
import torch

from kernels.kv_store import kv_store, kv_store_ref
from quant.kv import SCALE_DTYPE, dequantize_kv, kv_storage_dtype

NUM_BLOCKS, BLOCK_SIZE = 6, 8


def _inputs(num_tokens, num_kv_heads, head_dim, dtype, generator):
    shape = (num_tokens, num_kv_heads, head_dim)
    key = (torch.randn(shape, generator=generator) * 3).to(dtype)
    value = torch.randn(shape, generator=generator).to(dtype)
    key[1] = 0  # an all-zero row: tiny scale, zeros stored
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens]
    slot_mapping[2] = -1  # padding row: skipped
    return key, value, slot_mapping


def _empty_cache(num_kv_heads, head_dim, cache_dtype, fmt):
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=cache_dtype)
    scales = {}
    if fmt != "auto":
        scales = {"k_scale": torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, dtype=SCALE_DTYPE),
                  "v_scale": torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, dtype=SCALE_DTYPE)}
    return k_cache, k_cache.clone(), scales


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor):
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a.cpu(), b.cpu())


def _store_both(store, fmt, dtype, num_kv_heads, head_dim, generator, device="cpu"):
    """Runs `store` and kv_store_ref on the same inputs; returns both (caches, scales)."""
    key, value, slot_mapping = _inputs(12, num_kv_heads, head_dim, dtype, generator)
    cache_dtype = kv_storage_dtype(fmt, dtype)
    results = []
    for fn, dev in ((store, device), (kv_store_ref, "cpu")):
        k_cache, v_cache, scales = _empty_cache(num_kv_heads, head_dim, cache_dtype, fmt)
        k_cache, v_cache = k_cache.to(dev), v_cache.to(dev)
        scales = {name: s.to(dev) for name, s in scales.items()}
        fn(key.to(dev), value.to(dev), k_cache, v_cache, slot_mapping.to(dev), **scales)
        results.append(((k_cache, v_cache), scales))
    return results


FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_store_matches_ref(fmt, dtype, generator):
    (caches, scales), (ref_caches, ref_scales) = _store_both(kv_store, fmt, dtype, 3, 64, generator)
    for a, b in zip(caches, ref_caches):
        _assert_same_bits(a, b)
    for name in scales:
        _assert_same_bits(scales[name], ref_scales[name])


TRITON_CASES = [
    ("auto", torch.float32, 3, 64),
    ("auto", torch.bfloat16, 2, 128),
    ("int8", torch.float32, 3, 64),
    ("int8", torch.bfloat16, 1, 128),
    ("fp8_e4m3", torch.float16, 2, 64),
    ("fp8_e4m3", torch.float32, 3, 128),
    ("fp8_e5m2", torch.bfloat16, 3, 64),
]


@pytest.mark.parametrize("fmt,dtype,num_kv_heads,head_dim", TRITON_CASES,
                         ids=[f"{f}-{str(d)[6:]}-{h}x{n}" for f, d, h, n in TRITON_CASES])
def test_triton_store_matches_ref(fmt, dtype, num_kv_heads, head_dim, triton_device, generator):
    """Bit-exact: the kernel repeats quantize_kv's fp32 operations (and its rounding)."""
    from kernels.triton_kv_store import kv_store_triton

    (caches, scales), (ref_caches, ref_scales) = _store_both(
        kv_store_triton, fmt, dtype, num_kv_heads, head_dim, generator, triton_device)
    for a, b in zip(caches, ref_caches):
        _assert_same_bits(a, b)
    for name in scales:
        _assert_same_bits(scales[name], ref_scales[name])


def test_ref_store_writes_quantized_rows(generator):
    """kv_store_ref against the formula: cached row * its scale ~= the row written."""
    key, value, slot_mapping = _inputs(12, 2, 64, torch.float32, generator)
    k_cache, v_cache, scales = _empty_cache(2, 64, torch.int8, "int8")
    kv_store_ref(key, value, k_cache, v_cache, slot_mapping, **scales)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK_SIZE)
        for src, cache, s in ((key, k_cache, scales["k_scale"]), (value, v_cache, scales["v_scale"])):
            row = dequantize_kv(cache[block, offset], s[block, offset])
            assert (row - src[i]).abs().max() <= s[block, offset].max() / 2 + 1e-6
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slot_mapping[slot_mapping >= 0]] = False
    assert (k_cache.flatten(0, 1)[untouched] == 0).all()
