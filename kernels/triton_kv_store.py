"""Triton KV store with fused quantization (CUDA; on CPU only under TRITON_INTERPRET=1).

Same contract and layout as kernels/kv_store.py, whose `kv_store` dispatches here for CUDA
tensors; the reference is `kernels.kv_store.kv_store_ref`. One program writes one token's K
(or V, grid axis 1) for all kv heads; when the cache is int8 / float8 it computes the
per-head scale amax / qmax, stores it in k_scale / v_scale [num_blocks, block_size,
num_kv_heads], and rounds exactly like quant.kv.quantize_kv (round half to even, saturating).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_store import kv_store_ref  # noqa: F401  (the reference, re-exported)
from quant.kv import MIN_AMAX, QMAX, SCALE_DTYPE, kv_format_of

# QUANT codes for the kernel: 0 none, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2.
_QUANT_CODE = {"auto": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
# float8 grids: mantissa bits and the smallest normal exponent (subnormals share its spacing).
_FP8_GRID = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}
_RINT_MAGIC = 12582912.0  # 1.5 * 2^23: (x + M) - M rounds |x| < 2^22 to nearest even in fp32


@triton.jit
def _kv_store_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (slot-major view)
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks * block_size, num_kv_heads] bf16 (unused unless QUANT)
    v_scale_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,  # source strides (head_dim stride is 1)
    stride_cs, stride_ch,  # cache strides per slot and per head (same for K and V)
    HEADS: tl.constexpr,  # num_kv_heads rounded up to a power of 2
    HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, RINT_MAGIC: tl.constexpr,
):
    token = tl.program_id(0)
    is_value = tl.program_id(1) == 1
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)  # [HEADS, HEAD_DIM]
    if is_value:
        src_ptr = value_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh
        dst_ptr = v_cache_ptr
        scale_ptr = v_scale_ptr
    else:
        src_ptr = key_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh
        dst_ptr = k_cache_ptr
        scale_ptr = k_scale_ptr
    x = tl.load(src_ptr + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # [HEADS, HEAD_DIM]
    dst_offs = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    if QUANT == 0:
        tl.store(dst_ptr + dst_offs, x.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX)  # [HEADS]
        scales = tl.div_rn(amax, QMAX)
        # Round to the nearest-even bf16 in the fp32 bits, as quant.kv.quantize_kv does: the
        # store below is then exact (the interpreter's fp32 -> bf16 cast truncates).
        bits = scales.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
        scales = bits.to(tl.float32, bitcast=True)
        y = tl.div_rn(x, scales[:, None])  # |y| <= QMAX up to rounding
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if QUANT == 1:
            y = (y + RINT_MAGIC) - RINT_MAGIC
        else:
            # Round to the float8 grid in fp32 first (the interpreter's fp32 -> fp8 cast is not
            # round-to-nearest-even): spacing 2^(exp - MANT_BITS), exp from the fp32 bits.
            exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            exp = tl.maximum(exp, MIN_EXP)
            ulp = ((exp - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
            inv_ulp = ((127 - exp + MANT_BITS) << 23).to(tl.float32, bitcast=True)
            y = ((y * inv_ulp + RINT_MAGIC) - RINT_MAGIC) * ulp
        tl.store(dst_ptr + dst_offs, y.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + slot * num_kv_heads + heads, scales.to(scale_ptr.dtype.element_ty),
                 mask=heads < num_kv_heads)


def kv_store_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] SCALE_DTYPE
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and value.dtype == key.dtype
    assert key.stride(-1) == value.stride(-1) == 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert head_dim == triton.next_power_of_2(head_dim), head_dim
    fmt = kv_format_of(k_cache.dtype)
    if fmt == "auto":
        assert k_scale is None and v_scale is None
        k_scale, v_scale = k_cache, v_cache  # never read
    else:
        for s in (k_scale, v_scale):
            assert s is not None and s.dtype == SCALE_DTYPE and s.is_contiguous()
            assert s.shape == k_cache.shape[:3], (s.shape, k_cache.shape)
    check_fp8_support(k_cache)
    mant_bits, min_exp = _FP8_GRID.get(fmt, (0, 0))
    _kv_store_kernel[(num_tokens, 2)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        QUANT=_QUANT_CODE[fmt], QMAX=QMAX.get(fmt, 1.0), MIN_AMAX=MIN_AMAX,
        MANT_BITS=mant_bits, MIN_EXP=min_exp, RINT_MAGIC=_RINT_MAGIC,
    )


def check_fp8_support(cache: torch.Tensor) -> None:
    """Triton has float8 e4m3 (fp8e4nv) only from compute capability 8.9 (Ada, Hopper) on."""
    if cache.is_cuda and cache.dtype == torch.float8_e4m3fn:
        if torch.cuda.get_device_capability(cache.device) < (8, 9):
            raise ValueError("kv_cache_dtype fp8_e4m3 needs a GPU of compute capability >= 8.9; "
                             "use fp8_e5m2 or int8")
