"""Weight-only 4-bit in GGUF's Q4_K layout: the catalog's Q4_K_M files load into it block for block.

A superblock of 256 weights has a float d and dmin and 8 sub-blocks of 32, each with an integer
scale sc_j and min m_j:

    w = d * sc_j * code - dmin * m_j,   code in 0..15

Because the sub-block scales are integers, the kernel (kernels/q4k_matmul_cpu.cpp) sums a whole
superblock in int32 and pays one float multiply-add per 256 weights; quant/int4.py's groups of 32
with float16 d and m pay one per 32, and that float chain bounded its kernel on AVX2. Bytes per
weight: 4.5 in the file, 4.75 here (sc, m as bytes and d, dmin as float32), against 5 for int4.

The plain layout (K % 256 == 0): codes [N, K/2] uint8, as GGUF's `qs` and quant/int4.py's codes
(bytes [32p, 32p + 32) of a superblock hold sub-block 2p in the low nibbles, 2p + 1 in the high
ones); subs [N, K/256, 16] uint8 (8 scales, then 8 mins); dd [N, K/256, 2] float32 (d, dmin).
Q4KLinear and the kernel keep the same bytes interleaved by 8 output features (`interleave`, laid
out in kernels/q4k_matmul_cpu.cpp; N % 8 == 0): one vpmaddubsw then covers 8 features and their
sub-block sums add up in int16: ~1.5-1.8x faster than the plain layout from 2 rows up.

A GGUF Q4_K tensor keeps its codes, its 6-bit scales and mins and its d, dmin exactly (no float
round trip). Other tensors (the file's Q6_K ones, safetensors checkpoints) are quantized from
float with 8-bit sub-block scales (quantize_q4k).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import decode_ops
from kernels import quant_matmul as kernel
from quant.int4 import pack_codes, unpack_codes

SUPER = 256
SUB = 32
BLOCK_BYTES = 144  # GGUF block_q4_K: d, dmin (float16), scales[12] (6-bit packed), qs[128]
ROW_CHUNK = 4096


def blocks_to_layout(raw: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks [N, K/256 * 144] uint8 -> (codes [N, K/2], subs [N, K/256, 16], dd [N, K/256, 2])."""
    raw = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw.contiguous()
    n = raw.shape[0]
    blocks = raw.view(n, -1, BLOCK_BYTES)  # [N, S, 144]
    s = blocks.shape[1]
    dd = blocks[..., :4].contiguous().view(torch.float16).view(n, s, 2).float()
    q = blocks[..., 4:16].to(torch.int32)  # [N, S, 12]: ggml's get_scale_min_k4
    sc = torch.empty(n, s, 8, dtype=torch.int32)
    mn = torch.empty(n, s, 8, dtype=torch.int32)
    sc[..., :4], mn[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    subs = torch.cat((sc, mn), dim=2).to(torch.uint8)
    codes = blocks[..., 16:].reshape(n, s * 128)
    return codes.contiguous(), subs.contiguous(), dd.contiguous()


def quantize_q4k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes, subs, dd) with 8-bit sub-block scales and mins.

    Per sub-block the range [min(w, 0), max(w)] maps onto codes 0..15 (as Q4_K: the min is an
    offset below zero); the 8 scales and mins of a superblock are then rounded to multiples of
    d = max(scale) / 255 and dmin = max(min) / 255, and the codes are taken against the rounded
    values."""
    n, k = weight.shape
    assert k % SUPER == 0, f"in_features {k} is not a multiple of {SUPER}"
    s = k // SUPER
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    subs = torch.empty(n, s, 16, dtype=torch.uint8)
    dd = torch.empty(n, s, 2)
    for start in range(0, n, ROW_CHUNK):
        w = weight[start : start + ROW_CHUNK].float().view(-1, s, 8, SUB)
        lo = w.amin(dim=3).clamp(max=0)  # [rows, S, 8]
        scale = (w.amax(dim=3) - lo) / 15
        d = scale.amax(dim=2) / 255  # [rows, S]
        dmin = (-lo).amax(dim=2) / 255
        sc = torch.round(scale / torch.where(d > 0, d, 1)[..., None]).clamp_(0, 255)
        mn = torch.round(-lo / torch.where(dmin > 0, dmin, 1)[..., None]).clamp_(0, 255)
        step = sc * d[..., None]  # the scale each sub-block ends up with
        offset = mn * dmin[..., None]
        q = torch.round((w + offset[..., None]) / torch.where(step > 0, step, 1)[..., None]).clamp_(0, 15)
        codes[start : start + ROW_CHUNK] = pack_codes(q.to(torch.uint8).view(-1, k))
        subs[start : start + ROW_CHUNK] = torch.cat((sc, mn), dim=2).to(torch.uint8)
        dd[start : start + ROW_CHUNK] = torch.stack((d, dmin), dim=2)
    return codes, subs, dd


GROUP = 8  # output features interleaved


def interleave(codes: torch.Tensor, subs: torch.Tensor, dd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain layout -> the kernel's (codes [N/8, S, 1024], subs [N/8, S, 128], dd [N/8, S, 16];
    kernels/q4k_matmul_cpu.cpp says where each byte goes). The same bytes, reordered."""
    n, s = subs.shape[:2]
    assert n % GROUP == 0, f"out_features {n} is not a multiple of {GROUP}"
    g = n // GROUP
    # code index within a sub-block = 16 half + 4 q + i
    w = unpack_codes(codes).view(g, GROUP, s, 8, 2, 4, 4)  # [g, n, s, j, half, q, i]
    w = w.permute(0, 2, 3, 5, 1, 6, 4)  # [g, s, j, q, n, i, half]
    codes8 = (w[..., 0] | (w[..., 1] << 4)).reshape(g, s, 1024)
    scales = subs[..., :8].reshape(g, GROUP, s, 8).permute(0, 2, 3, 1)  # [g, s, j, n]
    mins = subs[..., 8:].reshape(g, GROUP, s, 4, 2).permute(0, 2, 3, 1, 4)  # [g, s, jp, n, 2]
    subs8 = torch.cat((scales.reshape(g, s, 64), mins.reshape(g, s, 64)), dim=2)
    dd8 = dd.float().reshape(g, GROUP, s, 2).permute(0, 2, 3, 1).reshape(g, s, 16)  # [g, s, (d, dmin), n]
    return codes8.contiguous(), subs8.contiguous(), dd8.contiguous()


def deinterleave(codes8: torch.Tensor, subs8: torch.Tensor, dd8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """interleave's inverse: the plain layout (codes [N, K/2], subs [N, S, 16], dd [N, S, 2])."""
    g, s = subs8.shape[:2]
    n = g * GROUP
    b = codes8.view(g, s, 8, 4, GROUP, 4)  # [g, s, j, q, n, i]
    w = torch.stack((b & 15, b >> 4), dim=-1)  # [g, s, j, q, n, i, half]
    w = w.permute(0, 4, 1, 2, 6, 3, 5).reshape(n, s * SUPER)  # [g, n, s, j, half, q, i]
    scales = subs8[..., :64].view(g, s, 8, GROUP).permute(0, 3, 1, 2)  # [g, n, s, j]
    mins = subs8[..., 64:].view(g, s, 4, GROUP, 2).permute(0, 3, 1, 2, 4).reshape(g, GROUP, s, 8)
    subs = torch.cat((scales, mins), dim=3).reshape(n, s, 16)
    dd = dd8.view(g, s, 2, GROUP).permute(0, 3, 1, 2).reshape(n, s, 2)
    return pack_codes(w).contiguous(), subs.contiguous(), dd.contiguous()


def dequantize_q4k(codes: torch.Tensor, subs: torch.Tensor, dd: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the layout stands for."""
    n, s = subs.shape[:2]
    w = unpack_codes(codes).view(n, s, 8, SUB).float()
    sc, mn = subs[..., :8].float(), subs[..., 8:].float()
    w = w * (sc * dd[..., 0, None])[..., None] - (mn * dd[..., 1, None])[..., None]
    return w.view(n, s * SUPER).to(dtype)


class Q4KLinear(nn.Module):
    """Drop-in for nn.Linear (no training): y = x @ W.T + bias, W in Q4_K superblocks, kept
    interleaved by 8 output features (see the module docstring).

    Every row count goes through the kernel (decode, verification and prefill chunks alike), so
    a row's numbers never depend on the rows beside it. Takes and returns the activations' dtype."""

    def __init__(self, codes: torch.Tensor, subs: torch.Tensor, dd: torch.Tensor, bias: torch.Tensor | None):
        """From the plain layout (blocks_to_layout, quantize_q4k)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        codes8, subs8, dd8 = interleave(codes, subs, dd)
        self.register_buffer("codes", codes8)
        self.register_buffer("subs", subs8)
        self.register_buffer("dd", dd8)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @staticmethod
    def fits(in_features: int, out_features: int) -> bool:
        return in_features % SUPER == 0 and out_features % GROUP == 0

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "Q4KLinear":
        return cls(*quantize_q4k(linear.weight.data), linear.bias)

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight in the plain layout (codes, subs, dd)."""
        return deinterleave(self.codes, self.subs, self.dd)

    def weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_q4k(*self.layout(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if kernel.is_available():
            y = kernel.q4k_linear(rows.float(), self.codes, self.subs, self.dd, self.bias).to(x.dtype)
        else:
            y = F.linear(rows, self.weight(rows.dtype), None if self.bias is None else self.bias.to(rows.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def stack_weights(self) -> tuple | None:
        """This layer as a DecodeStack linear (kernels/decode_ops.py), or None without the kernel."""
        if not kernel.is_available():
            return None
        return decode_ops.LINEAR_Q4K, self.codes, self.subs, self.dd, self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_K"
