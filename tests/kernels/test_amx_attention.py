"""The paged attention's AMX path (kernels/decode_ops_cpu.cpp, attend_partition_amx): on a bfloat16
cache it multiplies on the tile unit with the queries and the attention weights rounded to
bfloat16. Tested against a reference that rounds the same two things (tight), against the float32
reference (loose: what the rounding costs), for rows that do not depend on the rows beside them,
and for the switch: a CPU without AMX, another cache dtype or a block of 8 take the widened loops."""

import pytest
import torch

from kernels import cpu_ext, decode_ops
from kernels.attention import paged_attention_ref
from kernels.cpu_features import has_amx
from tests.kernels.paged_case import make_paged_case

HAS_AMX = has_amx("bf16")
PARTITION = 256  # kPart: keys per split-K partition, each with its own max and its own rounding
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the tile unit: Intel Sapphire Rapids or later")


@pytest.fixture
def ext():
    ext = cpu_ext.extension()
    assert ext is not None
    before = ext.set_amx(True)
    yield ext
    ext.set_amx(before)


def amx_reference(case, seqs, contexts, first_row=0):
    """What the tile path computes, in float64 but for its two roundings: q . k for q rounded to
    bfloat16; per partition of 256 keys, weights exp(scale * s - max) rounded to bfloat16 times V,
    their sum unrounded; the partitions merged by their maxima."""
    k_cache, v_cache, tables = case.k_cache, case.v_cache, case.block_tables
    block_size, hkv, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = case.query.shape[1] // hkv
    q = case.query[first_row:first_row + len(seqs)].to(torch.bfloat16).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, (seq, ctx) in enumerate(zip(seqs, contexts)):
        pos = torch.arange(ctx)
        slots = tables[seq][pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.reshape(-1, hkv, dim)[slots].double()
        values = v_cache.reshape(-1, hkv, dim)[slots].double()
        for h in range(case.query.shape[1]):
            s = keys[:, h // group] @ q[t, h] * case.scale
            parts = []
            for j in range(0, ctx, PARTITION):
                sp = s[j:j + PARTITION]
                e = torch.exp(sp - sp.max())
                o = e.to(torch.bfloat16).double() @ values[j:j + PARTITION, h // group]
                parts.append((sp.max(), e.sum(), o))
            top = max(m for m, _, _ in parts)
            num = sum(torch.exp(m - top) * o for m, _, o in parts)
            den = sum(torch.exp(m - top) * l for m, l, _ in parts)
            out[t, h] = num / den
    return out.float()


def test_the_switch_follows_the_cpu(ext):
    assert ext.amx_enabled() == HAS_AMX  # set_amx(True) turns it on only where the tile unit is
    assert ext.set_amx(False) == HAS_AMX and not ext.amx_enabled()


# (seq_lens, rows per sequence), (heads, kv heads, head dim)
AMX_CASES = [
    (([1, 17, 40], [1, 1, 5]), (12, 2, 128)),  # Qwen 1.5B's shape: one key; a partial tile; verification rows
    (([600, 514], [1, 5]), (9, 3, 64)),  # SmolLM2's: 3 partitions; verification rows across an edge
    (([300, 33], [12, 2]), (14, 2, 64)),  # the 0.5B's group of 7: 84 queries, two chunks of 4 query tiles
    (([2050], [8]), (12, 2, 128)),  # a long context, 8 rows (48 queries: 3 query tiles)
]


@needs_amx
@pytest.mark.parametrize("batch,shape", AMX_CASES)
def test_the_tile_path_computes_what_its_roundings_say(ext, batch, shape, generator):
    """Unused cache slots hold NaN (paged_case): a tile of 16 keys past a sequence's end, or a
    value row past the partition, must not reach a row's output."""
    seq_lens, q_lens = batch
    case = make_paged_case(seq_lens, q_lens, *shape, 16, torch.float32, "bf16", generator)
    seqs = [b for b, q in enumerate(q_lens) for _ in range(q)]
    contexts = [c for s, q in zip(seq_lens, q_lens) for c in range(s - q + 1, s + 1)]
    out = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, seqs,
                                          contexts, case.scale)
    assert torch.isfinite(out).all()
    # Tight: float32 sums in another order and a 1e-7 exp can move a weight across a bfloat16
    # rounding edge now and then (one ulp: 2^-8 of one weight).
    torch.testing.assert_close(out, amx_reference(case, seqs, contexts), rtol=2e-3, atol=2e-3)
    # Loose: what rounding q and the weights costs against the float32 attention.
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), rtol=0.05, atol=0.03)
    ext.set_amx(False)
    widened = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, seqs,
                                              contexts, case.scale)
    assert not torch.equal(out, widened)  # the switch took the other path


@needs_amx
@pytest.mark.parametrize("seq_len", [40, 260, 1100])  # 260: rows on both sides of the first partition's edge
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_threads(ext, seq_len, generator):
    """A verification row equals the decode step at its position, bit for bit, on one thread or two."""
    case = make_paged_case([seq_len], [9], 12, 2, 128, 16, torch.float32, "bf16", generator)
    first = seq_len - 8
    together = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables,
                                               [0] * 9, list(range(first, seq_len + 1)), case.scale)
    threads = torch.get_num_threads()
    try:
        for i in range(9):
            torch.set_num_threads(1 + i % 2)
            alone = decode_ops.paged_attention_rows(case.query[i:i + 1].contiguous(), case.k_cache, case.v_cache,
                                                    case.block_tables, [0], [first + i], case.scale)
            assert torch.equal(together[i:i + 1], alone), i
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt,block_size", [("bf16", 8), ("fp16", 16), ("auto", 16)])
def test_other_caches_take_the_widened_loops(ext, fmt, block_size, generator):
    """A block of 8 keys holds no tile of 16; fp16 and float32 are not the tile unit's inputs: the
    same numbers with AMX on as off."""
    case = make_paged_case([300, 20], [5, 1], 12, 2, 128, block_size, torch.float32, fmt, generator)
    seqs, contexts = [0] * 5 + [1], [296, 297, 298, 299, 300, 20]
    on = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, seqs,
                                         contexts, case.scale)
    ext.set_amx(False)
    off = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, seqs,
                                          contexts, case.scale)
    assert torch.equal(on, off)


@needs_amx
def test_a_prefill_chunk_beside_tile_rows(ext, generator):
    """A long chunk over a bfloat16 cache also takes the tile path (not SDPA): each of its rows equals
    the same row computed alone, as a decode step would, and the tile reference; with AMX off it
    takes SDPA over the gathered (widened) context again."""
    from kernels.attention import paged_attention
    from kernels.attention_cpu import PREFILL_Q_LEN

    chunk = PREFILL_Q_LEN + 6
    case = make_paged_case([100, 80], [chunk, 3], 12, 2, 128, 16, torch.float32, "bf16", generator)
    out = paged_attention(*case.args())
    query, k_cache, v_cache, block_tables = case.args()[:4]
    contexts = list(range(100 - chunk + 1, 101)) + [78, 79, 80]
    alone = torch.cat([decode_ops.paged_attention_rows(query[t : t + 1].contiguous(), k_cache, v_cache, block_tables,
                                                       [int(t >= chunk)], [contexts[t]], case.scale)
                       for t in range(chunk + 3)])
    assert torch.equal(out, alone)
    torch.testing.assert_close(out, amx_reference(case, [0] * chunk + [1] * 3, contexts), rtol=2e-3, atol=2e-3)
    ext.set_amx(False)
    reference = paged_attention_ref(*case.args())
    torch.testing.assert_close(paged_attention(*case.args())[:chunk], reference[:chunk], rtol=1e-4, atol=2e-5)
