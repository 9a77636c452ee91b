"""KV formats: round-trip error bounds, saturation, the exact fp8 widening, byte accounting."""

import pytest
import torch

from quant.kv import (QMAX, SCALE_DTYPE, dequantize_kv, kv_bytes_per_token, kv_format_of,
                      kv_storage_dtype, kv_to_float, quantize_kv)

# fp8 grids: relative half-ulp of a normal value, and the absolute half-spacing of subnormals
# (in units of the scale): e4m3 has 3 mantissa bits, min normal 2^-6; e5m2 2 bits, 2^-14.
FP8_BOUNDS = {"fp8_e4m3": (2.0**-4, 2.0**-10), "fp8_e5m2": (2.0**-3, 2.0**-17)}


def _rows(generator, num_tokens=64, num_kv_heads=3, head_dim=64):
    # magnitudes from 1e-3 to 1e3 per (token, head): scales must follow each row
    magnitudes = 10.0 ** (torch.rand(num_tokens, num_kv_heads, 1, generator=generator) * 6 - 3)
    return torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * magnitudes


def test_int8_round_trip_within_half_a_step(generator):
    x = _rows(generator)
    q, scales = quantize_kv(x, "int8")
    assert q.dtype == torch.int8 and scales.shape == x.shape[:2] and scales.dtype == SCALE_DTYPE
    assert torch.equal(scales, (x.abs().amax(-1) / 127).to(SCALE_DTYPE))  # nearest bf16
    error = (dequantize_kv(q, scales) - x).abs()
    assert (error <= scales[..., None] * (0.5 + 1e-5)).all()
    assert (q.abs().amax(-1) == 127).all()  # amax lands on the top code


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_round_trip_within_half_an_ulp(fmt, generator):
    x = _rows(generator)
    q, scales = quantize_kv(x, fmt)
    assert q.dtype == kv_storage_dtype(fmt)
    assert torch.equal(scales, (x.abs().amax(-1) / QMAX[fmt]).to(SCALE_DTYPE))
    relative, subnormal = FP8_BOUNDS[fmt]
    bound = torch.maximum(x.abs() * relative, scales[..., None] * subnormal) * (1 + 1e-5)
    assert ((dequantize_kv(q, scales) - x).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_saturates_and_handles_zero_rows(fmt):
    x = torch.zeros(2, 1, 64)
    x[1, 0, :2] = torch.tensor([1e30, -1e30])  # amax far beyond any fixed range
    q, scales = quantize_kv(x, fmt)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert (dequantize_kv(q[:1], scales[:1]) == 0).all()
    widened = q.float()
    assert torch.isfinite(widened).all() and widened.abs().max() == QMAX[fmt]
    # the top code times the bf16-rounded scale: off by at most that rounding, 2^-8 relative
    torch.testing.assert_close(dequantize_kv(q[1:], scales[1:])[0, 0, :2], x[1, 0, :2], rtol=2**-8, atol=0)


def test_bf16_input_is_quantized_from_its_fp32_value(generator):
    x = _rows(generator).bfloat16()
    for fmt in ("int8", "fp8_e4m3"):
        q, scales = quantize_kv(x, fmt)
        q32, scales32 = quantize_kv(x.float(), fmt)
        assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(scales, scales32)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_kv_to_float_is_exact_for_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(16, 16)[:, ::2]  # strided too
    widened, mult = kv_to_float(codes)
    expected = codes.float()
    is_nan = expected.isnan()  # e4m3 / e5m2 NaN codes: never written (quantize_kv saturates)
    assert widened.dtype == torch.float32
    assert torch.equal((widened * mult)[~is_nan], expected[~is_nan])


def test_storage_dtypes_and_formats():
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("int8") == torch.int8
    assert kv_storage_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2") == torch.float8_e5m2
    for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_format_of(kv_storage_dtype(fmt)) == fmt
    assert kv_format_of(torch.float16) == "auto"
    with pytest.raises(ValueError, match="int4"):
        kv_storage_dtype("int4")
    with pytest.raises(ValueError):
        quantize_kv(torch.zeros(1, 1, 64), "auto")


def test_bytes_per_token_counts_the_scales():
    # SmolLM2-135M layer: 3 kv heads x 64
    assert kv_bytes_per_token("auto", 3, 64, torch.float32) == 2 * 3 * 64 * 4
    assert kv_bytes_per_token("auto", 3, 64, torch.bfloat16) == 2 * 3 * 64 * 2
    assert kv_bytes_per_token("int8", 3, 64, torch.bfloat16) == 2 * 3 * (64 + 2)
    assert kv_bytes_per_token("fp8_e5m2", 2, 128, torch.float32) == 2 * 2 * (128 + 2)
    # head_dim 64 and 128: int8 holds >= 1.9x bf16 and >= 3.8x fp32 tokens, bf16 scales included
    for head_dim in (64, 128):
        bf16 = kv_bytes_per_token("auto", 2, head_dim, torch.bfloat16)
        fp32 = kv_bytes_per_token("auto", 2, head_dim, torch.float32)
        int8 = kv_bytes_per_token("int8", 2, head_dim, torch.float32)
        assert bf16 / int8 >= 1.9 and fp32 / int8 >= 3.8
