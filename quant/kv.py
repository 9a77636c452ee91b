"""KV-cache formats: storage dtype, per-token-per-head quantization, bytes per token.

Formats: "auto" (the model dtype, no scales), "fp32" / "fp16" / "bf16" (that float whatever the
model dtype, no scales: 16 bits are half a float32 model's cache), "int8" (symmetric, scale = amax / 127),
"fp8_e4m3" / "fp8_e5m2" (scale = amax / fmax, saturating). A quantized pool keeps, per layer,
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  kv_storage_dtype(fmt)
  k_scale, v_scale: [num_blocks, block_size, num_kv_heads]            bfloat16 (SCALE_DTYPE)
and x ~= q * scale per (token, head). Knows nothing about blocks or attention.

Scales are bf16, not fp32: with head_dim 64 an fp32 scale adds 6% to an int8 entry, which kept
int8 at 1.88x the bf16 pool's tokens. The scale is rounded to bf16 *before* x is divided by
it, so x ~= q * scale holds for the stored scale itself: the grid moves by at most 2^-8 of
itself, and amax / scale <= qmax * (1 + 2^-8) saturates by less than half an int8 step.
"""

from __future__ import annotations

import torch

KV_FORMATS = ("auto", "fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")
SCALE_DTYPE = torch.bfloat16
# amax is clamped to this before dividing, so an all-zero row gets a tiny scale instead of 0/0.
MIN_AMAX = 1e-20

_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Largest stored magnitude: amax maps onto it.
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
_FORMAT_OF_DTYPE = {dtype: fmt for fmt, dtype in _STORAGE.items()}
# Unquantized formats of a fixed dtype (a cache of them is "auto" to kv_format_of: no scales).
_PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def kv_storage_dtype(fmt: str, model_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The cache tensor's dtype: the model dtype for "auto", the named float, else int8 / float8."""
    _check(fmt)
    return model_dtype if fmt == "auto" else _PLAIN[fmt] if fmt in _PLAIN else _STORAGE[fmt]


def is_quantized(fmt: str) -> bool:
    _check(fmt)
    return fmt in _STORAGE


def kv_format_of(cache_dtype: torch.dtype) -> str:
    """Inverse of kv_storage_dtype: "auto" for any float cache, else the quantized format."""
    return _FORMAT_OF_DTYPE.get(cache_dtype, "auto")


def kv_bytes_per_token(fmt: str, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes one token takes in one layer: K and V, plus their scales when quantized."""
    dtype = kv_storage_dtype(fmt, model_dtype)
    per_tensor = num_kv_heads * head_dim * dtype.itemsize
    if is_quantized(fmt):
        per_tensor += num_kv_heads * SCALE_DTYPE.itemsize
    return 2 * per_tensor


def quantize_kv(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., num_tokens, num_kv_heads, head_dim] -> (q like x in the storage dtype,
    scales: x.shape[:-1] SCALE_DTYPE). Rounds to nearest even; saturates.

    The Triton store kernel (kernels/triton_kv_store.py) reproduces these exact fp32 operations.
    """
    if fmt not in _STORAGE:
        raise ValueError(f"quantize_kv: format must be one of {tuple(_STORAGE)}, got {fmt!r}")
    x = x.float()
    qmax = QMAX[fmt]
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1)  # == abs().amax(-1), one op
    stored_scales = amax.clamp_min_(MIN_AMAX).div_(qmax).to(SCALE_DTYPE)  # [num_tokens, num_kv_heads]
    y = x / stored_scales.float()[..., None]  # divide by the rounded scale
    if fmt == "int8":
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(_STORAGE[fmt])
    return q, stored_scales


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [..., head_dim] int8/float8, scales: [...] -> q * scales in `dtype`."""
    return (q.float() * scales.float()[..., None]).to(dtype)


def kv_to_float(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Fast widening of stored values for the CPU attention path: returns (x fp32, mult) with
    true value == x * mult exactly, so callers fold `mult` into the per-token scales. x is
    contiguous whatever q's strides: pass a transposed view to transpose in the same pass.

    torch's own float8 -> float32 conversion is ~40x slower than int8 -> float32 on the
    target CPU (and a 256-entry lookup table ~30x), so fp8 goes through fp16 bit patterns:
      e5m2 byte  s eeeee mm         == the high byte of the fp16 with the same value;
      e4m3 byte  s eeee mmm  -> fp16 s 0eeee mmm0000000 == value / 2^8 (normals and
                                subnormals alike, since both biases differ by exactly 8).
    The e4m3 NaN code (never written: quantize_kv saturates) would read as 480.
    """
    contiguous = torch.contiguous_format
    if q.dtype == torch.int8 or q.dtype.is_floating_point and q.dtype.itemsize >= 2:
        return q.to(torch.float32, memory_format=contiguous), 1.0
    # sign-extended bytes; in place from here on
    bits = q.view(torch.int8).to(torch.int16, memory_format=contiguous)
    if q.dtype == torch.float8_e5m2:
        return bits.bitwise_left_shift_(8).view(torch.float16).float(), 1.0
    if q.dtype == torch.float8_e4m3fn:
        # << 7 puts eeee mmm at bits 13..7; the sign extension sets bits 15 and 14; the mask
        # 0b1011_1111_1000_0000 keeps the sign in bit 15 and clears bit 14.
        bits.bitwise_left_shift_(7).bitwise_and_(-0x4080)
        return bits.view(torch.float16).float(), 256.0
    raise TypeError(f"kv_to_float: unsupported dtype {q.dtype}")


def _check(fmt: str) -> None:
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV format must be one of {KV_FORMATS}, got {fmt!r}")
