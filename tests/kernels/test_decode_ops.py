"""The decode step's C++ ops (kernels/decode_ops.py) against their plain-torch references, rows that
do not depend on how many rows share a call, and the model paths that use them against the torch
paths they replace (the same model with the C++ kernels switched off)."""

import os

import pytest
import torch

from kernels import cpu_ext, decode_ops
from kernels.attention import paged_attention_ref
from kernels.attention_cpu import PREFILL_Q_LEN
from kernels.kv_store import kv_store_ref
from tests.kernels.paged_case import make_paged_case


def test_the_extension_builds_here():
    """CI machines have a compiler and an AVX2 CPU: the fast paths must be the ones tested."""
    assert cpu_ext.is_available() and decode_ops.usable(torch.zeros(1))
    assert not decode_ops.usable(torch.zeros(1, dtype=torch.bfloat16))
    assert not decode_ops.usable(torch.zeros(1), 64, 72)  # a size that is no whole number of vectors


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rows, with_residual, generator):
    x = torch.randn(rows, 576, generator=generator) * 3
    w = torch.randn(576, generator=generator)
    residual = torch.randn(rows, 576, generator=generator) if with_residual else None
    x_ref = x.clone()
    ref = decode_ops.rms_norm_ref(x_ref, w, 1e-5, residual)
    out = decode_ops.rms_norm(x, w, 1e-5, residual)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # the residual was added in place (or not at all)


def test_silu_mul(generator):
    gate_up = torch.randn(5, 2 * 96, generator=generator) * 6  # exp over a wide range
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])
    torch.testing.assert_close(decode_ops.silu_mul(gate_up), decode_ops.silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)


def test_rope_rotates_only_the_given_heads_in_place(generator):
    t, heads, n, d = 4, 5, 7, 64
    qkv = torch.randn(t, n, d, generator=generator)
    angles = torch.rand(50, d // 2, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 7, 49, 3])
    ref = qkv.clone()
    decode_ops.rope_ref(ref, heads, positions, cos, sin)
    decode_ops.rope_(qkv, heads, positions, cos, sin)
    torch.testing.assert_close(qkv, ref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(qkv[:, :heads], torch.zeros(0)) and torch.equal(qkv[:, heads:], ref[:, heads:])


def test_store_kv_matches_the_reference_and_skips_negative_slots(generator):
    k_cache = torch.zeros(6, 4, 2, 64)
    v_cache = torch.zeros(6, 4, 2, 64)
    fused = torch.randn(5, 2 + 2 + 2, 64, generator=generator)  # strided K and V views, as the model passes
    key, value = fused[:, 2:4], fused[:, 4:6]
    slots = torch.tensor([3, 21, -1, 0, 17])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store_ref(key, value, k_ref, v_ref, slots)
    decode_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        decode_ops.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_rounds_into_a_16_bit_cache_as_torch_does(dtype, generator):
    k_cache = torch.zeros(6, 4, 2, 64, dtype=dtype)
    v_cache = torch.zeros(6, 4, 2, 64, dtype=dtype)
    fused = torch.randn(5, 6, 64, generator=generator) * torch.logspace(-6, 4, 64)  # tiny to large values
    key, value = fused[:, 2:4], fused[:, 4:6]
    slots = torch.tensor([3, 21, -1, 0, 17])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store_ref(key, value, k_ref, v_ref, slots)  # torch's .to(dtype)
    decode_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert k_cache.abs().sum() > 0


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("seq_lens,q_lens,heads", [([1, 17, 40], [1, 1, 5], (6, 2, 128)),
                                                   ([600, 70], [5, 1], (9, 3, 64)), ([300], [1], (14, 2, 64))])
def test_a_16_bit_cache_gives_the_numbers_of_a_float32_cache_holding_its_values(fmt, wide, seq_lens, q_lens, heads,
                                                                               generator):
    """The attention widens 16-bit keys and values exactly, then runs the float32 loops: the same
    numbers bit for bit as a float32 cache of the same (rounded) values, and close to the reference.
    (A bfloat16 cache on a CPU with AMX takes the tile path unless it is switched off:
    tests/kernels/test_amx_attention.py.)"""
    case = make_paged_case(seq_lens, q_lens, *heads, 16, torch.float32, fmt, generator)
    assert case.k_cache.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    seqs = [b for b, q in enumerate(q_lens) for _ in range(q)]
    contexts = [c for s, q in zip(seq_lens, q_lens) for c in range(s - q + 1, s + 1)]
    old = cpu_ext.extension().set_vnni(wide)
    old_amx = cpu_ext.extension().set_amx(False)
    try:
        out = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, seqs,
                                              contexts, case.scale)
        wide32 = decode_ops.paged_attention_rows(case.query, case.k_cache.float(), case.v_cache.float(),
                                                 case.block_tables, seqs, contexts, case.scale)
    finally:
        cpu_ext.extension().set_vnni(old)
        cpu_ext.extension().set_amx(old_amx)
    assert torch.equal(out, wide32)
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_a_prefill_chunk_beside_decode_rows_on_a_16_bit_cache_matches_the_reference(fmt, generator):
    """A long chunk takes SDPA over the gathered (widened) context, the short rows the C++ kernel
    (its widened loops; with AMX, bfloat16 rows round: tests/kernels/test_amx_attention.py)."""
    case = make_paged_case([100, 80], [PREFILL_Q_LEN + 6, 3], 6, 2, 64, 16, torch.float32, fmt, generator)
    from kernels.attention import paged_attention

    old = cpu_ext.extension().set_amx(False)
    try:
        out = paged_attention(*case.args())
    finally:
        cpu_ext.extension().set_amx(old)
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), rtol=1e-4, atol=2e-5)


# (seq_lens, q_lens, block_size), (num_heads, num_kv_heads, head_dim)
CASES = [
    (([1, 17, 40], [1, 1, 1], 8), (6, 2, 128)),  # decodes; a partial block; four blocks
    (([23, 16], [5, 5], 8), (4, 4, 64)),  # verification rows across a block boundary
    (([30, 6, 70], [1, 6, 20], 16), (9, 3, 64)),  # a decode, a whole prompt, a chunk; SmolLM2's GQA
    (([300], [1], 16), (14, 2, 64)),  # a longer context; the 0.5B's group of 7 (two passes of heads)
    (([100, 80], [PREFILL_Q_LEN + 6, 3], 16), (6, 2, 64)),  # a long chunk (SDPA) beside C++ rows
    (([600, 514], [1, 5], 16), (9, 3, 64)),  # 3 key partitions of 256; verification rows across an edge
]


@pytest.mark.parametrize("batch,shape", CASES)
def test_paged_attention_rows_match_the_reference(batch, shape, generator):
    seq_lens, q_lens, block_size = batch
    case = make_paged_case(seq_lens, q_lens, *shape, block_size, torch.float32, "auto", generator)
    from kernels.attention import paged_attention

    out = paged_attention(*case.args())  # float32: the C++ rows (and SDPA for the long chunk)
    torch.testing.assert_close(out, paged_attention_ref(*case.args()), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt", ["auto", "bf16"])  # bf16: widened per group, prefetched for 1-2 rows only
@pytest.mark.parametrize("seq_len", [40, 260])  # 260: rows on both sides of the first partition's edge (256)
def test_a_row_does_not_depend_on_the_rows_beside_it(seq_len, fmt, generator):
    """A verification row equals the decode step at its position, bit for bit."""
    case = make_paged_case([seq_len], [9], 6, 2, 128, 8, torch.float32, fmt, generator)
    first = seq_len - 8
    together = decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables,
                                               [0] * 9, list(range(first, seq_len + 1)), case.scale)
    for i in range(9):
        alone = decode_ops.paged_attention_rows(case.query[i : i + 1].contiguous(), case.k_cache, case.v_cache,
                                                case.block_tables, [0], [first + i], case.scale)
        assert torch.equal(together[i : i + 1], alone), i


def test_paged_attention_rows_reject_a_context_beyond_the_table(generator):
    case = make_paged_case([17], [1], 4, 2, 64, 8, torch.float32, "auto", generator)
    with pytest.raises(RuntimeError, match="beyond the block table|bad block id"):
        decode_ops.paged_attention_rows(case.query, case.k_cache, case.v_cache, case.block_tables, [0], [40],
                                        case.scale)


def test_model_with_the_cpp_ops_matches_the_torch_paths(tiny_llama_dir, monkeypatch):
    """The whole forward (norms, RoPE, KV store, attention, SiLU) on a tiny model: the logits of
    every prompt row, then of decode and verification steps, through the C++ ops against the same
    model on the torch paths; and the same greedy tokens end to end."""
    from chatserve.batch import BatchItem
    from chatserve.config import EngineConfig
    from chatserve.engine import Engine
    from chatserve.sampling_params import SamplingParams

    def run() -> tuple[list[torch.Tensor], list[int]]:
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
        runner = engine.models.target_runner
        ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again")
        blocks = list(range(8))
        logits = [runner.run([BatchItem(ids, 0, blocks, len(ids))])[0]]
        logits.append(runner.run([BatchItem([5], len(ids), blocks, 1)])[0])  # a decode step
        logits.append(runner.run([BatchItem([6, 7, 8], len(ids) + 1, blocks, 3)])[0])  # verification rows
        out = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        return logits, out["token_ids"]

    fast_logits, fast_ids = run()
    monkeypatch.setattr(decode_ops, "usable", lambda x, *dims: False)
    slow_logits, slow_ids = run()
    for fast, slow in zip(fast_logits, slow_logits):
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    assert fast_ids == slow_ids


@pytest.mark.parametrize("k", [64, 72, 1536])  # 16-wide chunks only; a last chunk of 8; a real width
def test_f32_matmul_is_close_to_f_linear_and_its_rows_do_not_depend_on_the_row_count(k, generator):
    """MKL's sgemm and sgemv round a row differently (rows of F.linear(x[:m]) change with m);
    this kernel must not: it is what keeps dense-float32 greedy speculation lossless."""
    from chatserve.models.layers import SMALL_M
    from kernels.quant_matmul import f32_matmul

    w = torch.randn(50, k, generator=generator)
    x = torch.randn(SMALL_M, k, generator=generator)
    torch.testing.assert_close(f32_matmul(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    alone = [f32_matmul(x[i : i + 1], w) for i in range(SMALL_M)]
    for m in (2, 3, 5, 9, SMALL_M):
        out = f32_matmul(x[:m], w)
        assert all(torch.equal(out[i : i + 1], alone[i]) for i in range(m)), m


def test_model_linear_takes_the_kernel_for_few_float32_rows(generator):
    from chatserve.models.layers import SMALL_M, Linear
    from kernels.quant_matmul import f32_matmul

    layer = Linear(64, 24, bias=True)
    x = torch.randn(2, 3, 64, generator=generator)
    expected = f32_matmul(x.view(-1, 64), layer.weight.detach()) + layer.bias.detach()
    assert torch.equal(layer(x).view(-1, 24), expected)
    many = torch.randn(SMALL_M + 1, 64, generator=generator)  # past SMALL_M: F.linear
    assert torch.equal(layer(many), torch.nn.functional.linear(many, layer.weight, layer.bias))


def test_a_killed_builds_lock_is_removed_and_a_live_build_waited_for(tmp_path):
    """A build killed midway leaves `lock`, and torch's builder would wait on it forever; a live
    build (another process holding the builder flock) is waited for, and its lock left alone."""
    import subprocess
    import sys
    import threading

    lock = tmp_path / "lock"
    lock.touch()  # however young: no live builder holds the flock
    with cpu_ext._builder(tmp_path):
        assert not lock.exists()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "open(sys.argv[2], 'w').close(); print('held', flush=True); sys.stdin.read()",
         str(tmp_path / "builder.flock"), str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n" and lock.exists()  # a live build and its lock
    entered = threading.Event()

    def load():
        with cpu_ext._builder(tmp_path):
            entered.set()

    waiter = threading.Thread(target=load)
    waiter.start()
    assert not entered.wait(0.5) and lock.exists()  # waits, and leaves the live build's lock
    holder.kill()  # killed mid-build: its flock goes with it, its lock stays
    holder.wait()
    waiter.join(30)
    assert entered.is_set() and not lock.exists()


def test_the_build_directory_follows_the_sources_content(tmp_path, monkeypatch):
    """Two checkouts with the same sources share one build; a changed source gets its own."""
    import shutil

    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory",
                        lambda name, verbose: str(tmp_path / "ext" / name))
    copy = tmp_path / "copy"
    shutil.copytree(cpu_ext._DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    here = cpu_ext._build_directory()
    monkeypatch.setattr(cpu_ext, "_DIR", copy)
    assert cpu_ext._build_directory() == here and here.parent == tmp_path / "ext"
    (copy / cpu_ext.SOURCES[0]).write_text((copy / cpu_ext.SOURCES[0]).read_text() + "\n// changed\n")
    assert cpu_ext._build_directory() != here


def test_the_kernels_are_built_by_the_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    """Another ninja earlier on PATH (Debian's 1.11 beside pip's 1.13) rebuilt every kernel each time
    the two took turns: pip's, where it is, goes first, once; without it PATH is left alone."""
    import sys

    interpreter_bin = tmp_path / "venv" / "bin"
    interpreter_bin.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(interpreter_bin / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    cpu_ext._use_one_ninja()
    assert os.environ["PATH"] == os.pathsep.join(["/usr/bin", "/bin"])  # no ninja there: untouched
    (interpreter_bin / "ninja").touch()
    cpu_ext._use_one_ninja()
    cpu_ext._use_one_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(interpreter_bin), "/usr/bin", "/bin"]
