"""The Q4_K matmul's AMX-INT8 path (kernels/q4k_matmul_cpu.cpp, q4k_run_amx: chunks of 64+ rows,
a prefill's) gives the VNNI tiles' integers, so the same outputs bit for bit, whatever the row
count, the padding of the last row tile or the bias; and every path gets a sub-block's largest
sums right (32 products of 15 * 127, past int16)."""

import pytest
import torch

from kernels import cpu_ext
from kernels import quant_matmul as kernel
from kernels.cpu_features import has_amx
from quant.q4k import interleave, quantize_q4k

HAS_AMX_INT8 = has_amx("int8")
AMX_MIN_ROWS = 64  # kAmxMinRows in q4k_matmul_cpu.cpp


@pytest.fixture
def ext():
    ext = cpu_ext.extension()
    assert ext is not None, "the C++ kernels build on every CI machine (tests/quant/test_int4.py)"
    vnni, amx = ext.set_vnni(True), ext.set_amx_int8(True)
    yield ext
    ext.set_vnni(vnni)
    ext.set_amx_int8(amx)


def test_the_switch_follows_the_cpu(ext):
    assert ext.amx_int8_enabled() == HAS_AMX_INT8  # set_amx_int8(True) turns it on only where it exists
    assert ext.set_amx_int8(False) == HAS_AMX_INT8 and not ext.amx_int8_enabled()


needs_amx = pytest.mark.skipif(not HAS_AMX_INT8, reason="this CPU has no AMX-INT8 (the VNNI tiles serve)")


# K: one superblock, the 1.5B's hidden size, its MLP width; N: one and several pairs of groups, and
# 5 groups (an odd one: the VNNI tiles take the whole call); rows: one pair of row tiles, a partial
# last tile, an odd number of tiles (padded to a pair), 8 pairs
@needs_amx
@pytest.mark.parametrize("k,n", [(256, 16), (1536, 48), (8960, 32), (1536, 40)])
def test_amx_equals_vnni_bit_for_bit(ext, k, n, generator):
    weight = torch.randn(n, k, generator=generator) * 0.05
    packed = interleave(*quantize_q4k(weight))
    x = torch.randn(256, k, generator=generator) * 4
    bias = torch.randn(n, generator=generator)
    for rows in (AMX_MIN_ROWS, 65, 79, 96, 256):
        for b in (bias, None):
            ext.set_amx_int8(True)
            amx = kernel.q4k_linear(x[:rows], *packed, b)
            ext.set_amx_int8(False)
            vnni = kernel.q4k_linear(x[:rows], *packed, b)
            assert torch.equal(amx, vnni), (rows, b is None)
    ext.set_amx_int8(True)
    amx = kernel.q4k_linear(x, *packed, bias)
    ref = kernel.q4k_matmul_ref(x, *quantize_q4k(weight)) + bias
    assert (amx - ref).abs().max() <= 2e-4 * ref.abs().max()  # float32 sums over up to 35 superblocks


@needs_amx
def test_a_row_does_not_depend_on_the_rows_beside_it(ext, generator):
    """A prompt's rows through the tiles equal the same rows one at a time (decode's path)."""
    weight = torch.randn(48, 512, generator=generator) * 0.05
    packed = interleave(*quantize_q4k(weight))
    x = torch.randn(100, 512, generator=generator)
    whole = kernel.q4k_linear(x, *packed)
    one_by_one = torch.cat([kernel.q4k_linear(x[i : i + 1], *packed) for i in range(100)])
    assert torch.equal(whole, one_by_one)


def test_the_largest_sub_block_sums(ext):
    """Codes all 15, scales and mins 255 (quantize_q4k's 8-bit ones), activations all at +127:
    a sub-block's 32 products sum to 60,960, which the VNNI tile once read as an int16 (its low
    16 bits). Every path (AMX where present, VNNI, AVX2) against the float64 reference."""
    n, k = 32, 512
    codes = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    subs = torch.full((n, k // 256, 16), 255, dtype=torch.uint8)
    subs[:, :, 8:] = 3  # small mins: the scales' term dominates
    dd = torch.full((n, k // 256, 2), 1e-3)
    packed = interleave(codes, subs, dd)
    x = torch.ones(AMX_MIN_ROWS, k)
    x[1] = -1.0  # all at -127
    ref = kernel.q4k_matmul_ref(x, codes, subs, dd)
    assert ref[0, 0] > 2 * 15 * 255 * 1e-3 * 127 * 256 * 0.99 / 127  # the sums are the large ones
    outs = []
    for vnni, amx in ((True, True), (True, False), (False, False)):
        ext.set_vnni(vnni)
        ext.set_amx_int8(amx)
        outs.append(kernel.q4k_linear(x, *packed))
    for out in outs:
        assert torch.allclose(out, ref, rtol=1e-5, atol=0), (out - ref).abs().max()
        assert torch.equal(out, outs[0])
