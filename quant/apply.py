"""quantize_weights(model, scheme): swap a loaded model's nn.Linear layers in place.

Runs after loading, so models/ never mentions quantization. Schemes:
- "int4": weight-only 4-bit. Linear layers whose in_features is a multiple of 256 in GGUF's Q4_K
  layout (quant/q4k.py: 4.75 bits per weight; the file's own Q4_K blocks when the layer is Q4_K
  there), others in groups of 32 (quant/int4.py: 5 bits); the LM head and the embedding table as
  int8 rows (an EAGLE head's kept LM head in int4: quantize_weights' int8_head).
- "int8": weight-only int8 per output channel, bf16 maths (quant/int8.py): the fast CPU path,
  ~2.5x fewer bytes per decode step than bf16. Includes the LM head (a fifth to a quarter of a
  small model's weights), which gets its own int8 copy when it is tied to the embedding.
- "bnb-int8", "bnb-nf4": bitsandbytes layers (quant/weights.py): they save memory but are slower
  than fp32 on this CPU, so they are for fitting a model, not for speed.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from chatserve.models.loader import StreamedLinear
from quant.int4 import Int4Linear, dequantize_int4, q4_1_layout
from quant.int8 import Int8Embedding, Int8Linear
from quant.q4k import Q4KLinear, blocks_to_layout, dequantize_q4k

WEIGHT_QUANT_SCHEMES = ("int4", "int8", "bnb-int8", "bnb-nf4")
NATIVE_SCHEMES = ("int4", "int8")
# CHATSERVE_Q4K=0 puts every int4 layer in groups of 32 (quant/int4.py), the layout before Q4_K:
# for side-by-side benchmarks in one run.
USE_Q4K = os.environ.get("CHATSERVE_Q4K", "1") != "0"  # the ones quantize_module does layer by layer (streamed while loading)


def quantize_weights(model: nn.Module, scheme: str, int8_head: bool = True) -> nn.Module:
    """Swap, in place, every layer of `model` that `scheme` quantizes; returns model. int8_head=False:
    an int4 model's `lm_head` goes to int4 like its other layers (an EAGLE head's kept rows, which
    choose a draft the target verifies, where the target's own LM head chooses the output)."""
    if scheme not in WEIGHT_QUANT_SCHEMES:
        raise ValueError(f"quantization: one of {WEIGHT_QUANT_SCHEMES}, got {scheme!r}")
    if scheme.startswith("bnb-"):
        from quant.weights import quantize_model

        model = quantize_model(model, scheme.removeprefix("bnb-"))
    else:
        prepare(scheme)
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                is_head = int8_head and f"{parent_name}.{name}".lstrip(".").startswith("lm_head")
                replacement = quantize_module(child, scheme, is_head=is_head)
                if replacement is not child:
                    setattr(parent, name, replacement)
    if hasattr(model, "reset_decode_stack"):  # a stack built before holds the old layers' weights
        model.reset_decode_stack()
    return model


def prepare(scheme: str) -> None:
    """Build what the scheme's kernels need now (once per machine), not in the first request."""
    if scheme == "int4":
        from kernels import quant_matmul

        quant_matmul.is_available()


def quantize_module(module: nn.Module, scheme: str, is_head: bool = False, file_rows=None) -> nn.Module:
    """The quantized twin of one layer, or the layer itself when the scheme leaves it alone.

    int4: linear layers whose in_features is a multiple of 256 (and out_features of 8) as Q4_K,
    other multiples of 64 in groups of 32 (the int4 kernel's pairs of groups), the rest as int8.
    `file_rows` = (GGUF type, blocks) of this layer from the model's GGUF file: Q4_K blocks become
    the Q4_K layer, Q4_1 blocks the groups of 32, as they are, when they decode to the float
    weight read (a row order the converter changed, as llama's q and k, does not); else the
    float weight is quantized. The embedding table becomes int8 rows (its lookups read a few
    rows, but it is the largest tensor of a small model: 151,936 x 1,536 for Qwen2.5-1.5B). The
    LM head (`is_head`) gets int8 rows without a dense copy, read a chunk of rows at a time when
    it comes as a StreamedLinear: at 4 bits it alone cost SmolLM2 +6.8%
    perplexity, at 8 bits +0.4% (benchmarks/weight_quality.py), as llama.cpp keeps its output
    tensor at 6-8 bits in Q4 files."""
    if isinstance(module, StreamedLinear):  # a head still in its file (chatserve/models/loader.py)
        assert scheme == "int4" and is_head, "only an int4 model's LM head is streamed"
        return Int8Linear.from_streamed(module)
    if isinstance(module, nn.Linear):
        if scheme == "int4" and is_head:
            return Int8Linear.from_linear(module, keep_dense=False)
        if scheme == "int4" and file_rows is not None:
            layer = _from_file(*file_rows, module)
            if layer is not None:
                return layer
        if scheme == "int4" and USE_Q4K and Q4KLinear.fits(module.in_features, module.out_features):
            return Q4KLinear.from_linear(module)
        if scheme == "int4" and module.in_features % 64 == 0:
            return Int4Linear.from_linear(module)
        return Int8Linear.from_linear(module)
    if scheme == "int4" and isinstance(module, nn.Embedding):
        return Int8Embedding.from_embedding(module)
    return module


def share_tied_rows(embedding: nn.Module | None, head: nn.Module) -> nn.Module:
    """A tied LM head and embedding table quantized to the same int8 rows keep one copy of them
    (the embedding reads the head's): 233 MB less for Qwen2.5-1.5B. Returns head."""
    if (isinstance(embedding, Int8Embedding) and isinstance(head, Int8Linear)
            and head.qweight.shape == embedding.qweight.shape and torch.equal(head.scales, embedding.scales)
            and torch.equal(head.int8_rows(), embedding.qweight)):
        embedding.share_rows(head)
    return head


CHECKED_ROWS = 64  # rows of a file's blocks decoded and compared with the weight read (_from_file)


def _from_file(kind: str, rows, linear: nn.Module) -> nn.Module | None:
    """The file's blocks as a layer, if they are `linear`'s weight (else None). Checked on the plain
    layout, before the layer reorders it for its kernel (reading a Q4_K layer's weight back through
    its interleaved bytes cost Qwen2.5-1.5B's load ~5 s), and on CHECKED_ROWS rows drawn at random
    (every row of a smaller layer): what goes wrong is the whole tensor's (another tensor, or a row
    order the converter changed: llama's q and k permutation keeps 2 rows of every head's 64 in
    place, so 64 drawn rows all in place has odds of (1/32)^64), and decoding every row cost ~9%
    of a start."""
    if kind == "Q4_K" and USE_Q4K and Q4KLinear.fits(linear.in_features, linear.out_features):
        layer, layout, dequantize = Q4KLinear, blocks_to_layout(rows), dequantize_q4k
    elif kind == "Q4_1" and linear.in_features % 64 == 0:
        layer, layout, dequantize = Int4Linear, q4_1_layout(rows), dequantize_int4
    else:
        return None
    n, half_k = layout[0].shape  # codes [N, K/2] in both layouts
    if (n, 2 * half_k) != tuple(linear.weight.shape):
        return None
    checked = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:CHECKED_ROWS]
    if not torch.equal(dequantize(*(part[checked] for part in layout)), linear.weight[checked].float()):
        return None
    return layer(*layout, linear.bias)
