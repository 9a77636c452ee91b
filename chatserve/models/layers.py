"""Building blocks of the decoder: RMSNorm, rotary embedding, paged attention, gated MLP.

Activations are flat over the ragged batch: [num_tokens, hidden]. No quantization here.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from chatserve.batch import AttnMetadata
from kernels.attention import paged_attention
from kernels.kv_store import kv_store


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Non-interleaved (rotate-half) RoPE, as in HF checkpoints. cos/sin are tabulated once."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: (T, H, D), k: (T, Hkv, D)
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, D/2)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool, rotary: Rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.rotary = rotary
        self.scale = head_dim**-0.5

    def forward(self, positions, x, attn: AttnMetadata, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache, k_scale, v_scale = kv_cache  # a chatserve.kv_cache.LayerCache
        kv_store(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        o = paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.cu_q_lens, self.scale,
                            k_scale=k_scale, v_scale=v_scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
