"""Our models against transformers on the same weights, fp32: logits and greedy continuations."""

import pytest
import torch

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams

PROMPTS = ["Hello there", "def add(a, b):\n    return", "The quick brown fox", "x"]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def engine_for(model_dir, **kw):
    return Engine(EngineConfig(model=str(model_dir), kv_cache_memory=8 << 20, **kw))


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_prefill_logits_match_transformers(which, request):
    model_dir = request.getfixturevalue(which)
    engine = engine_for(model_dir)
    hf = hf_model(model_dir)
    ids = engine.tokenizer.encode("The quick brown fox jumps")
    from chatserve.batch import BatchItem

    req_blocks = list(range(-(-len(ids) // 16)))
    logits, _ = engine.models.target_runner.run([BatchItem(ids, 0, req_blocks, len(ids))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_greedy_continuations_equal_transformers_generate(which, request):
    model_dir = request.getfixturevalue(which)
    engine = engine_for(model_dir)
    hf = hf_model(model_dir)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        out = engine.generate([ids], params)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64, eos_token_id=None, pad_token_id=0)
        assert out["token_ids"] == ref[0, len(ids):].tolist(), prompt
        assert out["finish_reason"] == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
