"""Weight quantization after loading: swap nn.Linear for bitsandbytes int8 / nf4 layers.

`quantize_model(model, scheme)` walks the module tree, so model code never mentions
quantization. Schemes: "int8" (LLM.int8 `Linear8bitLt`, per-row absmax weights; activations
are quantized per row too) and "nf4" (`Linear4bit`, 4-bit NormalFloat, blocks of 64 weights,
dequantized to the compute dtype before each matmul).

On a CPU this saves memory, not time: bitsandbytes 0.50 at batch 1 measured int8 7-15x and
nf4 3-8x slower than an fp32 GEMV (/work/shared/CPU-NOTES.md), so use it when weights would
not fit, not for speed. Needs `pip install bitsandbytes`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

WEIGHT_SCHEMES = ("int8", "nf4")


def is_available() -> bool:
    try:
        _bnb()
    except ImportError:
        return False
    return True


def quantize_model(model: nn.Module, scheme: str, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace, in place, every nn.Linear whose qualified name does not end with an entry of
    `skip` (the lm_head is often tied to the embedding, and small next to it). Returns model."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight quantization scheme must be one of {WEIGHT_SCHEMES}, got {scheme!r}")
    bnb = _bnb()
    targets = [
        (parent, child_name, child)
        for parent_name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and not any(f"{parent_name}.{child_name}".lstrip(".").endswith(s) for s in skip)
    ]
    for parent, child_name, linear in targets:
        setattr(parent, child_name, _quantized(bnb, linear, scheme))
    return model


def _quantized(bnb, linear: nn.Linear, scheme: str) -> nn.Module:
    """The bitsandbytes twin of `linear`, quantized on its device (bnb quantizes on .to())."""
    weight = linear.weight.data  # [out_features, in_features]
    has_bias = linear.bias is not None
    if scheme == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                    has_fp16_weights=False, threshold=0.0)
        layer.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                  compute_dtype=weight.dtype, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to(weight.device)


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """[out_features, in_features] float32 weight a quantized layer stands for (for tests)."""
    bnb = _bnb()
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    row_absmax = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB  # moves on forward
    return layer.weight.data.float() * row_absmax.float()[:, None] / 127.0


def _bnb():
    with warnings.catch_warnings():  # "kernels package not found" on CPU: harmless
        warnings.simplefilter("ignore")
        import bitsandbytes

    return bitsandbytes
