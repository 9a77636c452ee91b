"""Decoder-only LM for the Llama family (SmolLM2, Llama 2/3, Mistral) and Qwen2 (QKV bias).

forward(input_ids [T], positions [T], attn, kv_caches) -> hidden [T, hidden]; logits are
computed only for the rows the batch asks for (compute_logits).
"""

from __future__ import annotations

import torch
from torch import nn

from chatserve.batch import AttnMetadata
from chatserve.models.layers import MLP, Attention, Linear, RMSNorm, Rotary, rms_norm
from kernels import decode_ops

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
        # Steps of few float32 rows run the layers as one C++ call (kernels/decode_stack_cpu.cpp)
        # with the same kernels in the same order as the modules below: same numbers, ~0.2 ms of
        # Python per layer fewer. stack.enabled = False: always the modules (the tests' reference).
        self.stack = LayerStack(cfg.hidden_size, self.head_dim, cfg.intermediate_size)

    def reset_decode_stack(self) -> None:
        """Forget the stack: call after replacing layers (quantization) once a forward has run."""
        self.stack.reset()

    def forward(self, input_ids, positions, attn: AttnMetadata, kv_caches, capture: tuple[int, ...] = (),
                norms: tuple[torch.Tensor, float] | None = None):
        """-> hidden [T, hidden] (before the final norm); with `capture` (increasing layer indices)
        -> (hidden, [the residual stream after each captured layer]): x + delta as the next layer's
        norm adds it in place, so the same numbers, from the one C++ call or the modules alike.
        With `norms` = (weight, eps) -> (hidden, features [T, (len(capture) + 1) x hidden]): the
        captured outputs RMS-normalized by weight, then the final norm's output (an EAGLE head's
        features; in the stack's one C++ call where it runs these rows)."""
        if capture and (list(capture) != sorted(set(capture)) or not 0 <= capture[0] <= capture[-1] < self.num_layers):
            raise ValueError(f"capture: increasing layer indices below {self.num_layers}, got {capture}")
        x = self.embed_tokens(input_ids)  # [T, hidden]
        stack_norms = None if norms is None else (*norms, self.norm.weight, self.norm.eps)
        out = self.stack.run(self.layers, x, positions, attn, kv_caches, capture, stack_norms)
        if out is not None:
            return out
        delta, captured = None, []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, delta = layer(positions, x, attn, kv_cache, delta)
            if i in capture:
                captured.append(x + delta)
        hidden = x + delta
        if norms is not None:
            return hidden, torch.cat([*(rms_norm(h, *norms) for h in captured), self.norm(hidden)], dim=-1)
        return (hidden, captured) if capture else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows that need logits) -> [N, vocab] float32."""
        return self.lm_head(self.norm(hidden)).float()


class LayerStack:
    """Decoder layers as one kernels.decode_ops DecodeStack, built on first use for a list of KV
    caches (and again when it changes), or never where a piece has no C++ path (a quantized or
    smoothed KV cache, a non-float32 model, bitsandbytes layers)."""

    def __init__(self, hidden: int, head_dim: int, intermediate: int):
        self.dims = (hidden, head_dim, intermediate)
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        self.caches: list | None = None  # the KV caches the stack was built for
        self.built = None

    def run(self, layers, x: torch.Tensor, positions, attn: AttnMetadata, kv_caches, capture: tuple[int, ...] = (),
            norms: tuple | None = None):
        """The layers' output (x + the last delta) for this step, x updated in place as the modules
        do, and with `capture` (hidden, [the output of each captured layer]), or with `norms` too
        (weight, eps, final weight, final eps: DecoderLM.forward's) (hidden, features); None
        where the modules must run it (then nothing was touched)."""
        if not self.takes(x, attn.kernels):
            return None
        built = self.built_for(layers, kv_caches)
        if built is None:
            return None
        args = (x, positions, attn.slot_mapping, attn.block_tables, *attn.query_rows())
        if norms is not None:
            return built.forward_features(*args, list(capture), *norms)
        return built.forward_captured(*args, list(capture)) if capture else built.forward(*args)

    def takes(self, x: torch.Tensor, kernels: str) -> bool:
        """Whether the C++ stack may run these rows x [T, hidden] (else the modules do)."""
        return (self.enabled and kernels == "torch" and x.shape[0] <= decode_ops.STACK_MAX_ROWS and x.is_contiguous()
                and decode_ops.usable(x, x.shape[-1]))

    def built_for(self, layers, kv_caches):
        """The DecodeStack of these layers over these caches (built on first use, again when the
        caches change), or None where a piece has no C++ path."""
        if self.caches is None or len(self.caches) != len(kv_caches) or any(
                a is not b for a, b in zip(self.caches, kv_caches)):
            self.caches, self.built = list(kv_caches), self._build(layers, kv_caches)
        return self.built

    def _build(self, layers, kv_caches):
        if not decode_ops.usable(torch.empty(0), *self.dims):
            return None
        first = layers[0]
        attn = first.self_attn
        stack = decode_ops.decode_stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, first.input_layernorm.eps,
                                        attn.scale, attn.rotary.cos, attn.rotary.sin)
        for layer, cache in zip(layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
            linears = [getattr(m, "stack_weights", lambda: None)()
                       for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if (None in linears or cache.k_scale is not None or cache.k_mean is not None
                    or not decode_ops.cache_usable(cache.k_cache) or any(n.dtype != torch.float32 for n in norms)):
                return None
            stack.add_layer(*norms, cache.k_cache, cache.v_cache, linears)
        return stack


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
