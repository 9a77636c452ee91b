"""quantize_weights(model, scheme): swap a loaded model's nn.Linear layers in place.

Runs after loading, so models/ never mentions quantization. Schemes:
- "int8": weight-only int8 per output channel, bf16 maths (quant/int8.py): the fast CPU path,
  ~2.5x fewer bytes per decode step than bf16. Includes the LM head (a fifth to a quarter of a
  small model's weights), which gets its own int8 copy when it is tied to the embedding.
- "bnb-int8", "bnb-nf4": bitsandbytes layers (quant/weights.py): they save memory but are slower
  than fp32 on this CPU, so they are for fitting a model, not for speed.
"""

from __future__ import annotations

from torch import nn

from quant.int8 import Int8Linear

WEIGHT_QUANT_SCHEMES = ("int8", "bnb-int8", "bnb-nf4")


def quantize_weights(model: nn.Module, scheme: str) -> nn.Module:
    if scheme not in WEIGHT_QUANT_SCHEMES:
        raise ValueError(f"quantization: one of {WEIGHT_QUANT_SCHEMES}, got {scheme!r}")
    if scheme.startswith("bnb-"):
        from quant.weights import quantize_model

        return quantize_model(model, scheme.removeprefix("bnb-"))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
    return model
