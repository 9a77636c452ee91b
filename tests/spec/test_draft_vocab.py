"""A draft head over part of the vocabulary: same logits on the kept ids, -inf elsewhere, and
speculation with it stays lossless (greedy equal to plain decoding)."""

import torch
from torch import nn

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from spec.draft_vocab import SubsetHead, frequent_token_ids, restrict_head


def test_frequent_ids_keep_the_lowest_ids_and_the_specials():
    ids = frequent_token_ids(100, 10, always=[99, 97, 5, 500])
    assert ids.tolist() == list(range(10)) + [97, 99]


def test_subset_head_matches_the_full_head_on_kept_ids(generator):
    head = nn.Linear(16, 50, bias=False)
    keep = frequent_token_ids(50, 20, always=[49])
    sub = SubsetHead(head, keep, 50)
    x = torch.randn(3, 16, generator=generator)
    full, part = head(x), sub(x)
    torch.testing.assert_close(part[:, keep], full[:, keep])
    dropped = torch.ones(50, dtype=torch.bool)
    dropped[keep] = False
    assert torch.isinf(part[:, dropped]).all() and (part[:, dropped] < 0).all()


def test_restrict_head_only_when_it_saves_something():
    model = nn.Module()
    model.lm_head = nn.Linear(8, 40, bias=False)
    assert not restrict_head(model, 40, [])
    assert not restrict_head(model, 0, [])
    assert restrict_head(model, 16, [39])
    assert isinstance(model.lm_head, SubsetHead) and model.lm_head.linear.out_features == 17


def test_greedy_speculation_with_a_subset_draft_head_is_lossless(tiny_llama_dir):
    """The target as its own draft but drafting over 128 of 259 ids: drafts outside the subset
    are impossible, so some get rejected, and the output must still equal plain decoding."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    spec = SpecConfig(method="draft", draft_model=str(tiny_llama_dir), num_draft_tokens=4, adaptive=False,
                      draft_vocab_size=128)
    fast = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    assert isinstance(fast.models.draft.lm_head, SubsetHead)
    prompts = [plain.tokenizer.encode(t) for t in ("Hello there", "def add(a, b):", "1, 2, 3,")]
    expected = [plain.generate([p], params)[0]["token_ids"] for p in prompts]
    got = fast.generate(prompts, params)
    assert [g["token_ids"] for g in got] == expected
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks


def test_sampled_speculation_with_a_subset_draft_head_runs(tiny_llama_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_llama_dir), num_draft_tokens=3, adaptive=False,
                      draft_vocab_size=64)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    ids = engine.tokenizer.encode("Once upon a time")
    out = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.8, seed=1, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 32 and out["stats"].num_drafted > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
