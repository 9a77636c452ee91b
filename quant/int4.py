"""Weight-only 4-bit for fast CPU decode: groups of 32 weights share a scale d and an offset m.

Decode reads every weight once per token, so bytes per weight set the speed. A group of 32
weights is 16 bytes of codes plus two float16 numbers: 0.625 bytes per weight, 1.6x fewer than
int8 and 3.2x fewer than bf16. The scheme is GGUF's Q4_1 block (and a Q4_K sub-block), so those
files map onto it without a float round trip:

    w[n, k] = d[n, g] * code[n, k] + m[n, g],   g = k // 32,  code in 0..15

The matmul is kernels/int4_matmul.py (C++, AVX2; activations quantized to int8 per group of 32
as llama.cpp does). Without it (no compiler, another CPU) the layer dequantizes its weight for
each call: correct, and slow.

Packed codes [N, K/2] uint8: group g of a row is bytes [16g, 16g + 16), byte j = code(32g + j)
in the low nibble and code(32g + 16 + j) in the high nibble (llama.cpp's order for Q4 blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import int4_matmul as kernel

GROUP_SIZE = 32
SMALL_M = 16  # rows up to which the int4 kernel beats dequantize + dense GEMM (benchmarks/int4_kernels.py)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] uint8 in 0..15, d [N, K/32], m [N, K/32] float32).

    Min/max per group (Q4_1): the group's minimum is code 0 (m) and its maximum code 15."""
    n, k = weight.shape
    assert k % GROUP_SIZE == 0, f"in_features {k} is not a multiple of {GROUP_SIZE}"
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, K/32, 32]
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # [N, K/32]
    d = (hi - lo) / 15
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((groups - lo[..., None]) / safe_d[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.view(n, k), d, lo


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 (0..15) -> packed [N, K/2] uint8 (see the module docstring)."""
    n, k = codes.shape
    groups = codes.view(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)  # [N, G, (low, high), 16]
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] uint8 -> codes [N, K] uint8."""
    n, half_k = packed.shape
    groups = packed.view(n, half_k // 16, 1, 16)  # [N, G, 1, 16]
    return torch.cat((groups & 15, groups >> 4), dim=2).reshape(n, 2 * half_k)


def make_params(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d, m [N, G] -> params [N, G, 2] float16."""
    return torch.stack((d, m), dim=2).to(torch.float16).contiguous()


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in `dtype` that a packed layer stands for."""
    codes = unpack_codes(packed)
    n, k = codes.shape
    w = codes.view(n, k // GROUP_SIZE, GROUP_SIZE).to(dtype)  # [N, G, 32]
    return w.mul_(params[..., :1].to(dtype)).add_(params[..., 1:].to(dtype)).view(n, k)


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear (no training): y = x @ W.T + bias, W in 4-bit groups of 32.

    Up to SMALL_M rows (decode, verification) go through the int4 kernel, whose rows are
    independent of each other; longer chunks through a dense GEMM on the weight dequantized for
    that call. Takes and returns the activations' dtype."""

    def __init__(self, packed: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.register_buffer("packed", packed.contiguous())  # [N, K/2] uint8
        self.register_buffer("params", params.contiguous())  # [N, K/32, 2] float16: (d, m)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> "Int4Linear":
        return cls(pack_codes(codes), make_params(d, m), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        return cls.from_codes(*quantize_int4(linear.weight.data), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if kernel.is_available() and rows.shape[0] <= SMALL_M:
            y = kernel.int4_matmul(rows.float(), self.packed, self.params)  # [M, out] float32
            if self.bias is not None:
                y += self.bias
            y = y.to(x.dtype)
        else:  # a prefill chunk: compute-bound, so a dense GEMM in the activations' dtype wins
            y = F.linear(rows, self.dense_weight(rows.dtype), None if self.bias is None else self.bias.to(rows.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype`, made for one call (no dense copy is kept)."""
        if kernel.is_available():
            return kernel.int4_dequantize(self.packed, self.params).to(dtype)
        return dequantize_int4(self.packed, self.params, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}"
