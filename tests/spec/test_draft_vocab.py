"""A draft head over part of the vocabulary: same logits on the kept ids, -inf elsewhere, the ids
a target says most often first, and speculation with it stays lossless (greedy equal to plain
decoding)."""

import json

import torch
from torch import nn

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
import spec.draft_vocab
from spec.draft_vocab import COUNTS_DIR, SubsetHead, frequent_token_ids, reply_counts, restrict_head, vocab_fingerprint


def test_frequent_ids_keep_the_lowest_ids_and_the_specials():
    ids = frequent_token_ids(100, 10, always=[99, 97, 5, 500])
    assert ids.tolist() == list(range(10)) + [97, 99]


def test_frequent_ids_take_the_most_counted_first_then_the_lowest():
    counts = {50: 9, 70: 9, 3: 1, 500: 4, 99: 2}  # 500 is outside the vocabulary
    ids = frequent_token_ids(100, 5, always=[98], counts=counts)
    assert ids.tolist() == [0, 3, 50, 70, 98, 99]  # 50 and 70 (tied, by id), 99, 3, then the lowest id
    assert frequent_token_ids(100, 2, always=[], counts=counts).tolist() == [50, 70]


def test_reply_counts_are_found_by_the_tokenizers_fingerprint(tmp_path):
    fp = vocab_fingerprint({"a": 0, "b": 1})
    assert fp != vocab_fingerprint({"a": 1, "b": 0})
    (tmp_path / "x.json").write_text(json.dumps({"tokenizer": fp, "counts": [[1, 5], [0, 2]]}))
    assert reply_counts(fp, tmp_path) == {1: 5, 0: 2}
    assert reply_counts(vocab_fingerprint({"a": 0}), tmp_path) == {}


def test_the_shipped_counts_are_a_targets_replies():
    """spec/data holds Qwen2.5's counts (benchmarks/draft_vocab.py): many distinct ids, most
    counted first, and ids above the 65,536 lowest among them (what lowest-ids-first missed)."""
    record = json.loads((COUNTS_DIR / "qwen2.5.json").read_text())
    counts = [c for _, c in record["counts"]]
    ids = [t for t, _ in record["counts"]]
    assert len(set(ids)) == len(ids) > 5000 and counts == sorted(counts, reverse=True)
    assert sum(counts) == record["reply_tokens"] and max(ids) < 151936
    assert sum(c for t, c in record["counts"] if t >= 65536) > 0


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


def test_the_draft_keeps_the_ids_its_tokenizers_counts_name(tiny_llama_dir, tmp_path, monkeypatch):
    """Counts for the tiny tokenizer naming ids above the 128 lowest: the loader keeps those in
    the draft's head, and greedy speculation is still plain decoding."""
    from chatserve.tokenizer import Tokenizer

    counted = list(range(200, 240))
    fp = vocab_fingerprint(Tokenizer(tiny_llama_dir).hf.get_vocab())
    (tmp_path / "tiny.json").write_text(json.dumps({"tokenizer": fp, "counts": [[t, 1000 - t] for t in counted]}))
    monkeypatch.setattr(spec.draft_vocab, "COUNTS_DIR", tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    spec_config = SpecConfig(method="draft", draft_model=str(tiny_llama_dir), num_draft_tokens=4, adaptive=False,
                             draft_vocab_size=128)
    fast = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec_config))
    kept = set(fast.models.draft.lm_head.keep_ids.tolist())
    assert set(counted) <= kept and 127 not in kept  # 40 counted + the 88 lowest ids (+ specials)
    prompts = [plain.tokenizer.encode(t) for t in ("Hello there", "def add(a, b):")]
    expected = [plain.generate([p], params)[0]["token_ids"] for p in prompts]
    assert [g["token_ids"] for g in fast.generate(prompts, params)] == expected
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_blocks
