"""DecodeStack (kernels/decode_stack_cpu.cpp): the decoder's layers in one C++ call for steps of
few rows must give exactly the numbers of the modules it replaces (models/llama.py with
stack.enabled = False), for every kind of linear layer, for decode and verification rows of
several sequences in one step, and must stand aside where it has no path (quantized KV)."""

import pytest
import torch

from chatserve.batch import BatchItem
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from kernels import decode_ops
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_q4k_dir(tmp_path_factory):
    """in_features 256 and 512: every layer takes the Q4_K kernel."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_q4k_stack"), "qwen2", seed=5, hidden_size=256,
                           intermediate_size=512)


def steps_both_ways(model_dir, **config) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    """Logits of a prefill, then of mixed steps (a decode row beside verification rows), computed
    through the stack and again through the modules on the same pool: -> (stack, modules, model)."""
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=8 << 20, **config))
    runner = engine.models.target_runner
    model = runner.model
    a = engine.tokenizer.encode("def parse(path):\n    with open(path) as f:\n        return f.read()")
    b = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    blocks_a, blocks_b = list(range(0, 8)), list(range(8, 16))
    runner.run([BatchItem(a, 0, blocks_a, 1), BatchItem(b, 0, blocks_b, 1)])  # prompts: the modules
    steps = [
        [BatchItem([5], len(a), blocks_a, 1)],  # one decode row
        [BatchItem([6], len(a) + 1, blocks_a, 1), BatchItem([7, 8, 9, 10], len(b), blocks_b, 4)],  # + verification
        [BatchItem([11, 12, 13], len(a) + 2, blocks_a, 3), BatchItem([14], len(b) + 4, blocks_b, 1)],
    ]
    out = {True: [], False: []}
    for items in steps:
        for use in (True, False):  # the same slots written twice with the same values
            model.stack.enabled = use
            out[use].append(runner.run(items)[0])
    return out[True], out[False], model


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_the_stack_gives_the_modules_numbers_exactly(arch, quantization, tiny_llama_dir, tiny_qwen_dir):
    stack, modules, model = steps_both_ways(tiny_llama_dir if arch == "llama" else tiny_qwen_dir,
                                            quantization=quantization)
    assert model.stack.built is not None, "the stack did not run"
    for s, m in zip(stack, modules):
        assert torch.equal(s, m)


def test_the_stack_takes_q4k_layers(tiny_q4k_dir):
    stack, modules, model = steps_both_ways(tiny_q4k_dir, quantization="int4")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Q4KLinear" in kinds and model.stack.built is not None
    for s, m in zip(stack, modules):
        assert torch.equal(s, m)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "bf16"])
def test_the_stack_runs_on_a_16_bit_kv_cache(kv_cache_dtype, tiny_qwen_dir):
    stack, modules, model = steps_both_ways(tiny_qwen_dir, kv_cache_dtype=kv_cache_dtype)
    assert model.stack.built is not None, "the stack did not run"
    for s, m in zip(stack, modules):
        assert torch.equal(s, m)


def test_a_quantized_kv_cache_keeps_the_modules(tiny_qwen_dir):
    stack, modules, model = steps_both_ways(tiny_qwen_dir, kv_cache_dtype="int8")
    assert model.stack.built is None
    for s, m in zip(stack, modules):
        assert torch.equal(s, m)


def test_query_rows_lay_out_each_rows_sequence_and_context():
    from chatserve.batch import build_batch

    batch = build_batch([BatchItem([1, 2, 3], 4, [0, 1], 1), BatchItem([9], 6, [2, 3], 1)], block_size=4)
    seqs, contexts = batch.attn.query_rows()
    assert seqs.tolist() == [0, 0, 0, 1] and contexts.tolist() == [5, 6, 7, 7]


def test_a_step_past_the_row_limit_takes_the_modules(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    model = engine.models.target_runner.model
    ids = list(range(3, 3 + decode_ops.STACK_MAX_ROWS + 1))
    engine.models.target_runner.run([BatchItem(ids, 0, list(range(8)), 1)])
    assert model.stack.caches is None  # never built: the only step had too many rows
