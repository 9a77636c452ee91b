"""Weight-only 4-bit in GGUF's Q4_K layout (quant/q4k.py, kernels/q4k_matmul_cpu.cpp): the file's
blocks decode to what gguf's own reference decodes, the kernel against its plain-torch reference,
rows that do not depend on the row count, the loader taking a GGUF file's Q4_K blocks for the
layers that are Q4_K there, and greedy speculation equal to plain decoding on Q4_K weights."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from chatserve.gguf_convert import GgufBlocks
from kernels import quant_matmul as kernel
from quant.apply import quantize_module
from quant.int4 import Int4Linear, dequantize_int4, make_params, pack_codes, q4_1_layout, quantize_int4, unpack_codes
from quant.q4k import BLOCK_BYTES, Q4KLinear, blocks_to_layout, deinterleave, dequantize_q4k, interleave, quantize_q4k
from tests.spec_equality import check_greedy_speculation_equals_plain
from tests.tiny_models import make_tiny_model


def random_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF Q4_K blocks [n, k/256 * 144] with random codes, 6-bit scales and mins, and small d, dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, BLOCK_BYTES), dtype=np.uint8)
    dd = (rng.random((n, k // 256, 2)) * 0.01).astype(np.float16)
    blocks[..., :4] = dd.view(np.uint8).reshape(n, k // 256, 4)
    return blocks.reshape(n, -1)


def test_gguf_blocks_decode_as_ggufs_reference():
    raw = random_blocks(8, 512)
    reference = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)  # [8, 512] float32
    codes, subs, dd = blocks_to_layout(raw)
    assert torch.equal(dequantize_q4k(codes, subs, dd), torch.from_numpy(reference))


def test_quantize_from_float_is_as_close_as_groups_of_32(generator):
    """8-bit sub-block scales lose next to nothing against int4's float16 scale per group of 32."""
    w = torch.randn(64, 512, generator=generator)
    err = (dequantize_q4k(*quantize_q4k(w)) - w).norm() / w.norm()
    codes, d, m = quantize_int4(w)
    err_g32 = (dequantize_int4(pack_codes(codes), make_params(d, m)) - w).norm() / w.norm()
    assert err < 1.01 * err_g32


def test_activation_quantization_matches_reference(generator):
    ext = kernel.cpu_ext.extension()
    x = torch.randn(5, 768, generator=generator) * torch.rand(5, 1, generator=generator)
    x[2, :256] = 0  # an all-zero superblock
    for got, want in zip(ext.quantize_rows_k(x), kernel.quantize_rows_k_ref(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("k", [256, 1536])
def test_kernel_matches_reference_and_rows_are_independent(k, generator):
    layout = blocks_to_layout(random_blocks(40, k))
    packed = interleave(*layout)
    x = torch.randn(9, k, generator=generator)
    y = kernel.q4k_matmul(x, *packed)
    ref = kernel.q4k_matmul_ref(x, *layout)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in (1, 2, 3, 4, 5):  # every tile shape: each row equals that row computed alone
        assert torch.equal(kernel.q4k_matmul(x[:rows], *packed), y[:rows])
    assert torch.equal(kernel.q4k_matmul(x[4:5], *packed), y[4:5])


def test_interleaving_keeps_every_byte_and_its_place():
    layout = blocks_to_layout(random_blocks(24, 512, seed=9))
    packed = interleave(*layout)
    assert sum(t.numel() * t.element_size() for t in packed) == sum(t.numel() * t.element_size() for t in layout)
    for got, want in zip(deinterleave(*packed), layout):
        assert torch.equal(got, want)
    codes, subs, dd = packed  # feature 8 g + n, superblock s, sub-block j: where the kernel reads it
    plain_codes = unpack_codes(layout[0]).view(24, 2, 8, 32)  # [N, S, j, i]
    g, n, s, j, i = 2, 5, 1, 3, 21  # code index i of sub-block j: byte 128 j + 32 q + 4 n + i % 4
    q, half = (i % 16) // 4, i // 16
    byte = codes[g, s, 128 * j + 32 * q + 4 * n + i % 4]
    assert ((byte >> 4) if half else (byte & 15)) == plain_codes[8 * g + n, s, j, i]
    assert subs[g, s, 8 * j + n] == layout[1][8 * g + n, s, j]  # scale
    assert subs[g, s, 64 + 16 * (j // 2) + 2 * n + j % 2] == layout[1][8 * g + n, s, 8 + j]  # min
    assert dd[g, s, 8 + n] == layout[2][8 * g + n, s, 1]  # dmin


def test_layer_paths_agree(generator, monkeypatch):
    linear = nn.Linear(512, 48, bias=True)
    layer = Q4KLinear.from_linear(linear)
    x = torch.randn(3, 512, generator=generator)
    fast = layer(x)
    monkeypatch.setattr(kernel, "is_available", lambda: False)
    slow = layer(x)  # the dequantized weight through F.linear: no activation quantization
    assert (fast - slow).norm() / slow.norm() < 0.02
    assert (slow - (x @ layer.weight().t() + linear.bias)).abs().max() < 1e-4


def test_quantize_module_takes_the_files_blocks_only_when_they_are_the_weight():
    raw = random_blocks(16, 512, seed=3)
    weight = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    linear = nn.Linear(512, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    taken = quantize_module(linear, "int4", file_rows=("Q4_K", raw))
    assert isinstance(taken, Q4KLinear) and torch.equal(taken.weight(), weight)
    assert torch.equal(taken.layout()[1], blocks_to_layout(raw)[1])  # the file's 6-bit scales, not re-quantized
    other = random_blocks(16, 512, seed=4)  # e.g. rows permuted: not this weight
    refused = quantize_module(linear, "int4", file_rows=("Q4_K", other))
    assert isinstance(refused, Q4KLinear) and refused.subs.max() > 63  # quantized from float (8-bit scales)
    assert isinstance(quantize_module(nn.Linear(192, 16), "int4"), Int4Linear)  # not a multiple of 256
    assert isinstance(quantize_module(nn.Linear(256, 20), "int4"), Int4Linear)  # 20 outputs: not groups of 8


def test_a_files_blocks_with_rows_moved_as_llama_q_and_k_are_refused():
    """_from_file decodes 64 rows drawn at random of a bigger layer: llama's q/k permutation (rows of
    each head's two halves interleaved; 2 of a head's 64 rows stay in place) is still caught, and the
    same rows in order are taken."""
    n, head_dim = 512, 64
    raw = random_blocks(n, 256, seed=5)
    weight = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    moved = torch.arange(n).view(n // head_dim, 2, head_dim // 2).transpose(1, 2).reshape(n)
    assert (moved == torch.arange(n)).sum() == 2 * n // head_dim
    linear = nn.Linear(256, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    assert quantize_module(linear, "int4", file_rows=("Q4_K", raw)).subs.max() <= 63  # the file's 6-bit scales
    refused = quantize_module(linear, "int4", file_rows=("Q4_K", raw[moved.numpy()]))
    assert refused.subs.max() > 63  # quantized from the float weight instead


def test_gguf_blocks_by_layer(tmp_path):
    """Which layers of a GGUF file come as blocks: every part of a fused layer of one type."""
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen2")
    q, k, v = random_blocks(32, 256, 1), random_blocks(16, 256, 2), random_blocks(16, 256, 3)
    for name, raw in (("attn_q", q), ("attn_k", k), ("attn_v", v), ("ffn_gate", q), ("ffn_up", q)):
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.1.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.1.attn_k.weight", k, raw_shape=k.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.1.attn_v.weight", np.zeros((16, 256), np.float32))  # not Q4_K
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blocks = GgufBlocks(tmp_path / "m.gguf")
    kind, rows = blocks.layer_rows("layers.0.self_attn.qkv_proj")
    assert kind == "Q4_K" and np.array_equal(rows, np.concatenate([q, k, v]))
    assert np.array_equal(blocks.layer_rows("layers.0.mlp.gate_up_proj")[1], np.concatenate([q, q]))
    assert blocks.layer_rows("layers.1.self_attn.qkv_proj") is None  # its v is not Q4_K
    assert blocks.layer_rows("layers.0.mlp.down_proj") is None  # not in the file
    assert blocks.layer_rows("lm_head") is None


@pytest.fixture(scope="module")
def tiny_q4k_dir(tmp_path_factory):
    """in_features 256 and 512: every layer of the tiny model takes the Q4_K kernel."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_q4k"), "qwen2", seed=5, hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_greedy_speculation_equals_plain_on_q4k(tiny_q4k_dir, method):
    plain = check_greedy_speculation_equals_plain(tiny_q4k_dir, method, "float32", "int4",
                                                  ["Hello there", "def add(a, b):", "abcabcabcabc " * 20])
    assert sum(isinstance(m, Q4KLinear) for m in plain.models.target.modules()) == 2 * 4


def test_one_call_linear_equals_quantize_then_matmul_plus_bias(generator):
    codes, subs, dd = interleave(*blocks_to_layout(random_blocks(40, 512)))
    bias = torch.randn(40, generator=generator)
    for rows in (1, 6, 70):  # 70 x 2 superblocks: the quantization runs on the thread team
        x = torch.randn(rows, 512, generator=generator)
        assert torch.equal(kernel.q4k_linear(x, codes, subs, dd), kernel.q4k_matmul(x, codes, subs, dd))
        assert torch.equal(kernel.q4k_linear(x, codes, subs, dd, bias), kernel.q4k_matmul(x, codes, subs, dd) + bias)


def test_q4_1_blocks_load_exactly_into_groups_of_32(generator):
    """SmolLM2's file is Q4_1: its blocks are the int4 layer's formula, repacked without loss."""
    rng = np.random.default_rng(7)
    n, k = 24, 128
    blocks = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    blocks[..., :4] = (rng.standard_normal((n, k // 32, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, k // 32, 4)
    raw = blocks.reshape(n, -1)
    reference = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    layer = Int4Linear(*q4_1_layout(raw), None)
    assert torch.equal(layer.weight(), reference)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(reference)
    taken = quantize_module(linear, "int4", file_rows=("Q4_1", raw))
    assert isinstance(taken, Int4Linear) and torch.equal(taken.params, layer.params)
