"""Weight-only int4 (quant/int4.py, kernels/quant_matmul.py): the packing, the C++ kernel against
its plain-torch reference, rows that do not depend on how many rows share a call, the layer's two
paths and the engine on int4 weights. Greedy speculation equal to plain decoding on int4:
tests/chatserve/test_spec_exact_int8.py."""

import pytest
import torch
from torch import nn

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from kernels import decode_ops
from kernels import quant_matmul as kernel
from quant import int4
from quant.apply import quantize_weights
from quant.int4 import Int4Linear, dequantize_int4, make_params, pack_codes, quantize_int4, unpack_codes

def test_kernel_builds_here():
    """CI machines have a compiler and an AVX2 CPU: the fast path must be the one tested."""
    assert kernel.is_available()


def test_kernel_runs_on_every_torch_thread():
    """at::parallel_for is a header template around `#pragma omp parallel`: built without
    -fopenmp it runs everything on the calling thread (2x slower here, and nothing says so)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert kernel.parallel_threads() == 2
    finally:
        torch.set_num_threads(saved)


def random_layer(n: int, k: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=generator)
    codes, d, m = quantize_int4(w)
    return w, pack_codes(codes), make_params(d, m)


def test_quantize_is_within_half_a_step_and_packing_round_trips(generator):
    w = torch.randn(40, 128, generator=generator)
    codes, d, m = quantize_int4(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and d.shape == (40, 4)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)
    deq = (codes.view(40, 4, 32).float() * d[..., None] + m[..., None]).view(40, 128)
    assert ((deq - w).abs().view(40, 4, 32) <= d[..., None] / 2 + 1e-6).all()
    # every group uses both ends of the code range (min -> 0, max -> 15)
    assert (codes.view(40, 4, 32).amin(-1) == 0).all() and (codes.view(40, 4, 32).amax(-1) == 15).all()


def test_packed_byte_layout():
    """Byte j of a pair of groups holds k = 64p + j (low nibble) and k = 64p + 32 + j (high nibble)."""
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 1], codes[0, 33], codes[0, 66], codes[0, 127] = 3, 5, 7, 15
    packed = pack_codes(codes)
    assert packed.shape == (1, 64) and packed[0, 1] == 3 | 5 << 4 and packed[0, 34] == 7 and packed[0, 63] == 15 << 4
    assert int(packed.count_nonzero()) == 3
    params = make_params(torch.full((1, 4), 2.0), torch.full((1, 4), -1.0))
    assert params.shape == (1, 2, 4) and params[0, 0, 3] == 2.0 and params[0, 1, 0] == -1.0


def test_kernel_dequantize_equals_reference(generator):
    _, packed, params = random_layer(48, 576, generator)  # 18 groups: 8 + 8 + a tail of 2
    assert torch.equal(kernel.int4_dequantize(packed, params), dequantize_int4(packed, params))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_kernel_matches_its_reference(rows, generator):
    _, packed, params = random_layer(72, 576, generator)
    x = torch.randn(rows, 576, generator=generator)
    x[0, :32] = 0.0  # an all-zero activation group
    torch.testing.assert_close(kernel.int4_matmul(x, packed, params), kernel.int4_matmul_ref(x, packed, params),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 45])
def test_one_call_layer_equals_the_separate_calls(rows, generator):
    """kernel.int4_linear (quantize, multiply, bias in one call) gives int4_matmul + bias exactly."""
    w = torch.randn(80, 192, generator=generator)
    packed, params = pack_codes(quantize_int4(w)[0]), make_params(*quantize_int4(w)[1:])
    x, bias = torch.randn(rows, 192, generator=generator), torch.randn(80, generator=generator)
    assert torch.equal(kernel.int4_linear(x, packed, params), kernel.int4_matmul(x, packed, params))
    assert torch.equal(kernel.int4_linear(x, packed, params, bias), kernel.int4_matmul(x, packed, params) + bias)


def test_reference_is_close_to_the_float_matmul(generator):
    """Activation quantization (int8 per 32) costs well under 1% of the output's scale."""
    _, packed, params = random_layer(64, 256, generator)
    x = torch.randn(6, 256, generator=generator)
    exact = x @ dequantize_int4(packed, params).t()
    err = (kernel.int4_matmul_ref(x, packed, params) - exact).abs().max()
    assert err < 0.01 * exact.abs().max()


def test_kernel_rows_do_not_depend_on_the_row_count(generator):
    _, packed, params = random_layer(100, 128, generator)
    x = torch.randn(int4.SMALL_M, 128, generator=generator)
    alone = kernel.int4_matmul(x[:1], packed, params)
    for rows in range(2, int4.SMALL_M + 1):
        out = kernel.int4_matmul(x[:rows], packed, params)
        assert torch.equal(out[:1], alone), rows
        assert torch.equal(out[rows - 1 : rows], kernel.int4_matmul(x[rows - 1 : rows], packed, params)), rows


@pytest.mark.parametrize("rows", [1, 5, int4.SMALL_M, int4.SMALL_M + 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_dequantized_matmul(rows, bias, dtype, generator):
    linear = nn.Linear(128, 96, bias=bias)
    layer = Int4Linear.from_linear(linear)
    x = torch.randn(2, rows, 128, generator=generator).to(dtype)
    ref = x.float() @ dequantize_int4(*layer.layout()).t()
    if bias:
        ref = ref + linear.bias.detach()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, rows, 96)
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_interleaving_by_8_keeps_every_code_and_its_place(generator):
    packed = pack_codes(torch.randint(0, 16, (24, 128), generator=generator, dtype=torch.uint8))
    params = torch.randn(24, 2, 4, generator=generator).half()
    codes8, params8 = int4.interleave(packed, params)
    assert codes8.shape == (3, 4, 128) and params8.shape == (3, 4, 16)
    for got, want in zip(int4.deinterleave(codes8, params8), (packed, params)):
        assert torch.equal(got, want)
    plain = unpack_codes(packed)  # feature 8 g + n, group b, code index i: where tile_x8 reads it
    g, n, b, i = 2, 5, 3, 21  # byte 32 q + 4 n + i % 4 of the group, q = (i % 16) // 4, high nibble if i >= 16
    byte = codes8[g, b, 32 * ((i % 16) // 4) + 4 * n + i % 4]
    assert ((byte >> 4) if i >= 16 else (byte & 15)) == plain[8 * g + n, 32 * b + i]
    assert params8[g, b, n] == params[8 * g + n, 0, b] and params8[g, b, 8 + n] == params[8 * g + n, 1, b]


@pytest.mark.parametrize("k", [64, 576])
def test_the_interleaved_layer_equals_the_row_major_one(k, generator):
    """Same codes and scales, another summation order: equal to the reference to float32 rounding,
    and each row what it is alone (speculation's verification rows rely on it), for every row tile
    and for a prefill-sized chunk (interleaved, every row count takes the kernel)."""
    linear = nn.Linear(k, 48, bias=True)
    layout = Int4Linear.from_linear(linear).layout()
    x8 = Int4Linear(*layout, linear.bias, interleaved=True)
    plain = Int4Linear(*layout, linear.bias, interleaved=False)
    assert "interleaved by 8" in repr(x8) and torch.equal(x8.weight(), plain.weight())
    x = torch.randn(140, k, generator=generator)
    y = x8(x)
    ref = kernel.int4_matmul_ref(x, plain.packed, plain.params) + linear.bias.detach()
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in (1, 2, 3, 4, 5):
        assert torch.equal(x8(x[:rows]), y[:rows])
    assert torch.equal(x8(x[137:138]), y[137:138])
    assert x8.stack_weights()[0] == decode_ops.LINEAR_INT4X8 and plain.stack_weights()[0] == decode_ops.LINEAR_INT4


def test_the_layout_is_interleaved_where_the_cpu_has_no_vnni_and_features_come_in_eights():
    assert Int4Linear.from_linear(nn.Linear(64, 16)).interleaved == (not kernel.vnni_enabled())
    assert not Int4Linear.from_linear(nn.Linear(64, 12)).interleaved


def test_without_the_kernel_the_layer_dequantizes(monkeypatch, generator):
    linear = nn.Linear(128, 40)
    layer = Int4Linear.from_linear(linear)
    x = torch.randn(3, 128, generator=generator)
    monkeypatch.setattr(kernel, "is_available", lambda: False)
    expected = x @ dequantize_int4(*layer.layout()).t() + linear.bias.detach()
    torch.testing.assert_close(layer(x), expected)


def test_quantize_weights_int4_swaps_every_layer(generator):
    """Linears with in_features % 64 == 0 become int4 (others int8), the embedding int8 rows; a
    tied head keeps its own copy of the table's values."""
    from quant.int8 import Int8Embedding, Int8Linear, dequantize_int8

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(64, 64)
            self.layers = nn.Sequential(nn.Linear(64, 64), nn.Linear(96, 8))
            self.lm_head = nn.Linear(64, 64, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    model = Tiny()
    table = model.embed_tokens.weight.detach().clone()
    quantize_weights(model, "int4")
    assert type(model.embed_tokens) is Int8Embedding and type(model.lm_head) is Int8Linear
    assert [type(m) for m in model.layers] == [Int4Linear, Int8Linear]
    assert model.lm_head.dense_weight is None  # the head keeps no dense copy
    ids = torch.tensor([3, 0, 63])
    step = table.abs().amax() / 127
    torch.testing.assert_close(model.embed_tokens(ids), table[ids], atol=step.item(), rtol=0)
    head = dequantize_int8(model.lm_head.int8_rows(), model.lm_head.scales)
    torch.testing.assert_close(head, table, atol=step.item(), rtol=0)
    x = torch.randn(40, 64)  # past SMALL_M rows: the same kernel as for a few (activations in int8)
    y, want = model.lm_head(x), x @ head.t()
    assert torch.equal(y[35:36], model.lm_head(x[35:36]))
    assert (y - want).norm() / want.norm() < 0.01


def test_int4_engine_logits_stay_close_to_fp32(tiny_llama_dir):
    """Next-token logits of the int4 model (decode path and prefill path) stay near the fp32
    model's, and a generation runs end to end with the pool back to free."""
    from chatserve.batch import BatchItem

    ref = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    q4 = Engine(EngineConfig(model=str(tiny_llama_dir), quantization="int4", kv_cache_memory=8 << 20))
    assert any(isinstance(m, Int4Linear) for m in q4.models.target.modules())
    for length in (5, int4.SMALL_M + 9):  # the kernel path, then the dense prefill path
        prompt = ref.tokenizer.encode("The quick brown fox jumps over the lazy dog")[:length]
        item = [BatchItem(prompt, 0, [0, 1, 2, 3], 1)]
        a, b = ref.models.target_runner.run(item)[0], q4.models.target_runner.run(item)[0]
        # 4 bits on random Gaussian weights cost ~10% per layer (range / 15 per step); real
        # models' quality is measured by benchmarks/weight_quality.py
        assert ((a - b).norm() / a.norm()) < 0.3
    out = q4.generate([ref.tokenizer.encode("Hello")], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(out["token_ids"]) == 8
    assert q4.block_manager.num_free_blocks == q4.block_manager.num_blocks


def test_a_tied_int4_model_keeps_one_copy_of_the_table(tiny_llama_dir, tiny_qwen_dir):
    """The tied head is transformed right after the embedding (so the float table is freed
    before the layers load), and the two share their int8 rows; an untied model's do not."""
    from chatserve.loading import read_config
    from chatserve.models.loader import load_model

    order = []
    load_model(tiny_llama_dir, read_config(tiny_llama_dir), torch.float32, 64,
               lambda name, module: order.append(name) or module)
    assert order[:2] == ["embed_tokens", "lm_head"]
    tied = Engine(EngineConfig(model=str(tiny_llama_dir), quantization="int4", kv_cache_memory=8 << 20)).models.target
    assert tied.embed_tokens.qweight.data_ptr() == tied.lm_head.qweight.data_ptr()
    assert tied.embed_tokens.scales.data_ptr() == tied.lm_head.scales.data_ptr()
    untied = Engine(EngineConfig(model=str(tiny_qwen_dir), quantization="int4", kv_cache_memory=8 << 20)).models.target
    assert untied.embed_tokens.qweight.data_ptr() != untied.lm_head.qweight.data_ptr()


def test_dense_path_is_the_dequantized_matmul_across_row_chunks(generator):
    _, packed, params = random_layer(300, 128, generator)  # 300 rows: chunks of 128, 128 and 44
    x = torch.randn(7, 128, generator=generator)
    expected = x @ dequantize_int4(packed, params).t()
    torch.testing.assert_close(kernel.int4_dense_matmul(x, packed, params, chunk_rows=128), expected)
