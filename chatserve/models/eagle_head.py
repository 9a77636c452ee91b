"""EagleHead: an EAGLE-style drafter (Li et al. 2024, arXiv:2401.15077) that reads the target's
features, i.e. the final norm's output (what the target's LM head reads) at each position.

Row i of the head takes the target's feature at position i - 1 and the embedding of token i
(the target's own embedding table, shared) and predicts the target's feature at position i:

    x_i = fc([f_{i-1}; embed(t_i)])        f_{-1} = 0
    y_i = decoder_layer(x_i)                one layer of the target's shape, its own KV
    f^_i = norm(y_i)                        ~ f_i, so f^_i feeds row i + 1 when drafting
    logits_i = lm_head(f^_i)                over `head_token_ids` only (trimmed vocabulary)

A head may read EAGLE-3's features instead (Li et al. 2025, arXiv:2503.01840): the residual
stream after a low, a middle and a high layer of the target (`feature_layers`), each RMS-normalized
without weights, fused by a learned map into one vector of the hidden size: f_i := fuse([n(h_a);
n(h_b); n(h_c)]) at row i + 1's input. A chain's later rows read the head's own norm(y) as before
(it is trained to be the next input, not the final feature). The target runner returns a
position's raw features as [the captured layers...; the final norm's output] (ModelRunner.
feature_layers); input_features() makes f of them, target_features() takes the final one (what
training predicts tokens from). With no feature_layers both are the final feature (EAGLE-1).

On measured SmolLM2-135M data the fused features took a chain of 4's mean accepted length from
1.50 to 1.67 (benchmarks/head_features.py, docs/benchmarks.md "Session 35").

The head's KV at position i is a function of tokens 0..i alone (f_{i-1} depends on tokens up
to i - 1), like the target's, so it lives in the same paged blocks and a block's head KV is as
shareable as its target KV. forward() is the paged path the engine runs; forward_dense() the
same maths over whole sequences with autograd, for training (and as the paged path's reference).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.batch import AttnMetadata
from chatserve.models.layers import Linear, RMSNorm, Rotary
from chatserve.models.llama import DecoderLayer, LayerStack, rope_inv_freq


class EagleHead(nn.Module):
    def __init__(self, cfg, max_positions: int, head_token_ids: torch.Tensor, rotary: Rotary | None = None,
                 feature_layers: tuple[int, ...] = (), intermediate_size: int | None = None):
        """`rotary`: the target's tables, shared (the same cfg makes the same ones), else new.
        `feature_layers`: the target layers whose outputs it fuses (EAGLE-3); () reads the final feature.
        `intermediate_size`: the layer's MLP width; None: the target's. The MLP is most of a layer of
        the target's shape (Qwen2.5-Coder-1.5B: 41M of 47M parameters), so a narrower one trains and
        drafts with less compute."""
        super().__init__()
        if intermediate_size is not None and intermediate_size != cfg.intermediate_size:
            if intermediate_size < 1:
                raise ValueError(f"intermediate_size: must be >= 1, got {intermediate_size}")
            cfg = copy.copy(cfg)  # the target's config with the head's MLP width, for DecoderLayer
            cfg.intermediate_size = intermediate_size
        hidden = cfg.hidden_size
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if any(not 0 <= i < cfg.num_hidden_layers for i in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers}: the target has {cfg.num_hidden_layers} layers")
        self.fuse = Linear(len(self.feature_layers) * hidden, hidden, bias=False) if self.feature_layers else None
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        self.hidden_size = hidden
        self.vocab_size = cfg.vocab_size
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.fc = Linear(2 * hidden, hidden, bias=True)
        rotary = rotary or Rotary(*rope_inv_freq(cfg, self.head_dim), max_positions)
        self.layer = DecoderLayer(cfg, rotary, qkv_bias)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = Linear(hidden, len(head_token_ids), bias=False)  # rows of the target's LM head
        self.register_buffer("head_token_ids", head_token_ids.long())  # [num_kept]
        self.stack = LayerStack(hidden, self.head_dim, cfg.intermediate_size)  # its layer in one C++ call
        self._chain_of = self._chain = None  # the stack chain_stack last set up, and it if it drafts chains

    @classmethod
    def from_state(cls, cfg, max_positions: int, state_dict: dict, feature_layers=(),
                   rotary: Rotary | None = None) -> "EagleHead":
        """A head holding `state_dict`'s weights (a saved head's or a training checkpoint's): its
        LM head's rows are the state's head_token_ids and its MLP width the state's down_proj's.
        Raises ValueError for feature layers the target does not have."""
        head = cls(cfg, max_positions, state_dict["head_token_ids"], rotary=rotary, feature_layers=feature_layers,
                   intermediate_size=cls.state_width(state_dict))
        head.load_state_dict(state_dict)
        return head

    @staticmethod
    def state_width(state_dict: dict) -> int:
        """The MLP width of the head whose weights `state_dict` holds."""
        return state_dict["layer.mlp.down_proj.weight"].shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.layer.mlp.intermediate

    def reset_decode_stack(self) -> None:
        self.stack.reset()

    def chain_stack(self, embed: nn.Module, kv_cache, block_size: int):
        """The layer's DecodeStack over `kv_cache` holding the head's other pieces too (fc, norm, LM
        head, the target's `embed`): DecodeStack.draft_chain drafts a greedy chain in one C++ call.
        None where a piece has no C++ path (then HeadRunner drafts with the modules)."""
        built = self.stack.built_for([self.layer], [kv_cache])
        if built is not None and self._chain_of is not built:
            pieces = self._chain_pieces(embed)
            if pieces is not None:
                built.set_draft_head(*pieces, block_size)
            self._chain_of, self._chain = built, built if pieces is not None else None
        return None if built is None else self._chain

    def _chain_pieces(self, embed: nn.Module) -> tuple | None:
        """set_draft_head's arguments but the block size, or None."""
        from kernels import decode_ops
        from quant.int8 import Int8Embedding

        fc, lm_head = (getattr(m, "stack_weights", lambda: None)() for m in (self.fc, self.lm_head))
        if fc is None or lm_head is None or self.norm.weight.dtype != torch.float32:
            return None
        if isinstance(embed, Int8Embedding):
            table = (embed.qweight, embed.scales, embed.packed)
        elif isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32:
            table = (embed.weight.detach(), decode_ops.NO_TENSOR, False)
        else:
            return None
        return fc, self.norm.weight.detach(), self.norm.eps, lm_head, *table, self.head_token_ids

    @property
    def feature_width(self) -> int:
        """The width of a position's raw features: (len(feature_layers) + 1) x hidden."""
        return (len(self.feature_layers) + 1) * self.hidden_size

    def input_features(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [..., feature_width] -> f [..., hidden], what row i + 1 reads for position i: the
        fused captured layers, or the final feature itself."""
        if raw.shape[-1] != self.feature_width:
            raise ValueError(f"features of width {raw.shape[-1]}; this head reads {self.feature_width} "
                             f"(layers {list(self.feature_layers)} and the final norm's output)")
        if self.fuse is None:
            return raw
        return self.fuse(raw[..., : len(self.feature_layers) * self.hidden_size])

    def target_features(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [..., feature_width] -> the final norm's output [..., hidden] (what the LM head reads)."""
        return raw[..., -self.hidden_size :]

    def forward(self, features, embeds, positions, attn: AttnMetadata, kv_cache) -> torch.Tensor:
        """features [T, hidden] (f_{i-1} per row), embeds [T, hidden] (embed(t_i)) -> y [T, hidden],
        the layer's output before the norm; K and V of each row are stored by attn.slot_mapping."""
        x = self.fc(torch.cat((features, embeds), dim=-1))  # [T, hidden]
        out = self.stack.run([self.layer], x, positions, attn, [kv_cache])
        if out is not None:
            return out
        x, delta = self.layer(positions, x, attn, kv_cache)
        return x + delta

    def compute_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """predicted features [N, hidden] (after self.norm) -> [N, vocab] float32 logits, -inf
        outside the head's vocabulary."""
        return self.over_vocab(self.kept_logits(predicted))

    def kept_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """predicted features [N, hidden] -> [N, num_kept] float32 logits of head_token_ids (sorted,
        so the first best of these is the first best of compute_logits' row)."""
        return self.lm_head(predicted).float()

    def over_vocab(self, kept: torch.Tensor) -> torch.Tensor:
        """kept_logits' [N, num_kept] -> [N, vocab], -inf outside the head's vocabulary."""
        logits = kept.new_full((kept.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head_token_ids] = kept
        return logits

    def forward_dense(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The paged forward over whole sequences with causal attention, differentiable.
        features [B, T, feature_width] (raw: input_features() is applied here), embeds [B, T,
        hidden] (row j at position j) -> y [B, T, hidden]."""
        x, q, k, v = self._dense_qkv(self.input_features(features), embeds)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.layer.self_attn.scale,
                                           enable_gqa=True)  # (B, H, T, D)
        return self._dense_out(x, o)

    def forward_unrolled(self, features: torch.Tensor, embeds: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test (as EAGLE-3 and HASS train): `depth` passes over whole sequences,
        pass s computing every row as the (s+1)-th token of a chain drafted from the row s
        positions back. Pass 0 is forward_dense. Pass s > 0 reads, at row i, pass s-1's predicted
        feature norm(y_{i-1}) instead of the target's, and attends as drafting does: to pass 0's
        keys up to position i - s (the head KV written from the target's features) and to pass
        r's key at position i - s + r for r = 1..s (the chain's own rows). Rows i < s of pass s
        have no such chain (their anchor is before the window): callers leave them out.
        features [B, T, feature_width] (raw), embeds [B, T, hidden] -> [y of pass s] each [B, T, hidden]."""
        attn = self.layer.self_attn
        features = self.input_features(features)
        outs, keys, values = [], [], []
        for s in range(depth):
            if s:
                predicted = _rms_norm(outs[-1], self.norm)
                features = torch.cat((torch.zeros_like(predicted[:, :1]), predicted[:, :-1]), dim=1)
            x, q, k, v = self._dense_qkv(features, embeds)
            keys.append(k)
            values.append(v)
            outs.append(self._dense_out(x, _chain_attention(q, keys, values, attn.scale)))
        return outs

    def _dense_qkv(self, features, embeds):
        """-> x (the layer's input [B, T, hidden]), q (B, H, T, D), k, v (B, Hkv, T, D), RoPE'd."""
        layer, attn = self.layer, self.layer.self_attn
        b, t, _ = features.shape
        x = F.linear(torch.cat((features, embeds), dim=-1), self.fc.weight, self.fc.bias)
        h = _rms_norm(x, layer.input_layernorm)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        qkv = qkv.view(b, t, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)  # (B, T, H + 2 Hkv, D)
        num_qk = attn.num_heads + attn.num_kv_heads
        positions = torch.arange(t)
        qk = attn.rotary(positions, qkv[:, :, :num_qk].transpose(0, 1).reshape(t, b * num_qk, -1))
        qk = qk.view(t, b, num_qk, -1).transpose(0, 1)  # (B, T, H + Hkv, D)
        q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=2)
        v = qkv[:, :, num_qk:]
        return x, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _dense_out(self, x, o):
        """x + attention output o (B, H, T, D) through o_proj, then the MLP with its residual."""
        layer, attn = self.layer, self.layer.self_attn
        b, _, t, _ = o.shape
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, attn.q_size), attn.o_proj.weight)
        mlp = layer.mlp
        gate, up = F.linear(_rms_norm(x, layer.post_attention_layernorm), mlp.gate_up_proj.weight).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)


def _chain_attention(q, keys, values, scale: float) -> torch.Tensor:
    """Pass s = len(keys) - 1 of EagleHead.forward_unrolled: q (B, H, T, D); keys[r], values[r]
    (B, Hkv, T, D) of pass r. Row i sees keys[0] at j <= i - s and keys[r] at j = i - s + r."""
    s = len(keys) - 1
    b, h, t, d = q.shape
    group = h // keys[0].shape[1]
    expand = lambda x: x.repeat_interleave(group, dim=1)  # noqa: E731  (B, H, T, D)
    rows = torch.arange(t)
    scores = [(q @ expand(keys[0]).transpose(-1, -2)) * scale]  # (B, H, T, T)
    scores[0] = scores[0].masked_fill(rows[None, :] > rows[:, None] - s, float("-inf"))
    shifted_values = []
    for r in range(1, s + 1):
        shift = s - r  # row i reads position i - shift
        k_r = F.pad(expand(keys[r]), (0, 0, shift, 0))[:, :, :t]
        shifted_values.append(F.pad(expand(values[r]), (0, 0, shift, 0))[:, :, :t])
        score = (q * k_r).sum(-1, keepdim=True) * scale  # (B, H, T, 1)
        scores.append(score.masked_fill((rows < shift)[:, None], float("-inf")))
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :t] @ expand(values[0])
    for r, v_r in enumerate(shifted_values, start=1):
        out = out + weights[..., t + r - 1 : t + r] * v_r
    return out


def _rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """In float32, back in x's dtype: under bf16 autocast (train_head) x is bf16 and the weight
    float32, a pair F.rms_norm has no fused kernel for; a no-op cast for a float32 head."""
    return F.rms_norm(x.float(), norm.weight.shape, norm.weight.float(), norm.eps).to(x.dtype)
