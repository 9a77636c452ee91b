"""Weight-only int8 (quant/int8.py): the C++ kernel against its plain-torch reference and
independent of the row count, the layer computes x @ dequantize(w).T for few rows (decode,
verification), prefill chunks use the kept bf16 weight, and the engine runs end to end on an
int8 model."""

import pytest
import torch
from torch import nn

from chatserve.batch import BatchItem
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from kernels import quant_matmul as kernel
from quant.apply import quantize_weights
from quant.int8 import SMALL_M, Int8Linear, dequantize_int8, quantize_int8


def test_quantize_round_trip_within_half_a_step(generator):
    w = torch.randn(96, 200, generator=generator)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (96,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range


def _matmul(layout):
    """The kernel of one weight layout, on a row-major q: row-major, or interleaved by 8 features."""
    if layout == "rows":
        return kernel.int8_matmul
    return lambda x, q, scales: kernel.int8x8_matmul(x, kernel.pack_int8(q), scales)


def test_packing_round_trips_and_interleaves_by_eight(generator):
    q = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=generator)
    packed = kernel.pack_int8(q)
    assert torch.equal(kernel.unpack_int8(packed), q)
    # feature 8g + i, k = 4t + j at byte 32 t + 4 i + j of its group's K * 8 bytes
    g, i, t, j = 2, 5, 7, 3
    assert packed.view(-1)[g * 8 * 64 + 32 * t + 4 * i + j] == q[8 * g + i, 4 * t + j]


@pytest.mark.parametrize("layout", ["rows", "x8"])
@pytest.mark.parametrize("k", [96, 576])  # 3 groups (all tail), 18 groups (8 + 8 + a tail of 2)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
def test_kernel_matches_its_reference(layout, k, rows, generator):
    q, scales = quantize_int8(torch.randn(40, k, generator=generator))
    q[0, :32] = -127  # the sign trick at the range's ends
    q[1, :32] = 127
    x = torch.randn(rows, k, generator=generator)
    x[0, 32:64] = 0.0  # an all-zero activation group
    torch.testing.assert_close(_matmul(layout)(x, q, scales), kernel.int8_matmul_ref(x, q, scales),
                               rtol=1e-5, atol=1e-4)


def test_kernel_reference_is_close_to_the_float_matmul(generator):
    q, scales = quantize_int8(torch.randn(64, 256, generator=generator))
    x = torch.randn(6, 256, generator=generator)
    exact = x @ dequantize_int8(q, scales).t()
    assert (kernel.int8_matmul_ref(x, q, scales) - exact).abs().max() < 0.01 * exact.abs().max()


@pytest.mark.parametrize("layout", ["rows", "x8"])
def test_kernel_rows_do_not_depend_on_the_row_count(layout, generator):
    matmul = _matmul(layout)
    q, scales = quantize_int8(torch.randn(104, 320, generator=generator))
    x = torch.randn(SMALL_M, 320, generator=generator)
    alone = matmul(x[:1], q, scales)
    for rows in range(2, SMALL_M + 1):
        out = matmul(x[:rows], q, scales)
        assert torch.equal(out[:1], alone), rows
        assert torch.equal(out[rows - 1 : rows], matmul(x[rows - 1 : rows], q, scales)), rows


def test_a_layer_packs_where_the_kernel_runs_and_a_tied_table_reads_the_packed_rows(generator):
    from quant.apply import share_tied_rows
    from quant.int8 import Int8Embedding

    table = nn.Embedding(64, 96)
    head = nn.Linear(96, 64, bias=False)
    head.weight = table.weight
    layer, embedding = Int8Linear.from_linear(head, keep_dense=False), Int8Embedding.from_embedding(table)
    odd = Int8Linear.from_linear(nn.Linear(96, 60))  # 60 features: not a multiple of 8
    assert layer.packed and not odd.packed
    q, _ = quantize_int8(head.weight.data)
    assert torch.equal(layer.int8_rows(), q) and odd.int8_rows() is odd.qweight
    ids = torch.tensor([[0, 7, 8], [63, 9, 7]])
    want = embedding(ids)
    share_tied_rows(embedding, layer)
    assert embedding.packed and embedding.qweight.data_ptr() == layer.qweight.data_ptr()
    assert torch.equal(embedding(ids), want)
    x = torch.randn(3, 96, generator=generator)
    torch.testing.assert_close(layer(x), kernel.int8_matmul_ref(x, q, layer.scales), rtol=1e-5, atol=1e-4)


def test_the_embedding_reads_the_same_rows_through_cpp_and_numpy_as_through_torch():
    from quant.apply import share_tied_rows
    from quant.int8 import Int8Embedding

    table = nn.Embedding(64, 96)
    head = nn.Linear(96, 64, bias=False)
    head.weight = table.weight
    embedding = Int8Embedding.from_embedding(table)
    ids = torch.tensor([0, 7, 8, 63, 9, 7, 40])
    q, scales = quantize_int8(table.weight.data)
    want = q[ids].float() * scales[ids][:, None]
    for packed in (False, True):
        if packed:
            share_tied_rows(embedding, Int8Linear.from_linear(head, keep_dense=False))
        assert embedding.packed is packed
        assert torch.equal(embedding.rows_torch(ids), want)
        assert torch.equal(torch.from_numpy(embedding.rows_numpy(ids.numpy())), want)
        assert torch.equal(kernel.int8_rows(embedding.qweight, embedding.scales, ids, packed), want)
        assert torch.equal(embedding(ids.view(1, 7)), want.view(1, 7, 96))  # the CPU path is C++'s
        assert embedding(ids[:0]).shape == (0, 96)
        for bad in ([64], [-1], [3, 64]):
            with pytest.raises(IndexError, match=r"\[0, 64\)"):
                embedding(torch.tensor(bad))


@pytest.mark.parametrize("rows", [1, 5, SMALL_M, SMALL_M + 7])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_dequantized_matmul(rows, bias, generator):
    linear = nn.Linear(256, 96, bias=bias)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 256, generator=generator)
    if rows <= SMALL_M:  # the C++ kernel on float rows
        ref = x @ dequantize_int8(layer.int8_rows(), layer.scales).t()
    else:  # the kept bf16 weight
        ref = x.bfloat16().float() @ linear.weight.detach().bfloat16().float().t()
    if bias:
        ref = ref + linear.bias.detach().bfloat16().float()
    out = layer(x)
    assert out.dtype == x.dtype and out.shape == (rows, 96)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_int8_linear_keeps_leading_dims(generator):
    layer = Int8Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(2, 3, 64, generator=generator, dtype=torch.bfloat16)
    assert layer(x).shape == (2, 3, 32) and layer(x).dtype == torch.bfloat16


def test_quantize_weights_swaps_every_linear_including_a_tied_head():
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64, bias=False))
    model[2].weight = model[0].weight  # tied, as in SmolLM2: the head gets its own int8 copy
    quantize_weights(model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[0], nn.Embedding)
    with pytest.raises(ValueError, match="quantization"):
        quantize_weights(model, "int3")


def test_engine_with_int8_weights_matches_bf16_logits(tiny_llama_dir):
    """The int8 model's next-token logits stay close to the unquantized bf16 model's, and a
    generation runs end to end with the pool back to free."""
    ref = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=8 << 20))
    q8 = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory=8 << 20,
                             quantization="int8"))
    assert any(isinstance(m, Int8Linear) for m in q8.models.target.modules())
    ids = ref.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    def logits(engine):
        item = BatchItem(ids, 0, list(range(4)), 1)
        return engine.models.target_runner.run([item])[0][0]

    a, b = logits(ref), logits(q8)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    out = q8.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 16
    assert q8.block_manager.num_free_blocks == q8.block_manager.num_blocks


def test_a_head_without_dense_copy_takes_the_kernel_at_every_row_count(generator):
    """An LM head (no dense copy) past SMALL_M rows: each row as computed alone, no bf16 path."""
    head = Int8Linear.from_linear(nn.Linear(128, 96, bias=False), keep_dense=False)
    x = torch.randn(SMALL_M + 9, 128, generator=generator)
    y = head(x)
    assert y.dtype == torch.float32
    for r in (0, SMALL_M, SMALL_M + 8):
        assert torch.equal(head(x[r : r + 1]), y[r : r + 1])
