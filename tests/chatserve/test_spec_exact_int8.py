"""Speculation stays token-for-token equal to plain greedy decoding in the fast formats too
(bf16 activations with int8 weights; fp32 activations with int4 weights), not only in fp32:
verification rows attend one at a time exactly like decode steps, and the packed int8 GEMV and
the int4 kernel give each row the same result whatever the number of rows (checked directly here
and in tests/quant/test_int4.py)."""

import pytest
import torch

from tests.spec_equality import check_greedy_speculation_equals_plain

PROMPTS = ["Hello there", "def add(a, b):", "1, 2, 3, 4, 1, 2, 3,", "abcabcabcabc", "SELECT * FROM"]


def test_int8_gemv_rows_do_not_depend_on_the_row_count(generator):
    weight = torch.randint(-127, 128, (96, 64), dtype=torch.int8, generator=generator)
    scales = torch.rand(96, generator=generator).bfloat16()
    x = torch.randn(9, 64, generator=generator).bfloat16()
    alone = torch.ops.aten._weight_int8pack_mm(x[:1], weight, scales)
    for rows in (2, 5, 9):
        assert torch.equal(torch.ops.aten._weight_int8pack_mm(x[:rows], weight, scales)[:1], alone)


@pytest.mark.parametrize("weights", [("bfloat16", "int8"), ("float32", "int4")], ids=["bf16-int8", "fp32-int4"])
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_greedy_speculation_equals_plain_in_fast_formats(tiny_llama_dir, method, weights):
    check_greedy_speculation_equals_plain(tiny_llama_dir, method, *weights, PROMPTS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verification_attention_is_bitwise_the_decode_attention(dtype, generator):
    """k + 1 verification rows over a paged context give exactly (torch.equal) what k + 1
    successive decode steps would: the property greedy equality in bf16 rests on."""
    from kernels.attention import paged_attention

    num_blocks, block_size, kv_heads, heads, dim = 12, 16, 2, 6, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator).to(dtype)
    table = torch.tensor([[7, 2, 9, 4, 0, 11]], dtype=torch.int32)
    seq_len, q_len = 83, 5
    query = torch.randn(q_len, heads, dim, generator=generator).to(dtype)
    verify = paged_attention(query, k_cache, v_cache, table, [seq_len], [0, q_len], dim**-0.5)
    for i in range(q_len):
        decode = paged_attention(query[i : i + 1], k_cache, v_cache, table, [seq_len - q_len + i + 1], [0, 1], dim**-0.5)
        assert torch.equal(verify[i : i + 1], decode), f"row {i}"
