"""Weight-only int8 for fast CPU decode: per-output-channel symmetric int8 weights.

Up to SMALL_M rows the layer runs kernels/quant_matmul.py's C++ kernel where it builds
(activations quantized to int8 per group of 32, integer dots: each row computed the same way
whatever the row count), else torch's packed kernel below in bf16. The history:

Decode is a GEMV bound by the bytes of weights read per token. torch's own
`_weight_int8pack_mm` (AVX-512 on this CPU) streams 1 byte per weight instead of 2 (bf16) or
4 (fp32): for a SmolLM2-shaped step, fp32 F.linear ~34 ms, bf16 ~13 ms, int8 ~5 ms
(2 threads, benchmarks in docs/benchmarks.md). Past SMALL_M rows (prefill chunks) the matmul is
compute-bound and the packed kernel loses to a bf16 GEMM. Dequantizing on the fly is no way out:
int8 -> bf16 conversion runs at ~0.3 G elements/s here, ~5 s per forward of a 1.5B model. So the
layer keeps the bf16 weight too (sharing the loaded tensor, no copy) for prefill: 3 bytes per
weight in memory, 1 byte read per weight per decode step.

    w ~= w_int8 * scale[:, None],  scale = max|w[row]| / 127   (one scale per output row)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import decode_ops
from kernels import quant_matmul as kernel

COMPUTE_DTYPE = torch.bfloat16  # the packed kernel's fp32 path is ~100x slower here
SMALL_M = 32  # rows up to which the packed GEMV kernel wins (measured: 1..32 rows)
ROW_CHUNK = 4096  # rows quantized at a time


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (int8 [out, in], scales [out] float32), symmetric per row."""
    return quantize_int8_rows(lambda start, stop: weight[start:stop], *weight.shape)


def quantize_int8_rows(read_rows, num_rows: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 of a weight read in chunks of rows (`read_rows(start, stop)` -> float rows):
    no full-size float temporaries, and the weight itself need never be whole in memory
    (chatserve/models/loader.StreamedLinear)."""
    q = torch.empty(num_rows, in_features, dtype=torch.int8)
    scales = torch.empty(num_rows)  # [out]
    for start in range(0, num_rows, ROW_CHUNK):
        w = read_rows(start, min(start + ROW_CHUNK, num_rows)).float()
        chunk_scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[start : start + ROW_CHUNK] = torch.round(w / chunk_scales[:, None]).clamp_(-127, 127)
        scales[start : start + ROW_CHUNK] = chunk_scales
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] an int8 layer stands for."""
    return q.float() * scales.float()[:, None]


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear (no training): y = x @ (w_int8 * scale).T + bias, in bf16."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dense_weight: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        # Where the C++ kernel runs, the rows are kept interleaved by 8 output features
        # (kernels/quant_matmul.pack_int8): at 4-8 rows (a verification) that kernel is 2.2-2.4x
        # faster than the row-major one on Qwen 1.5B's LM head, at 1 row the same.
        self.packed = (self.in_features % kernel.GROUP_SIZE == 0 and self.out_features % 8 == 0
                       and kernel.is_available())
        # [out, in] int8, row-major or (packed) in pack_int8's order; int8_rows() is always row-major
        self.register_buffer("qweight", kernel.pack_int8(qweight) if self.packed else qweight.contiguous())
        self.register_buffer("scales", scales.float())  # [out]
        self.register_buffer("bias", None if bias is None else bias.detach().to(COMPUTE_DTYPE))
        # [out, in], prefill; None: dequantized per call (a layer that rarely sees long chunks)
        self.register_buffer("dense_weight", None if dense_weight is None else dense_weight.detach().to(COMPUTE_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_dense: bool = True) -> "Int8Linear":
        q, scales = quantize_int8(linear.weight.data)
        return cls(q, scales, linear.bias, linear.weight.data if keep_dense else None)

    @classmethod
    def from_streamed(cls, linear) -> "Int8Linear":
        """From a chatserve.models.loader.StreamedLinear, a chunk of rows at a time (no dense copy)."""
        return cls(*quantize_int8_rows(linear.read_rows, linear.out_features, linear.in_features), None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        # Without a dense copy (LM heads) the kernel takes every row count: dequantizing the head
        # per call cost Qwen 1.5B's 151,936-row head ~1.8 s at 48 rows (the kernel: ~0.35 s), and
        # in bf16 a row's logits depended on how many rows shared the call.
        few = rows.shape[0] <= SMALL_M or self.dense_weight is None
        if few and self.in_features % kernel.GROUP_SIZE == 0 and kernel.is_available():
            matmul = kernel.int8x8_matmul if self.packed else kernel.int8_matmul
            y = matmul(rows.float(), self.qweight, self.scales)  # [M, out] float32
            if self.bias is not None:
                y += self.bias
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        rows = rows.to(COMPUTE_DTYPE)
        if rows.shape[0] <= SMALL_M:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales.to(COMPUTE_DTYPE))  # [M, out]
        elif self.dense_weight is not None:
            y = F.linear(rows, self.dense_weight)
        else:
            y = F.linear(rows, (self.qweight.to(COMPUTE_DTYPE) * self.scales.to(COMPUTE_DTYPE)[:, None]))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def stack_weights(self) -> tuple | None:
        """This layer as a DecodeStack linear (kernels/decode_ops.py), or None where its few-row
        path is not the C++ kernel."""
        if self.in_features % kernel.GROUP_SIZE or not kernel.is_available():
            return None
        kind = decode_ops.LINEAR_INT8X8 if self.packed else decode_ops.LINEAR_INT8
        return kind, self.qweight, self.scales, decode_ops.NO_TENSOR, self.bias

    def int8_rows(self) -> torch.Tensor:
        """The int8 weight [out, in], row-major (a copy when it is kept packed)."""
        return kernel.unpack_int8(self.qweight) if self.packed else self.qweight

    def extra_repr(self) -> str:
        packed = ", interleaved by 8" if self.packed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel{packed}"


class Int8Embedding(nn.Module):
    """Drop-in for nn.Embedding (lookup only): one int8 row and one scale per token, so the table
    takes a quarter of its fp32 bytes. Only the looked-up rows are widened, to `dtype`."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight.contiguous())  # [vocab, hidden] int8
        self.register_buffer("scales", scales.float())  # [vocab]
        self.packed = False  # True once it reads a tied head's rows in pack_int8's order (share_rows)

    def share_rows(self, head: Int8Linear) -> None:
        """Read `head`'s int8 rows and scales (a tied LM head's, equal to this table's) instead of
        a copy of them, in whatever order the head keeps them."""
        self.qweight, self.scales, self.packed = head.qweight, head.scales, head.packed

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Int8Embedding":
        return cls(*quantize_int8(embedding.weight.data), embedding.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        flat = ids.reshape(-1)
        if self.qweight.is_cuda:
            rows = self.rows_torch(flat)
        elif kernel.is_available():
            rows = kernel.int8_rows(self.qweight, self.scales, flat.long(), self.packed)
        else:
            rows = torch.from_numpy(self.rows_numpy(flat.numpy()))
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def rows_torch(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> their rows [T, hidden] float32: the int8 values times the row's scale."""
        if self.packed:  # row i is 4 bytes in each 32-byte step of its group of 8
            steps = self.qweight.view(self.num_embeddings // 8, self.embedding_dim // 4, 8, 4)
            q = steps[ids // 8, :, ids % 8, :].reshape(-1, self.embedding_dim)
        else:
            q = self.qweight.index_select(0, ids)
        return q.float() * self.scales.index_select(0, ids)[:, None]

    def rows_numpy(self, ids: np.ndarray) -> np.ndarray:
        """rows_torch in numpy, the same numbers (one float32 product a value), for a CPU without the
        C++ kernels (kernel.int8_rows, the CPU path: numpy's ~10 calls took ~150 us served a head
        forward on SmolLM2, ~22 us in a loop; torch's five small ops 100+ us on a 2-core VM), and
        the embedding runs once a decode step and once a head forward."""
        if len(ids) and not (0 <= ids.min() and ids.max() < self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        if self.packed:
            steps = self.qweight.numpy().reshape(self.num_embeddings // 8, self.embedding_dim // 4, 8, 4)
            q = steps[ids >> 3, :, ids & 7, :]
        else:
            q = self.qweight.numpy()[ids]
        return q.reshape(len(ids), self.embedding_dim).astype(np.float32) * self.scales.numpy()[ids][:, None]
