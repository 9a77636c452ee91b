"""OpenAI's presence / frequency penalties, logit_bias and logprobs: the maths, the sampler's rows
under drafts, and the engine with and without speculation (tiny random models)."""

import math

import pytest
import torch

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.request import Request
from chatserve.sampler import Sampler
from chatserve.sampling_params import SamplingParams
from spec.sampling import apply_logit_bias, apply_presence_frequency_penalties, token_logprobs

PROMPTS = ["a b c a b c a b", "def f(x): return x", "hello hello hello"]


def engine_for(model_dir, spec: SpecConfig | None = None) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), kv_cache_memory=8 << 20, spec=spec))


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(2, 5)
    apply_presence_frequency_penalties(logits, [[1, 1, 3], []], presence=0.5, frequency=0.25)
    # token 1 twice: 2 * 0.25 + 0.5; token 3 once: 0.25 + 0.5; the second row generated nothing
    assert logits.tolist() == [[0, -1.0, 0, -0.75, 0], [0, 0, 0, 0, 0]]


def test_logit_bias_adds_to_every_row_and_logprobs_pick_the_chosen_and_the_top():
    logits = apply_logit_bias(torch.zeros(2, 4), ((2, 3.0), (0, -1.0)))
    assert logits.tolist() == [[-1.0, 0, 3.0, 0]] * 2
    lp = torch.log_softmax(logits, -1)
    (lp0, top0), (lp1, top1) = token_logprobs(lp, [2, 1], 2)
    assert lp0 == pytest.approx(float(lp[0, 2])) and lp1 == pytest.approx(float(lp[1, 1]))
    assert [t for t, _ in top0] == [2, 1] or [t for t, _ in top0] == [2, 3]  # ties between 1 and 3
    assert top0[0][1] >= top0[1][1]


def test_each_verify_row_is_penalized_as_if_its_drafts_were_generated():
    sampler = Sampler(eos_token_ids=(0,))
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    req = Request("r", [5, 6], params)
    req.token_ids += [7]  # one generated token
    rows = sampler._penalize(req, torch.zeros(3, 10), [7, 8])
    assert rows[0, 7] == -1.5 and rows[1, 7] == -2.5 and rows[2, 7] == -2.5  # 7 generated, then drafted
    assert rows[0, 8] == 0 and rows[1, 8] == 0 and rows[2, 8] == -1.5
    assert rows[:, 5].eq(0).all()  # prompt tokens do not count


def test_a_large_logit_bias_forces_its_token_greedy_and_sampled(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False))
    forced = 42
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True,
                                logit_bias={forced: 100.0})
        out = engine.generate([engine.tokenizer.encode(PROMPTS[0])], params)[0]
        assert out["token_ids"] == [forced] * 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_logit_bias_outside_the_vocabulary_is_refused(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_penalties_and_logprobs_under_speculation_equal_plain_decoding(tiny_llama_dir, method):
    """Greedy with penalties and bias: the same tokens and logprobs with speculation as without."""
    plain = engine_for(tiny_llama_dir)
    if method == "ngram":
        spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    else:
        spec = SpecConfig(method="draft", draft_model=str(tiny_llama_dir), num_draft_tokens=4, adaptive=False)
    fast = engine_for(tiny_llama_dir, spec)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.3, logit_bias={7: 2.0}, logprobs=3)
    drafted = 0
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        want, got = plain.generate([ids], params)[0], fast.generate([ids], params)[0]
        assert got["token_ids"] == want["token_ids"]
        assert len(got["logprobs"]) == len(got["token_ids"])
        for (t0, lp0, top0), (t1, lp1, top1) in zip(want["logprobs"], got["logprobs"]):
            assert t0 == t1 and lp1 == pytest.approx(lp0, abs=1e-4)
            assert [t for t, _ in top1] == [t for t, _ in top0]
        drafted += got["stats"].num_drafted
    assert drafted > 0
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks


def test_the_penalty_changes_greedy_output_the_way_it_says(tiny_llama_dir):
    """A strong frequency penalty never repeats a token while unseen ones remain close; without it a
    tiny random model repeats itself."""
    engine = engine_for(tiny_llama_dir)
    ids = engine.tokenizer.encode(PROMPTS[2])
    free = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]["token_ids"]
    assert len(set(free)) < len(free)
    penalized = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                      frequency_penalty=2.0, presence_penalty=2.0,
                                                      logprobs=0))[0]
    # each emitted token's logprob is the maximum of its (penalized) row: greedy
    assert all(lp <= 0 for _, lp, _ in penalized["logprobs"])
    assert len(set(penalized["token_ids"])) > len(set(free))


def test_sampled_logprobs_are_the_sampling_distribution(tiny_llama_dir):
    """With top_k = 5 the top 5 logprobs are the whole distribution the token was drawn from: they
    sum to 1, and the chosen token is one of them."""
    engine = engine_for(tiny_llama_dir)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=5, seed=0, ignore_eos=True, logprobs=5)
    out = engine.generate([engine.tokenizer.encode(PROMPTS[1])], params)[0]
    for tok, lp, top in out["logprobs"]:
        assert math.fsum(math.exp(v) for _, v in top) == pytest.approx(1.0, abs=1e-4)
        assert tok in [t for t, _ in top] and lp == pytest.approx(dict(top)[tok])
