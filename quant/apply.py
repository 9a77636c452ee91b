"""quantize_weights(model, scheme): swap a loaded model's nn.Linear layers in place.

Runs after loading, so models/ never mentions quantization. Schemes:
- "int4": weight-only 4-bit in groups of 32 (quant/int4.py, kernels/int4_matmul.py): 0.625
  bytes per weight read per decode step. Every linear layer, the LM head included (a tied head
  gets its own 4-bit copy; the embedding table stays as it is).
- "int8": weight-only int8 per output channel, bf16 maths (quant/int8.py): the fast CPU path,
  ~2.5x fewer bytes per decode step than bf16. Includes the LM head (a fifth to a quarter of a
  small model's weights), which gets its own int8 copy when it is tied to the embedding.
- "bnb-int8", "bnb-nf4": bitsandbytes layers (quant/weights.py): they save memory but are slower
  than fp32 on this CPU, so they are for fitting a model, not for speed.
"""

from __future__ import annotations

from torch import nn

from quant.int4 import Int4Linear
from quant.int8 import Int8Linear

WEIGHT_QUANT_SCHEMES = ("int4", "int8", "bnb-int8", "bnb-nf4")


def quantize_weights(model: nn.Module, scheme: str) -> nn.Module:
    if scheme not in WEIGHT_QUANT_SCHEMES:
        raise ValueError(f"quantization: one of {WEIGHT_QUANT_SCHEMES}, got {scheme!r}")
    if scheme.startswith("bnb-"):
        from quant.weights import quantize_model

        return quantize_model(model, scheme.removeprefix("bnb-"))
    if scheme == "int4":
        from kernels import int4_matmul

        int4_matmul.is_available()  # build the CPU kernel now (once per machine), not in the first request
    layer_class = Int4Linear if scheme == "int4" else Int8Linear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, layer_class.from_linear(child))
    return model
