"""Speculation over long conversations (issue #13): greedy output equal across methods and
turns, suffix decoding lossless at T > 0 (chi-square), the draft model's catch-up in bounded
chunks (the stream never stops for it), and the pool whole after suffix proposals, mixing and
aborts."""

import dataclasses

import pytest
import torch

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from chatserve.spec_costs import SpecCosts
from tests.chatserve.test_engine import assert_pool_empty, run_with_random_aborts
from tests.chi_square import chi_square_p_value

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# In units of a one-row target step: the default pair's shape (5% a row, a draft step 10%).
FIXED_COSTS = SpecCosts({r: 1.0 + 0.05 * (r - 1) for r in range(1, 65)}, {r: 0.1 for r in range(1, 17)},
                        {16: 0.3, 32: 0.5, 64: 1.0, 128: 2.0, 256: 4.0})


def make_engine(model_dir, draft_dir=None, method=None, adaptive=False, catch_up="decode", **kw):
    spec = None
    if method:
        spec = SpecConfig(method=method, draft_model=str(draft_dir) if draft_dir else None, num_draft_tokens=4,
                          adaptive=adaptive, draft_catch_up=catch_up)
    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig(model=str(model_dir), spec=spec, **kw))


def record_draft_forwards(engine) -> list[int]:
    """Rows of every draft forward, in order (the list fills as the engine runs)."""
    rows, run = [], engine.models.draft_runner.run

    def recording_run(items):
        rows.append(sum(len(it.token_ids) for it in items))
        return run(items)

    engine.models.draft_runner.run = recording_run
    return rows


@pytest.fixture(scope="module")
def conversation(tiny_llama_dir):
    """Three turns of one conversation (prompt, greedy reply) with speculation off."""
    engine = make_engine(tiny_llama_dir)
    tok = engine.tokenizer
    history = tok.encode("def f(x):\n    return x + 1\n" * 6)
    turns = []
    for question in (" Again:", " And once more:", " Last:"):
        prompt = history + tok.encode(question)
        reply = engine.generate([prompt], GREEDY)[0]["token_ids"]
        turns.append((prompt, reply))
        history = prompt + reply
    return turns


@pytest.mark.parametrize("method,adaptive", [("ngram", False), ("suffix", False), ("draft", False), ("suffix", True),
                                             ("draft", True)])
def test_greedy_output_is_equal_across_methods_and_turns(tiny_llama_dir, tiny_draft_dir, conversation, method,
                                                         adaptive):
    engine = make_engine(tiny_llama_dir, tiny_draft_dir if method == "draft" else None, method, adaptive)
    if adaptive:  # priced with fixed costs: a busy machine makes the tiny models' measured ones noise
        engine.spec.costs = FIXED_COSTS
    drafted = 0
    for turn, (prompt, expected) in enumerate(conversation):
        out = engine.generate([prompt], GREEDY)[0]
        assert out["token_ids"] == expected
        if turn:  # the previous turn's prompt and reply are in the prefix cache
            assert out["stats"].cached_tokens >= len(conversation[turn - 1][0]) // 16 * 16
        drafted += out["stats"].num_drafted
    assert drafted > 0
    assert_pool_empty(engine)


def test_suffix_replies_of_other_requests_only_with_a_corpus(tiny_llama_dir):
    """A reply suffix decoding has seen is drafted again for the same question in a new request
    (the corpus of recent replies); with suffix_corpus_tokens 0 each request drafts from its own
    tokens only, so the second request drafts exactly as the first did."""
    prompt = [1, 5, 9, 14, 3, 27, 8]
    second = {}
    for corpus_tokens in (1 << 16, 0):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, enable_prefix_caching=False,
                                     spec=SpecConfig(method="suffix", num_draft_tokens=4, adaptive=False,
                                                     suffix_corpus_tokens=corpus_tokens)))
        first = engine.generate([prompt], GREEDY)[0]
        again = engine.generate([prompt], GREEDY)[0]
        assert again["token_ids"] == first["token_ids"]
        second[corpus_tokens] = (first["stats"].num_accepted, again["stats"].num_accepted)
    with_corpus, without = second[1 << 16], second[0]
    assert with_corpus[1] > with_corpus[0] and without[1] == without[0], second
    with pytest.raises(ValueError, match="suffix_corpus_tokens"):
        SpecConfig(method="suffix", suffix_corpus_tokens=-1)


def test_a_free_proposer_priced_out_still_probes_and_recovers(tiny_llama_dir, conversation):
    """Drafts pay here only above acceptance 0.6 (a second row costs 0.6 of a step) and n-gram's
    engine-wide estimate is 0.3, so every offer, probes included, is priced out. The probe every
    16 steps still drafts one token; on text that repeats itself it is accepted, the request's
    estimate climbs and it drafts from then on. Output unchanged."""
    from spec.adaptive import AcceptanceEMA

    engine = make_engine(tiny_llama_dir, method="ngram", adaptive=True)
    engine.spec.costs = SpecCosts({1: 1.0, **{r: 1.0 + 0.6 * (r - 1) for r in range(2, 65)}}, {})
    engine.spec.methods["ngram"].accept_rate = AcceptanceEMA(0.2, 0.3)
    prompt, _ = conversation[2]
    params = dataclasses.replace(GREEDY, max_tokens=64)
    expected = make_engine(tiny_llama_dir).generate([prompt], params)[0]["token_ids"]
    out = engine.generate([prompt], params)[0]
    assert out["token_ids"] == expected
    assert out["stats"].num_drafted > 8, out["stats"]  # not just the probes: drafting resumed
    assert_pool_empty(engine)


@pytest.mark.parametrize("catch_up", ["decode", "prefill", "whole"])
def test_a_long_prompt_is_caught_up_as_configured_and_output_is_unchanged(tiny_llama_dir, catch_up):
    """Self-draft (every draft accepted) on a 600-token prompt: "decode" catches the draft up in
    chunks of at most CATCH_UP_CHUNK rows inside decode steps, "prefill" beside the target's
    prefill chunks, "whole" in one forward before its first draft."""
    from chatserve.spec_runner import CATCH_UP_CHUNK

    plain = make_engine(tiny_llama_dir)
    prompt = [(11 * i) % 250 + 3 for i in range(600)]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    expected = plain.generate([prompt], params)[0]["token_ids"]
    engine = make_engine(tiny_llama_dir, tiny_llama_dir, "draft", catch_up=catch_up, max_num_batched_tokens=128)
    rows = record_draft_forwards(engine)
    rid = engine.add_request(prompt, params)
    emitted, forwards_before_first_token = [], None
    while engine.has_unfinished():
        deltas = engine.step()
        if deltas and forwards_before_first_token is None:
            forwards_before_first_token = len(rows)
        emitted += [d.token_ids for d in deltas if d.request_id == rid]
    assert sum(emitted, []) == expected
    assert all(emitted), "a step emitted nothing"
    if catch_up == "decode":
        assert forwards_before_first_token == 0 and max(rows) <= CATCH_UP_CHUNK
    elif catch_up == "prefill":
        assert forwards_before_first_token >= 4  # one beside each 128-token prefill chunk
        assert max(rows) <= 128
    else:
        assert forwards_before_first_token == 0 and max(rows) >= 600
    assert_pool_empty(engine)


@pytest.mark.parametrize("max_tokens,catches_up", [(8, False), (200, True)])
def test_the_draft_catches_up_only_when_its_drafts_will_pay(tiny_llama_dir, max_tokens, catches_up):
    """Priced with fixed costs (in units of a one-row target step): catching up on 600 tokens in
    32-token chunks costs ~9.5; at acceptance 0.8 drafting saves ~1.8 a step, which 8 tokens
    cannot repay and 200 can."""
    engine = make_engine(tiny_llama_dir, tiny_llama_dir, "draft", adaptive=True)
    engine.spec.costs = FIXED_COSTS
    rows = record_draft_forwards(engine)
    prompt = [(13 * i) % 250 + 3 for i in range(600)]
    out = engine.generate([prompt], dataclasses.replace(GREEDY, max_tokens=max_tokens))[0]
    assert len(out["token_ids"]) == max_tokens
    assert bool(rows) == catches_up
    if catches_up:
        assert max(rows) <= 32 and out["stats"].num_drafted > 0
    assert_pool_empty(engine)


def test_a_request_prefilling_beside_counts_in_the_catch_up_price(tiny_llama_dir):
    """Rows that cost almost nothing at batch 1 (a second row +5%) and a full row each past two:
    a draft pays for one stream, not for two. Request A decodes while B's 600-token prompt is
    prefilled in chunks: A's draft does not catch up on its own 600 tokens then, since A will
    decode beside B (it did, priced as if alone, and the two then never drafted: the default
    pair's batch-2 loss, docs/benchmarks.md session 51); once B is done A catches up and drafts."""
    target = {1: 1.0, 2: 1.05, **{r: 0.55 * r for r in range(3, 65)}}
    engine = make_engine(tiny_llama_dir, tiny_llama_dir, "draft", adaptive=True, max_num_batched_tokens=128)
    engine.spec.costs = SpecCosts(target, {r: 0.1 for r in range(1, 17)}, FIXED_COSTS.catch_up_seconds)
    rows = record_draft_forwards(engine)
    prompt_a, prompt_b = [(13 * i) % 250 + 3 for i in range(600)], [(7 * i) % 250 + 3 for i in range(600)]
    a = engine.add_request(prompt_a, dataclasses.replace(GREEDY, max_tokens=200))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    b = engine.add_request(prompt_b, dataclasses.replace(GREEDY, max_tokens=8))
    done: set[str] = set()
    while b not in done:
        done |= {d.request_id for d in engine.step() if d.finished}
    assert rows == [], rows  # no catch-up while B prefilled and decoded beside A
    while engine.has_unfinished():
        done |= {d.request_id for d in engine.step() if d.finished}
    assert a in done and rows and max(rows) <= 64  # alone, A caught up in chunks
    assert_pool_empty(engine)


@pytest.fixture
def one_thread():
    """Tiny ops on one thread: with two, a busy machine stalls each op for milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_suffix_proposals_keep_sampling_exact(one_thread):
    """T > 0: suffix proposals (one-hot drafts) verified by the engine's sampler. The target's
    logits after the prompt and after each draft are fixed; x, the proposal's first token, is
    the target's third likeliest. Over 4000 seeded requests the first emitted token must follow
    the target's distribution (chi-square), and after an accepted x the next one its
    distribution after x; x is accepted as often as the target gives it."""
    from chatserve.request import Request
    from chatserve.sampler import Sampler
    from chatserve.spec_methods import SpecState
    from chatserve.spec_methods.suffix import SuffixMethod

    vocab, temperature, n = 16, 0.8, 4000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 2  # [k + 1, vocab]
    target = torch.softmax(logits.double() / temperature, -1)  # [k + 1, vocab]
    x, y = int(target[0].argsort(descending=True)[2]), int(target[1].argmax())
    prompt = [1, 2, 3, 4, 5]
    method = SuffixMethod(SpecConfig(method="suffix"))
    method.corpus.add(prompt + [x, y])  # an earlier reply that went on with [x, y]
    sampler = Sampler(eos_token_ids=())
    firsts, after_x = [], []
    for seed in range(n):
        req = Request(f"r{seed}", prompt, SamplingParams(temperature=temperature, seed=seed))
        req.spec = SpecState((method,))
        req.spec.offer = method.offer(req, 2, method.accept_rate.rate)
        assert req.spec.offer.token_ids == [x, y]
        method.propose([req], [2])
        tokens, num_accepted = sampler.verify(req, logits, req.draft_token_ids, req.draft_probs)
        firsts.append(tokens[0])
        if num_accepted >= 1:
            after_x.append(tokens[1])
    for samples, probs in ((firsts, target[0]), (after_x, target[1])):
        p_value = chi_square_p_value(torch.tensor(samples), probs)
        assert p_value > 1e-6, p_value
    accepted = len(after_x) / n
    assert abs(accepted - target[0, x]) < 4 * (target[0, x] * (1 - target[0, x]) / n) ** 0.5


def test_pool_stays_whole_with_suffix_proposals_mixing_preemption_and_aborts(tiny_llama_dir, tiny_draft_dir):
    """Draft requests that also take suffix proposals, suffix, n-gram and plain requests, greedy
    and sampled, in a pool small enough to preempt, with random aborts: the block manager's
    invariants hold after every step and every block comes back."""
    probe = make_engine(tiny_llama_dir, tiny_draft_dir, "draft")
    per_block = sum(r.kv_cache.num_bytes // probe.block_manager.num_blocks
                    for r in (probe.models.target_runner, probe.models.draft_runner))
    engine = make_engine(tiny_llama_dir, tiny_draft_dir, "draft", kv_cache_memory=24 * per_block)
    methods = [{"spec_method": "draft"}, {"spec_method": "suffix"}, {"spec_method": "ngram"}, {"num_draft_tokens": 0}]
    run_with_random_aborts(engine, methods, 12)
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec.stats_by_method["suffix"].num_draft_tokens > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("first", range(4))
def test_greedy_output_is_equal_when_the_method_changes_every_turn(tiny_llama_dir, tiny_draft_dir, conversation,
                                                                 first):
    """One engine, one conversation, each turn by another method (off, draft, suffix, n-gram,
    in four rotations): every turn equals the spec-off reply and reuses every full block of the
    previous turn's prompt, whichever method computed them."""
    engine = make_engine(tiny_llama_dir, tiny_draft_dir, "draft")
    names = ["off", "draft", "suffix", "ngram"]
    methods = names[first:] + names[:first]
    for turn, ((prompt, expected), name) in enumerate(zip(conversation, methods)):
        extra = {"num_draft_tokens": 0} if name == "off" else {"spec_method": name}
        out = engine.generate([prompt], dataclasses.replace(GREEDY, **extra))[0]
        assert out["token_ids"] == expected, (turn, name)
        assert out["stats"].spec_method == (None if name == "off" else name)
        if turn:
            assert out["stats"].cached_tokens >= len(conversation[turn - 1][0]) // 16 * 16
    assert engine.spec.stats.num_draft_tokens > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_sampled_tokens_follow_the_target_through_suffix_proposals(tiny_llama_dir, tiny_draft_dir, one_thread,
                                                                   method):
    """T = 0.3 through the engine: 3000 seeded requests of one prompt, 3 tokens each. The first
    comes from the prefill; the second from verifying a one-token proposal. The suffix corpus
    holds, for every possible first token t1, the prompt's tail + t1 + the likeliest token after
    it, so every request gets a suffix proposal, most of them accepted. "draft" requests weigh it
    against their draft model's (sampled, with its own probabilities) and take one or the other.
    The second token must follow the target's marginal sum_t1 P(t1) P(t2 | t1), computed by
    transformers (chi-square), and for suffix requests each proposal must be accepted as often as
    the target gives it. (At T = 1 the tiny model's proposals would be accepted 1.6% of the time:
    0.3 sharpens it to 36%.)"""
    from transformers import AutoModelForCausalLM

    temperature, n = 0.3, 3000
    engine = make_engine(tiny_llama_dir, tiny_draft_dir if method == "draft" else None, method)
    prompt = engine.tokenizer.encode("Suffix proposals at a temperature:")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    vocab = engine.models.vocab_size
    with torch.no_grad():
        first_probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)  # [vocab]
        seconds = torch.tensor([prompt + [t] for t in range(vocab)])  # [vocab, len(prompt) + 1]
        second_probs = torch.softmax(hf(seconds).logits[:, -1].double() / temperature, -1)  # [vocab, vocab]
    likeliest = second_probs.argmax(-1).tolist()  # [vocab]: the proposal after each t1
    corpus = engine.spec.methods["suffix"].corpus
    for t in range(vocab):
        corpus.add(prompt[-3:] + [t, likeliest[t]])
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=seed, ignore_eos=True) for seed in range(n)]
    outs = engine.generate([prompt] * n, params)

    assert all(len(o["token_ids"]) == 3 and o["stats"].num_drafted == 1 for o in outs)  # one proposal each
    p_value = chi_square_p_value(torch.tensor([o["token_ids"][1] for o in outs]), first_probs @ second_probs)
    assert p_value > 1e-6, p_value
    by_method = engine.spec.stats_by_method
    assert by_method["suffix"].num_draft_tokens > 0
    if method == "suffix":
        accept = float((first_probs * second_probs.gather(1, torch.tensor(likeliest).view(-1, 1))[:, 0]).sum())
        accepted = sum(o["stats"].num_accepted for o in outs) / n
        assert 0.2 < accept < 0.95  # both branches of verification are exercised
        assert abs(accepted - accept) < 4 * (accept * (1 - accept) / n) ** 0.5
    else:
        assert by_method["draft"].num_draft_tokens > 0  # both kinds of proposal were verified
    assert_pool_empty(engine)


def test_a_seeded_request_samples_the_same_text_whatever_the_measured_costs(tiny_llama_dir, tiny_draft_dir, one_thread):
    """Every draft draws from the request's generator, so a k or a catch-up chunk chosen from
    timings would make a seed give different text from run to run. A seeded request drafts a
    fixed k in fixed chunks: two engines priced differently sample the same tokens for it, while
    an unseeded request is priced (and drafts differently) on each."""
    dear = SpecCosts({r: 1.0 + 0.5 * (r - 1) for r in range(1, 65)}, {r: 0.6 for r in range(1, 17)},
                     {16: 0.1, 32: 0.15, 64: 0.2, 128: 0.3, 256: 0.4})
    prompt = [(7 * i) % 250 + 3 for i in range(300)]
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=1234, ignore_eos=True)
    unseeded = dataclasses.replace(seeded, seed=None, temperature=0.0)
    outs = []
    for costs in (FIXED_COSTS, dear):
        engine = make_engine(tiny_llama_dir, tiny_draft_dir, "draft", adaptive=True)
        engine.spec.costs = costs
        rows = record_draft_forwards(engine)
        sampled = engine.generate([prompt], seeded)[0]
        fixed_rows = list(rows)
        greedy = engine.generate([prompt[:-1]], unseeded)[0]
        outs.append((sampled["token_ids"], sampled["stats"].num_drafted, fixed_rows, greedy["stats"].num_drafted))
        assert_pool_empty(engine)
    (tokens_a, drafted_a, rows_a, priced_a), (tokens_b, drafted_b, rows_b, priced_b) = outs
    assert drafted_a > 0 and rows_a == rows_b
    assert tokens_a == tokens_b
    assert priced_a != priced_b  # the prices do change what an unseeded request drafts


def test_a_long_free_draft_waits_until_the_streams_steps_are_long(tiny_llama_dir, conversation):
    """Rows at 25% of a step and a trusted suffix proposer (~0.98 a draft at any depth): unbounded, the
    third step already verifies 11 drafts (3.75x a plain step). With the gap limit (2.5) a step
    costs at most 2.5x the stream's typical step: a plain one's until it has 3 steps (so <= 6
    drafts), then the median of its latest; as its steps grow, so may its drafts. Greedy output
    unchanged."""
    from spec.adaptive import AcceptanceEMA

    costs = SpecCosts({r: 1.0 + 0.25 * (r - 1) for r in range(1, 65)}, {r: 0.1 for r in range(1, 17)},
                      {16: 0.3, 32: 0.5, 64: 1.0, 128: 2.0, 256: 4.0})
    prompt, _ = conversation[2]
    params = dataclasses.replace(GREEDY, max_tokens=64)
    expected = make_engine(tiny_llama_dir).generate([prompt], params)[0]["token_ids"]
    drafted = {}
    for gap_limit in (2.5, 0):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=SpecConfig(
            method="suffix", num_draft_tokens=4, num_free_draft_tokens=16)))
        engine.spec.costs, engine.spec.gap_limit = costs, gap_limit
        engine.spec.methods["suffix"].accept_rate = AcceptanceEMA(0.05, 0.95)
        engine.spec.methods["suffix"].depth_prices = (1.0,)
        ks, propose = [], engine.spec.methods["suffix"].propose

        def recording_propose(reqs, step_ks, propose=propose, ks=ks):
            ks.extend(step_ks)
            return propose(reqs, step_ks)

        engine.spec.methods["suffix"].propose = recording_propose
        out = engine.generate([prompt], params)[0]
        assert out["token_ids"] == expected
        assert_pool_empty(engine)
        drafted[gap_limit] = ks
    assert max(drafted[0][:3]) > 6, drafted  # the premise: unbounded, an early step drafts far
    assert max(drafted[2.5][:3]) <= 6 and max(drafted[2.5]) > 6, drafted


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_free_proposals_draft_past_num_draft_tokens_only_when_priced(tiny_llama_dir, conversation, method):
    """Proposals that run no model cost verification rows only: under adaptive k they may draft up
    to num_free_draft_tokens (8 here) where rows are cheap (FIXED_COSTS, 5% a row) and the method
    is trusted (engine-wide acceptance 0.95), never past it; with a fixed k, num_draft_tokens (4)
    is the most. Greedy output unchanged either way."""
    from spec.adaptive import AcceptanceEMA

    prompt, expected = conversation[2]
    for adaptive, cap in ((True, 8), (False, 4)):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=SpecConfig(
            method=method, num_draft_tokens=4, num_free_draft_tokens=8, adaptive=adaptive)))
        if adaptive:
            engine.spec.costs = FIXED_COSTS
        engine.spec.methods[method].accept_rate = AcceptanceEMA(0.05, 0.95)
        if method == "suffix":  # trusted at every depth
            engine.spec.methods[method].depth_prices = (1.0,)
        ks, propose = [], engine.spec.methods[method].propose

        def recording_propose(reqs, step_ks, propose=propose, ks=ks):
            ks.extend(step_ks)
            return propose(reqs, step_ks)

        engine.spec.methods[method].propose = recording_propose
        out = engine.generate([prompt], GREEDY)[0]
        assert out["token_ids"] == expected
        assert max(ks) == cap, (adaptive, ks)
        assert_pool_empty(engine)
    with pytest.raises(ValueError, match="num_free_draft_tokens"):
        SpecConfig(method="ngram", num_free_draft_tokens=0)
