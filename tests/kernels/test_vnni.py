"""The matmul kernels' AVX-512 VNNI tiles (kernels/q4k_matmul_cpu.cpp, quant_matmul_cpu.cpp) give the
integers of their AVX2 tiles, so the same outputs bit for bit, at every tile shape; and the switch
between them is honest on a CPU without VNNI."""

import pytest
import torch

from kernels import cpu_ext
from kernels import quant_matmul as kernel
from kernels.cpu_features import cpu_flags
from quant.int4 import make_params, pack_codes, quantize_int4
from quant.int8 import quantize_int8
from quant.q4k import interleave, quantize_q4k

VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.fixture
def ext():
    ext = cpu_ext.extension()
    assert ext is not None, "the C++ kernels build on every CI machine (tests/quant/test_int4.py)"
    before = ext.set_vnni(True)
    yield ext
    ext.set_vnni(before)


def both_paths(ext, fn):
    ext.set_vnni(True)
    vnni = fn()
    ext.set_vnni(False)
    avx2 = fn()
    return vnni, avx2


def test_the_switch_follows_the_cpu(ext):
    has = VNNI_FLAGS <= cpu_flags()
    assert ext.vnni_enabled() == has  # set_vnni(True) turns them on only where they exist
    assert ext.set_vnni(False) == has and not ext.vnni_enabled()


# K: one superblock, the 1.5B's hidden size and its MLP width; N: pairs of groups of 8 features (the
# 512-bit tile) with an odd group left at the end of a thread's range or not; rows: every tile shape
# of both (AVX2 4 + 1..3; VNNI pairs 8 + 1..7)
@pytest.mark.parametrize("k,n", [(256, 24), (1536, 24), (1536, 48), (8960, 40)])
def test_q4k_tiles_agree_bit_for_bit(ext, k, n, generator):
    weight = torch.randn(n, k, generator=generator) * 0.05
    packed = interleave(*quantize_q4k(weight))
    x = torch.randn(19, k, generator=generator) * 4
    bias = torch.randn(n, generator=generator)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 19):
        vnni, avx2 = both_paths(ext, lambda: kernel.q4k_linear(x[:rows], *packed, bias))
        assert torch.equal(vnni, avx2), rows
    ref = kernel.q4k_matmul_ref(x, *quantize_q4k(weight)) + bias
    assert (vnni - ref).abs().max() <= 1e-4 * ref.abs().max()


# N: 5 groups of 8 (two pairs and an odd one) and 8 groups
@pytest.mark.parametrize("k,n", [(32, 40), (1536, 40), (1536, 64)])
def test_int8_interleaved_tiles_agree_bit_for_bit(ext, k, n, generator):
    q, scales = quantize_int8(torch.randn(n, k, generator=generator))
    q[0, :4] = torch.tensor([127, -127, 127, -127], dtype=torch.int8)  # the largest pair sums
    packed = kernel.pack_int8(q)
    x = torch.randn(19, k, generator=generator)
    x[:, :4] = torch.tensor([1.0, -1.0, 1.0, -1.0]) * x.abs().amax()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 19):
        vnni, avx2 = both_paths(ext, lambda: kernel.int8x8_matmul(x[:rows], packed, scales))
        assert torch.equal(vnni, avx2), rows
    ref = kernel.int8_matmul_ref(x, q, scales)
    assert (vnni - ref).abs().max() <= 1e-4 * ref.abs().max()


# Qwen 1.5B's attention shape (6 query heads per kv head: three pairs, one pass of V), SmolLM2's
# (3: a pair and one left), the 0.5B's (7); verification rows across a partition edge (256 keys)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (9, 3, 64), (14, 2, 64)])
def test_attention_512_bit_loops_agree_bit_for_bit(ext, heads, kv_heads, head_dim, generator):
    from kernels import decode_ops
    from tests.kernels.paged_case import make_paged_case

    case = make_paged_case([300, 41], [5, 1], heads, kv_heads, head_dim, 16, torch.float32, "auto", generator)
    contexts = [296, 297, 298, 299, 300, 41]
    vnni, avx2 = both_paths(ext, lambda: decode_ops.paged_attention_rows(
        case.query, case.k_cache, case.v_cache, case.block_tables, [0] * 5 + [1], contexts, case.scale))
    assert torch.equal(vnni, avx2)


# Q4_1 (groups of 32; the 0.5B draft's and SmolLM2's layers): K = 64 (only the tail of G % 8 groups),
# 576 (SmolLM2: 18 groups, two of 8 then a tail), 896 (the 0.5B: 28 groups); rows of every tile shape
@pytest.mark.parametrize("k", [64, 576, 896])
def test_q4_1_tiles_agree_bit_for_bit(ext, k, generator):
    codes, d, m = quantize_int4(torch.randn(40, k, generator=generator))
    packed, params = pack_codes(codes), make_params(d, m)
    x = torch.randn(9, k, generator=generator) * 3
    x[0, :32] = 0.0  # an all-zero activation group
    bias = torch.randn(40, generator=generator)
    for rows in (1, 2, 3, 4, 5, 9):
        vnni, avx2 = both_paths(ext, lambda: kernel.int4_linear(x[:rows], packed, params, bias))
        assert torch.equal(vnni, avx2), rows
    ref = kernel.int4_matmul_ref(x, packed, params) + bias
    torch.testing.assert_close(vnni, ref, rtol=1e-5, atol=1e-4)
