"""Weight quantization through bitsandbytes: each quantized layer computes x @ dequantize(w).T
(exactly for nf4; int8 also quantizes activations), and quantize_model swaps only the Linears."""

import pytest
import torch
from torch import nn

from quant.weights import dequantized_weight, is_available, quantize_model

pytestmark = pytest.mark.skipif(not is_available(), reason="bitsandbytes not installed")


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))
                                    for _ in range(2))
        self.lm_head = nn.Linear(128, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied, as in SmolLM2

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)


def test_nf4_layer_is_the_dequantized_matmul(generator):
    linear = nn.Linear(256, 96)
    quantize_model(container := nn.Sequential(linear), "nf4")
    layer = container[0]
    x = torch.randn(5, 256, generator=generator)
    expected = x @ dequantized_weight(layer).T + layer.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    # 4 bits per weight + a scale per 64: the round trip stays within a few percent
    assert (dequantized_weight(layer) - linear.weight).norm() / linear.weight.norm() < 0.12


def test_int8_layer_close_to_the_dequantized_matmul(generator):
    linear = nn.Linear(256, 96)
    quantize_model(container := nn.Sequential(linear), "int8")
    layer = container[0]
    assert layer.weight.dtype == torch.int8
    x = torch.randn(5, 256, generator=generator)
    expected = x @ dequantized_weight(layer).T + layer.bias
    assert ((layer(x) - expected).norm() / expected.norm()) < 0.02  # activation rounding only
    row_step = linear.weight.abs().amax(1, keepdim=True) / 127  # one int8 step per row
    assert ((dequantized_weight(layer) - linear.weight).abs() <= row_step).all()


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_quantize_model_swaps_linears_but_not_lm_head(scheme, generator):
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randn(3, 128, generator=generator)
    before = model(x)
    quantize_model(model, scheme)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight
    assert all(type(m) is not nn.Linear for m in model.blocks.modules())
    after = model(x)
    assert (after - before).norm() / before.norm() < 0.1


def test_unknown_scheme_is_an_error():
    with pytest.raises(ValueError, match="int4"):
        quantize_model(nn.Linear(4, 4), "int4")
