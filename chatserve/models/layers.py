"""Building blocks of the decoder: RMSNorm, rotary embedding, paged attention, gated MLP.

Activations are flat over the ragged batch: [num_tokens, hidden]. No quantization here.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from chatserve.batch import AttnMetadata
from kernels import decode_ops, quant_matmul
from kernels.attention import paged_attention
from kernels.kv_store import kv_store


SMALL_M = 32  # rows up to which a float32 Linear runs the row-independent C++ kernel


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU calls of up to SMALL_M rows (decode and verification steps) go
    through kernels.quant_matmul.f32_matmul: each row computed the same way whatever the row
    count, so greedy speculation on dense float32 weights stays equal to one-row decoding (MKL's
    sgemm and sgemv round a row differently). Quantization replaces it like any nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if (rows.shape[0] <= SMALL_M and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and self.in_features % 8 == 0 and not x.is_cuda and quant_matmul.is_available()):
            y = quant_matmul.f32_matmul(rows, self.weight)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def stack_weights(self) -> tuple | None:
        """This layer as a DecodeStack linear (kernels/decode_ops.py), or None where its few-row
        path is not the C++ kernel."""
        if self.weight.dtype != torch.float32 or self.in_features % 8 or not quant_matmul.is_available():
            return None
        t = decode_ops.NO_TENSOR
        return decode_ops.LINEAR_F32, self.weight.detach(), t, t, None if self.bias is None else self.bias.detach()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`, x += residual (in place) first: the decoder's add + norm."""
        return rms_norm(x, self.weight, self.eps, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., dim] by weight [dim] (x += residual in place first, if given): the C++ op
    where it takes x, else in fp32 whatever the model dtype, as HF does (one op instead of six)."""
    if decode_ops.usable(x, x.shape[-1]) and x.is_contiguous():
        return decode_ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x += residual
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


class Rotary(nn.Module):
    """Non-interleaved (rotate-half) RoPE, as in HF checkpoints. cos/sin are tabulated once.

    With x = [x1 | x2] (halves of the head dim), HF computes [x1 cos - x2 sin | x2 cos + x1 sin].
    Tabulating cos2 = [cos | cos] and sin2 = [-sin | sin] makes that x * cos2 + swap(x) * sin2,
    where swap exchanges the halves: four ops for q and k of all heads at once.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling  # [P, D/2]
        self.register_buffer("cos2", torch.stack((cos, cos), dim=1), persistent=False)  # [P, 2, D/2]
        self.register_buffer("sin2", torch.stack((-sin, sin), dim=1), persistent=False)
        # [P, D/2] each, for the C++ op (kernels/decode_ops.py), which rotates in place
        self.register_buffer("cos", cos.contiguous(), persistent=False)
        self.register_buffer("sin", sin.contiguous(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = ()

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, heads: int) -> None:
        """Rotate heads [0, heads) of x (T, N, D) in place (float32, the C++ op)."""
        decode_ops.rope_(x, heads, positions, self.cos, self.sin)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (T, N, D) query and key heads together -> rotated, same shape and dtype."""
        t, n, d = x.shape
        halves = x.float().view(t, n, 2, d // 2)
        cos, sin = self._lookup(positions)
        return (halves * cos + halves.flip(2) * sin).view(t, n, d).to(x.dtype)

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, 2, D/2) fp32 for a step's positions, gathered once for all layers:
        every layer of a forward gets the same positions tensor. Holding a reference to it
        keeps its id from being reused by the next step's tensor."""
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = (self.cos2[positions].float().unsqueeze(1), self.sin2[positions].float().unsqueeze(1))
        return self._cos_sin


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.rotary = rotary
        self.scale = head_dim**-0.5

    def forward(self, positions, x, attn: AttnMetadata, kv_cache) -> torch.Tensor:
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, num_qk_heads + self.num_kv_heads, self.head_dim)  # (T, H + 2 Hkv, D)
        k_cache, v_cache, k_scale, v_scale, k_mean = kv_cache  # a chatserve.kv_cache.LayerCache
        if decode_ops.usable(qkv, self.head_dim) and qkv.is_contiguous():
            self.rotary.rotate_(positions, qkv, num_qk_heads)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        else:
            q, k = self.rotary(positions, qkv[:, :num_qk_heads]).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, num_qk_heads:]  # (T, Hkv, D)
        if k_mean is not None:
            # K smoothing (chatserve/kv_smooth.py): every key of every path (prefill chunk,
            # decode, verification, prefix-cached blocks) is stored and read minus the same
            # mean, which shifts each query's scores by one constant: softmax is unchanged.
            k = k - k_mean
        kv_store(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=k_scale, v_scale=v_scale, kernels=attn.kernels)
        o = paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.cu_q_lens, self.scale,
                            k_scale=k_scale, v_scale=v_scale, kernels=attn.kernels)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if decode_ops.usable(gate_up, self.intermediate) and gate_up.is_contiguous():
            return self.down_proj(decode_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
