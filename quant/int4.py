"""Weight-only 4-bit for fast CPU decode: groups of 32 weights share a scale d and an offset m.

Decode reads every weight once per token, so bytes per weight set the speed. A group of 32
weights is 16 bytes of codes plus two float16 numbers: 0.625 bytes per weight, 1.6x fewer than
int8 and 3.2x fewer than bf16. The scheme is GGUF's Q4_1 block (and a Q4_K sub-block), so those
files map onto it without a float round trip:

    w[n, k] = d[n, g] * code[n, k] + m[n, g],   g = k // 32,  code in 0..15

The matmul is kernels/quant_matmul.py (C++, AVX2; activations quantized to int8 per group of 32
as llama.cpp does). Without it (no compiler, another CPU) the layer dequantizes its weight for
each call: correct, and slow.

Packed codes [N, K/2] uint8 (K % 64 == 0): groups 2p and 2p + 1 of a row share bytes
[32p, 32p + 32), byte j = code(64p + j) in the low nibble and code(64p + 32 + j) in the high
nibble, so the kernel splits one 32-byte load into two groups with two masks. Params
[N, 2, K/32] float16: every group's d, then every group's m (8 groups load at once).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import decode_ops
from kernels import quant_matmul as kernel

GROUP_SIZE = 32
Q4_1_BLOCK_BYTES = 20  # GGUF block_q4_1: d, m (float16), qs[16]
ROW_CHUNK = 4096  # rows quantized at a time (bounds the float temporaries)
SMALL_M = 128  # rows up to which the int4 kernel runs; past ~128 the dense path wins (benchmarks/int4_kernels.py, int4_kernels_openmp.json)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] uint8 in 0..15, d [N, K/32], m [N, K/32] float32).

    Min/max per group (Q4_1): the group's minimum is code 0 (m) and its maximum code 15. Rows go
    in chunks, so a 151,936-row LM head needs no full-size float temporaries."""
    n, k = weight.shape
    assert k % (2 * GROUP_SIZE) == 0, f"in_features {k} is not a multiple of {2 * GROUP_SIZE}"
    codes = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // GROUP_SIZE)
    lo = torch.empty(n, k // GROUP_SIZE)
    for start in range(0, n, ROW_CHUNK):
        groups = weight[start : start + ROW_CHUNK].float().view(-1, k // GROUP_SIZE, GROUP_SIZE)  # [rows, K/32, 32]
        chunk_lo, chunk_hi = groups.amin(dim=2), groups.amax(dim=2)  # [rows, K/32]
        chunk_d = (chunk_hi - chunk_lo) / 15
        safe_d = torch.where(chunk_d > 0, chunk_d, torch.ones_like(chunk_d))
        chunk = torch.round((groups - chunk_lo[..., None]) / safe_d[..., None]).clamp_(0, 15)
        codes[start : start + ROW_CHUNK] = chunk.view(-1, k)
        d[start : start + ROW_CHUNK], lo[start : start + ROW_CHUNK] = chunk_d, chunk_lo
    return codes, d, lo


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 (0..15) -> packed [N, K/2] uint8 (see the module docstring)."""
    n, k = codes.shape
    assert k % (2 * GROUP_SIZE) == 0, f"in_features {k} is not a multiple of {2 * GROUP_SIZE}"
    pairs = codes.view(n, k // (2 * GROUP_SIZE), 2, GROUP_SIZE)  # [N, K/64, (low, high), 32]
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] uint8 -> codes [N, K] uint8."""
    n, half_k = packed.shape
    pairs = packed.view(n, half_k // GROUP_SIZE, 1, GROUP_SIZE)  # [N, K/64, 1, 32]
    return torch.cat((pairs & 15, pairs >> 4), dim=2).reshape(n, 2 * half_k)


def make_params(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d, m [N, G] -> params [N, 2, G] float16."""
    return torch.stack((d, m), dim=1).to(torch.float16).contiguous()


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in `dtype` that a packed layer stands for."""
    codes = unpack_codes(packed)
    n, k = codes.shape
    w = codes.view(n, k // GROUP_SIZE, GROUP_SIZE).to(dtype)  # [N, G, 32]
    return w.mul_(params[:, 0, :, None].to(dtype)).add_(params[:, 1, :, None].to(dtype)).view(n, k)


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear (no training): y = x @ W.T + bias, W in 4-bit groups of 32.

    Up to SMALL_M rows (decode, verification) go through the int4 kernel, whose rows are
    independent of each other; longer chunks through a dense GEMM on the weight dequantized for
    that call. Takes and returns the activations' dtype."""

    def __init__(self, packed: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("packed", packed.contiguous())  # [N, K/2] uint8
        self.register_buffer("params", params.contiguous())  # [N, 2, K/32] float16: d, then m
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> "Int4Linear":
        return cls(pack_codes(codes), make_params(d, m), bias)

    @classmethod
    def from_q4_1_blocks(cls, raw, bias: torch.Tensor | None) -> "Int4Linear":
        """From a GGUF Q4_1 tensor's bytes [N, K/32 * 20]: per block d, m (float16) and 16 bytes
        holding element j in the low nibble of byte j and element j + 16 in its high nibble; the
        formula is this layer's (w = d * code + m), so only the codes are repacked."""
        raw = torch.as_tensor(np.ascontiguousarray(raw))
        n = raw.shape[0]
        blocks = raw.view(n, -1, Q4_1_BLOCK_BYTES)  # [N, G, 20]
        params = blocks[..., :4].contiguous().view(torch.float16).view(n, -1, 2).transpose(1, 2)  # [N, 2, G]
        qs = blocks[..., 4:]
        codes = torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, -1)  # [N, K]
        return cls(pack_codes(codes), params.contiguous(), bias)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.packed, self.params, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        return cls.from_codes(*quantize_int4(linear.weight.data), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if kernel.is_available() and rows.shape[0] <= SMALL_M:
            y = kernel.int4_linear(rows.float(), self.packed, self.params, self.bias).to(x.dtype)  # [M, out]
        elif kernel.is_available():  # a prefill chunk: compute-bound, so a dense fp32 GEMM wins
            y = kernel.int4_dense_matmul(rows.float(), self.packed, self.params)
            if self.bias is not None:
                y += self.bias
            y = y.to(x.dtype)
        else:
            y = F.linear(rows, dequantize_int4(self.packed, self.params, rows.dtype),
                         None if self.bias is None else self.bias.to(rows.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def stack_weights(self) -> tuple | None:
        """This layer as a DecodeStack linear (kernels/decode_ops.py), or None without the kernel."""
        if not kernel.is_available():
            return None
        return decode_ops.LINEAR_INT4, self.packed, self.params, decode_ops.NO_TENSOR, self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}"
