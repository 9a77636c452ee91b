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

Where the CPU has no AVX-512 VNNI and N % 8 == 0, Int4Linear keeps the same bytes interleaved by 8
output features instead (`interleave`; laid out in kernels/quant_matmul_cpu.cpp, tile_x8), as
quant/q4k.py does: one vpmaddubsw then serves 8 features and a group's sums add up in int16. On a
Zen 3 that ran 1.1-1.3x the row-major tile at one row and 1.4-2.2x from 3 rows and for prefill
chunks, and 1.02-1.3x Q4_K padded to whole superblocks at in_features 576 and 896 (docs/benchmarks.md,
session 38). Where VNNI is, the row-major layout keeps its 512-bit VNNI tile.
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


INTERLEAVE = 8  # output features interleaved


def interleave(packed: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-major layout -> codes [N/8, K/32, 128] and params [N/8, K/32, 16] (the kernel's
    tile_x8 says where each byte goes). The same codes and float16 numbers, reordered."""
    codes = unpack_codes(packed)
    n, k = codes.shape
    assert n % INTERLEAVE == 0, f"out_features {n} is not a multiple of {INTERLEAVE}"
    g, groups = n // INTERLEAVE, k // GROUP_SIZE
    c = codes.view(g, INTERLEAVE, groups, 2, 4, 4)  # [g, n, b, half, q, i]: k = 32 b + 16 half + 4 q + i
    c = c.permute(0, 2, 4, 1, 5, 3)  # [g, b, q, n, i, half]
    codes8 = (c[..., 0] | (c[..., 1] << 4)).reshape(g, groups, 128)
    params8 = params.view(g, INTERLEAVE, 2, groups).permute(0, 3, 2, 1).reshape(g, groups, 16)
    return codes8.contiguous(), params8.contiguous()


def deinterleave(codes8: torch.Tensor, params8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """interleave's inverse: (packed [N, K/2], params [N, 2, K/32])."""
    g, groups = codes8.shape[:2]
    c = codes8.view(g, groups, 4, INTERLEAVE, 4)  # [g, b, q, n, i]
    c = torch.stack((c & 15, c >> 4), dim=-1)  # [g, b, q, n, i, half]
    codes = c.permute(0, 3, 1, 5, 2, 4).reshape(g * INTERLEAVE, groups * GROUP_SIZE)
    params = params8.view(g, groups, 2, INTERLEAVE).permute(0, 3, 2, 1).reshape(g * INTERLEAVE, 2, groups)
    return pack_codes(codes).contiguous(), params.contiguous()


def make_params(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d, m [N, G] -> params [N, 2, G] float16."""
    return torch.stack((d, m), dim=1).to(torch.float16).contiguous()


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in `dtype` that a packed layer stands for."""
    codes = unpack_codes(packed)
    n, k = codes.shape
    w = codes.view(n, k // GROUP_SIZE, GROUP_SIZE).to(dtype)  # [N, G, 32]
    return w.mul_(params[:, 0, :, None].to(dtype)).add_(params[:, 1, :, None].to(dtype)).view(n, k)


def q4_1_layout(raw) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes [N, K/32 * 20] -> the row-major (packed, params): per block d, m
    (float16) and 16 bytes holding element j in the low nibble of byte j and element j + 16 in its
    high nibble; the formula is this layout's (w = d * code + m), so only the codes are repacked."""
    raw = torch.as_tensor(np.ascontiguousarray(raw))
    n = raw.shape[0]
    blocks = raw.view(n, -1, Q4_1_BLOCK_BYTES)  # [N, G, 20]
    params = blocks[..., :4].contiguous().view(torch.float16).view(n, -1, 2).transpose(1, 2)  # [N, 2, G]
    qs = blocks[..., 4:]
    codes = torch.cat((qs & 15, qs >> 4), dim=2).reshape(n, -1)  # [N, K]
    return pack_codes(codes), params.contiguous()


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear (no training): y = x @ W.T + bias, W in 4-bit groups of 32.

    Row-major (the module docstring): up to SMALL_M rows (decode, verification) go through the
    int4 kernel, whose rows are independent of each other; longer chunks through a dense GEMM on
    the weight dequantized for that call. Interleaved by 8 (`interleaved`, chosen where the CPU
    has no VNNI): every row count through tile_x8, as the Q4_K layer does. Takes and returns the
    activations' dtype."""

    def __init__(self, packed: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None,
                 interleaved: bool | None = None):
        """packed [N, K/2], params [N, 2, K/32]: the row-major layout. `interleaved`: None = where
        the kernel has no VNNI tile to run and N % 8 == 0."""
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        if interleaved is None:
            interleaved = (self.out_features % INTERLEAVE == 0 and kernel.is_available()
                           and not kernel.vnni_enabled())
        self.interleaved = interleaved
        if interleaved:
            packed, params = interleave(packed, params)
        self.register_buffer("packed", packed.contiguous())  # [N, K/2] uint8, or [N/8, K/32, 128]
        self.register_buffer("params", params.contiguous())  # [N, 2, K/32] float16: d, then m; or [N/8, K/32, 16]
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight in the row-major layout (packed, params)."""
        return deinterleave(self.packed, self.params) if self.interleaved else (self.packed, self.params)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> "Int4Linear":
        return cls(pack_codes(codes), make_params(d, m), bias)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(*self.layout(), dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        return cls.from_codes(*quantize_int4(linear.weight.data), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if self.interleaved and kernel.is_available():
            y = kernel.int4x8_linear(rows.float(), self.packed, self.params, self.bias).to(x.dtype)
        elif kernel.is_available() and rows.shape[0] <= SMALL_M:
            y = kernel.int4_linear(rows.float(), self.packed, self.params, self.bias).to(x.dtype)  # [M, out]
        elif kernel.is_available():  # a prefill chunk: compute-bound, so a dense fp32 GEMM wins
            y = kernel.int4_dense_matmul(rows.float(), self.packed, self.params)
            if self.bias is not None:
                y += self.bias
            y = y.to(x.dtype)
        else:
            y = F.linear(rows, self.weight(rows.dtype),
                         None if self.bias is None else self.bias.to(rows.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def stack_weights(self) -> tuple | None:
        """This layer as a DecodeStack linear (kernels/decode_ops.py), or None without the kernel."""
        if not kernel.is_available():
            return None
        kind = decode_ops.LINEAR_INT4X8 if self.interleaved else decode_ops.LINEAR_INT4
        return kind, self.packed, self.params, decode_ops.NO_TENSOR, self.bias

    def extra_repr(self) -> str:
        order = ", interleaved by 8" if self.interleaved else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}{order}"
