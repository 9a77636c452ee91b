"""Decoder-only LM for the Llama family (SmolLM2, Llama 2/3, Mistral) and Qwen2 (QKV bias).

forward(input_ids [T], positions [T], attn, kv_caches) -> hidden [T, hidden]; logits are
computed only for the rows the batch asks for (compute_logits).
"""

from __future__ import annotations

import torch
from torch import nn

from chatserve.batch import AttnMetadata
from chatserve.models.layers import MLP, Attention, Linear, RMSNorm, Rotary

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: Rotary, qkv_bias: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, qkv_bias, rotary
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions, x, attn: AttnMetadata, kv_cache, residual=None):
        """-> (x, delta): the layer's output is x + delta, which the next layer adds as it
        normalizes (one pass instead of two; the final norm takes the last delta). x is
        updated in place."""
        attn_out = self.self_attn(positions, self.input_layernorm(x, residual), attn, kv_cache)
        return x, self.mlp(self.post_attention_layernorm(x, attn_out))


class DecoderLM(nn.Module):
    def __init__(self, cfg, max_positions: int):
        super().__init__()
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        rotary = Rotary(*rope_inv_freq(cfg, self.head_dim), max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, attn: AttnMetadata, kv_caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta = layer(positions, x, attn, kv_cache, delta)
        return x + delta

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows that need logits) -> [N, vocab] float32."""
        return self.lm_head(self.norm(hidden)).float()


def rope_inv_freq(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies + attention scaling, from transformers' own rope tables."""
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(scaling)
