"""The EAGLE head (issue #14) on tiny random targets: a head trained for a few steps in the test
keeps greedy output equal to speculation off over turns (prefix cache included), sampled
tokens follow the target (chi-square), the pool stays whole through drafts, rollbacks,
preemption and aborts, and a head for other weights is refused. An "oracle" head, exact for a
one-layer target, must have every draft accepted: its KV is right wherever it reads."""

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chatserve.batch import BatchItem
from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.head_data import Sequence, choose_vocab, load_collected, target_features
from chatserve.head_store import save_head, weights_hash
from chatserve.models.eagle_head import EagleHead
from chatserve.sampling_params import SamplingParams
from chatserve.train_head import (VAL_DEPTH, TrainConfig, batch_windows, choose_train_dtype, loss_fn, new_head,
                                  split_validation, train, validate, validate_chain)
import chatserve.train_head as th
from tests.chatserve.test_engine import assert_pool_empty, run_with_random_aborts
from tests.chi_square import chi_square_p_value

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
EAGLE = dataclasses.replace(GREEDY, spec_method="eagle")
PROMPTS = ["Hello there", "def add(a, b):", "1, 2, 3, 4,", "The quick brown fox jumps over", "SELECT * FROM", "x"]
HISTORY = "def f(x):\n    return x + 1\n" * 6
QUESTIONS = (" Again:", " And once more:", " Last:")


def make_engine(model_dir, head_path=None, method="eagle", adaptive=False, **kw):
    spec = None
    if method:
        spec = SpecConfig(method=method, num_draft_tokens=4, adaptive=adaptive,
                          eagle_head=str(head_path) if head_path else None)
    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig(model=str(model_dir), spec=spec, **kw))


@contextlib.contextmanager
def one_thread():
    """Tiny ops on one thread: with two, a busy machine stalls each op for milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """A cache dir of the module's own: heads and the weight-hash memo go there, not to ~/.cache."""
    old = os.environ.get("CHATSERVE_CACHE")
    os.environ["CHATSERVE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["CHATSERVE_CACHE"]
    else:
        os.environ["CHATSERVE_CACHE"] = old


@pytest.fixture(scope="module")
def conversation(tiny_llama_dir):
    """Three turns of one conversation (prompt, greedy reply) with speculation off."""
    engine = make_engine(tiny_llama_dir, method=None)
    tok, history, turns = engine.tokenizer, engine.tokenizer.encode(HISTORY), []
    for question in QUESTIONS:
        prompt = history + tok.encode(question)
        reply = engine.generate([prompt], GREEDY)[0]["token_ids"]
        turns.append((prompt, reply))
        history = prompt + reply
    return turns


@pytest.fixture(scope="module")
def trained_head(tiny_llama_dir, conversation, tmp_path_factory):
    """A head trained for 100 steps (~5 s) on the target's greedy continuations of the test
    prompts and conversation, over a trimmed vocabulary (200 of 272 ids)."""
    return _train_test_head(tiny_llama_dir, conversation, tmp_path_factory, ())


@pytest.fixture(scope="module")
def fused_head(tiny_llama_dir, conversation, tmp_path_factory):
    """The same, reading EAGLE-3's features: both layers' outputs of the tiny target, fused."""
    return _train_test_head(tiny_llama_dir, conversation, tmp_path_factory, (0, 1))


NARROW_MLP = 48  # the tiny target's MLP is 128 wide


@pytest.fixture(scope="module")
def narrow_head(tiny_llama_dir, conversation, tmp_path_factory):
    """A fused head whose layer's MLP is narrower than the target's (NARROW_MLP wide)."""
    return _train_test_head(tiny_llama_dir, conversation, tmp_path_factory, (0, 1), NARROW_MLP)


@pytest.fixture(params=["final", "fused", "narrow"])
def any_head(request, trained_head, fused_head, narrow_head):
    """Each kind of head in turn: EAGLE-1's features, EAGLE-3's, EAGLE-3's with a narrower MLP."""
    return {"final": trained_head, "fused": fused_head, "narrow": narrow_head}[request.param]


def _train_test_head(tiny_llama_dir, conversation, tmp_path_factory, feature_layers, intermediate_size=None):
    engine = make_engine(tiny_llama_dir, method=None)
    engine.models.target_runner.feature_layers = feature_layers
    tok, target = engine.tokenizer, engine.models.target
    params = dataclasses.replace(GREEDY, max_tokens=48)
    texts = [tok.encode(p) for p in PROMPTS]
    texts = [p + engine.generate([p], params)[0]["token_ids"] for p in texts]
    texts += [prompt + reply for prompt, reply in conversation]
    sequences = [Sequence(torch.tensor(ids), target_features(engine, ids), 0) for ids in texts]
    head_ids = choose_vocab(sequences, target.vocab_size, 200, tok.special_token_ids)
    head = new_head(target, tiny_llama_dir, engine.max_model_len, head_ids, seed=0, feature_layers=feature_layers,
                    intermediate_size=intermediate_size)
    assert head.layer.mlp.intermediate == (intermediate_size or target.config.intermediate_size)
    cfg = TrainConfig(max_steps=100, window=64, batch_tokens=512, lr=1e-3, warmup_steps=10, unroll=2)
    with one_thread():
        state = train(head, target.embed_tokens, sequences, cfg, 300.0, {})
    assert state["step"] == 100 and state["metrics"]["top1"] > 0.3 and "top1_1" in state["metrics"]
    path = tmp_path_factory.mktemp("head") / "eagle-head.pt"
    save_head(path, head, weights_hash(tiny_llama_dir), {"steps": 100})
    return path


def test_captured_layers_leave_the_forward_unchanged(tiny_llama_dir):
    """run_with_features with feature_layers captures those layers' outputs in the same forward (the
    decode stack's one C++ call on few rows, the modules on a prefill): logits and final features
    bit for bit those of a forward without, and each captured column the layer's output (a forward
    hook on the modules) RMS-normalized without weights, the same from the stack as the modules."""
    engine = make_engine(tiny_llama_dir, method=None)
    runner, model = engine.models.target_runner, engine.models.target
    ids = engine.tokenizer.encode("Captured and not, the same numbers. " * 2)
    blocks = list(range(-(-(len(ids) + 1) // 16)))
    hooked, embedded = {}, []
    model.layers[0].register_forward_hook(lambda m, i, out: hooked.__setitem__("h", out[0] + out[1]))
    model.embed_tokens.register_forward_hook(lambda m, i, out: embedded.append(len(out)))

    def run(layers, stack):
        runner.feature_layers, model.stack.enabled = layers, stack
        embedded.clear()
        prefill = runner.run_with_features([BatchItem(ids, 0, blocks, 1)])
        hooked.clear()  # the decode row's alone
        decode = runner.run_with_features([BatchItem([ids[0]], len(ids), blocks, 1)])
        assert embedded == [len(ids), 1], "each forward embeds its rows once, whoever runs the layers"
        return prefill, decode, hooked.get("h")

    decoded = {}
    for stack in (True, False):
        (logits, _, final), (logits1, _, final1), _ = run((), stack)
        (clogits, _, fused), (clogits1, _, fused1), layer0 = run((0,), stack)
        assert torch.equal(logits, clogits) and torch.equal(logits1, clogits1)
        assert fused.shape[1] == 2 * final.shape[1] and torch.equal(fused[:, 64:], final)
        assert torch.equal(fused1[:, 64:], final1)
        decoded[stack] = fused1
        assert (layer0 is None) == stack and model.stack.built is not None  # the decode row ran in C++
    torch.testing.assert_close(decoded[False][:, :64], torch.nn.functional.rms_norm(layer0, (64,), eps=1e-6))
    assert torch.equal(decoded[True], decoded[False])
    with pytest.raises(ValueError, match="increasing layer indices"):
        model(torch.tensor([1]), torch.tensor([0]), None, runner.kv_cache.layers, capture=(1, 0))


def test_every_twentieth_reply_is_held_out_to_validate_on():
    seqs = [Sequence(torch.arange(10), torch.zeros(10, 4), 10 if i % 3 == 0 else 4) for i in range(90)]
    train_seqs, val = split_validation(seqs)
    replies = [s for s in seqs if s.num_prompt_tokens < 10]  # 60: the 20th and 40th and 60th held out
    assert val == [replies[19], replies[39], replies[59]]
    assert len(train_seqs) == 87 and not any(any(v is t for t in train_seqs) for v in val)
    assert split_validation(seqs[:25])[1] == []  # fewer than 20 replies: nothing held out


def test_training_validates_and_reports_only_a_better_head(tiny_llama_dir, conversation):
    """train() with held-out sequences scores a chain's mean accepted length on their reply
    positions (and pass-0 agreement) and calls on_best only when the length beats the best so
    far: a head trained on, then wrecked by a huge learning
    rate, is not reported again (the command keeps the best head as the servable one)."""
    engine = make_engine(tiny_llama_dir, method=None)
    target = engine.models.target
    sequences = [Sequence(torch.tensor(p + r), target_features(engine, p + r), len(p)) for p, r in conversation]
    head = new_head(target, tiny_llama_dir, engine.max_model_len,
                    choose_vocab(sequences, target.vocab_size, 200, engine.tokenizer.special_token_ids), seed=0)
    before = validate_chain(head, target.embed_tokens, sequences)
    best = []
    # float32: the wreck is chaotic; under bf16 autocast this seed's head, its weights blown up
    # ~500x as in float32, happened to find its way back to top-1 1.0 within the 20 steps
    cfg = TrainConfig(max_steps=60, window=64, batch_tokens=512, lr=1e-3, warmup_steps=10, checkpoint_seconds=0.0,
                      train_dtype="float32")
    with one_thread():
        state = train(head, target.embed_tokens, sequences, cfg, 300.0, {}, val=sequences, on_best=best.append)
    assert best and best == sorted(best) and len(set(best)) == len(best)  # only improvements reported
    assert state["best_val_accepted"] == best[-1] > before and state["val_accepted"] <= best[-1]
    assert 0.0 <= state["val_top1"] <= 1.0
    # the walked length is of the same chains: the held-out hits of the head as trained
    assert state["val_walked"] == th.walked_length(th.held_out_hits(head, target.embed_tokens, sequences), VAL_DEPTH)
    reported = len(best)
    wreck = dataclasses.replace(cfg, max_steps=80, lr=50.0, warmup_steps=1)
    with one_thread():
        state = train(head, target.embed_tokens, sequences, wreck, 300.0, state, val=sequences, on_best=best.append)
    assert state["val_accepted"] < state["best_val_accepted"] == best[-1] and len(best) == reported


def test_a_chain_is_scored_by_the_tokens_it_gets_accepted(tiny_llama_dir, conversation):
    """validate_chain of one draft is 1 + the first draft's agreement (validate) where the head's
    vocabulary holds every token, trained or not; a chain of 4 is 1 + the shares of anchors whose
    first 1..4 drafts all hold, more than one draft gets and at most 5, and more for the trained head."""
    engine = make_engine(tiny_llama_dir, method=None)
    target = engine.models.target
    sequences = [Sequence(torch.tensor(p + r), target_features(engine, p + r), len(p)) for p, r in conversation]
    everything = torch.arange(target.vocab_size)
    head = new_head(target, tiny_llama_dir, engine.max_model_len, everything, seed=0)
    cfg = TrainConfig(max_steps=40, window=64, batch_tokens=512, lr=1e-3, warmup_steps=10, train_dtype="float32")
    embed = target.embed_tokens
    with one_thread():
        train(head, embed, sequences, cfg, 300.0, {})
        top1 = validate(head, embed, sequences)
        one, four = validate_chain(head, embed, sequences, depth=1), validate_chain(head, embed, sequences, depth=4)
        both = [th.chain_hits(head, embed, s.token_ids, s.features, s.num_prompt_tokens, 4) for s in sequences]
    hits, sure = torch.cat([h for h, _, _ in both]), torch.cat([p for _, _, p in both])
    # the head's softmax probability of each draft, 0 past the reply
    assert sure.shape == hits.shape and bool(((sure >= 0) & (sure <= 1)).all()) and bool((sure[:, 0] > 0).all())
    assert top1 > 0.5 and one == pytest.approx(1.0 + top1)
    assert one < four <= 5.0 and four == pytest.approx(1.0 + float(hits.float().mean(0).sum()))
    assert all(hits[:, s].sum() >= hits[:, s + 1].sum() for s in range(3))  # a draft holds only after the ones before
    # weighted as training draws sequences: a weight of 0 leaves a sequence out, equal weights change nothing
    weights = torch.tensor([0.0 if i % 2 else 3.0 for i in range(len(sequences))])
    with one_thread():
        assert validate_chain(head, embed, sequences, max_positions=math.inf, weights=weights) == pytest.approx(
            validate_chain(head, embed, sequences[::2], max_positions=math.inf))
        assert validate_chain(head, embed, sequences, weights=torch.full((len(sequences),), 2.0)) == pytest.approx(four)
    untrained = new_head(target, tiny_llama_dir, engine.max_model_len, everything, seed=0)
    with one_thread():
        untrained_top1 = validate(untrained, embed, sequences)
        assert validate_chain(untrained, embed, sequences, depth=1) == pytest.approx(1.0 + untrained_top1)
        assert validate_chain(untrained, embed, sequences) < four


def test_a_walk_verifies_where_serving_would():
    """walked_length counts tokens per verification as serving walks a reply: after a chain with a
    drafts accepted the next verification is a + 1 positions on. Five easy anchors (4 drafts each)
    then five hard ones (none) are 3 tokens a verification over every anchor, but walked the easy
    stretch is one verification of 5 tokens and the hard one five of 1: 10 / 6; k caps the drafts."""
    def hits(accepted: list[int]) -> torch.Tensor:
        return torch.arange(VAL_DEPTH)[None, :] < torch.tensor(accepted)[:, None]

    stretch = [hits([4] * 5 + [0] * 5)]
    assert th.every_anchor_length(stretch) == 3.0
    assert th.walked_length(stretch, 4) == pytest.approx(10 / 6)
    assert th.walked_length(stretch, 1) == pytest.approx(10 / 7)  # 2, 2, 2 (anchors 0, 2, 4), then 1 x 4
    assert th.walked_length([hits([0, 3, 0, 0, 1, 0])], 4) == 2.0  # 1 + 4 + 1 tokens: anchors 0, 1, 5
    assert th.walked_length([hits([1, 0]), hits([0])], 4) == pytest.approx(3 / 2)  # each reply walked from its start
    assert math.isnan(th.walked_length([], 4)) and math.isnan(th.every_anchor_length([]))
    # each reply's anchors weigh its weight: 4 drafts x 2 anchors at 3, none x 2 at 1 -> 1 + 24 / 8
    assert th.every_anchor_length([hits([4, 4]), hits([0, 0])], [3.0, 1.0]) == 4.0


def test_validation_samples_the_whole_held_out_set():
    """The held-out sequences come in the order they were collected, and validation stops at a budget
    of positions: spread_order visits them so that every prefix covers the whole set, no gap between
    the first k indices wider than 2n/k (in collection order the first k leave the last n - k out)."""
    for n in (1, 20, 99, 500):
        order = th.spread_order(n)
        assert sorted(order) == list(range(n))
        for k in range(1, n + 1):
            seen = sorted(order[:k])
            gaps = [b - a for a, b in zip([-1] + seen, seen + [n])]
            assert max(gaps) <= 2 * n / k + 1


def test_train_head_keeps_freed_memory_for_the_next_step():
    """After retain_freed_memory() a large tensor freed and allocated again comes back from the
    heap, not as fresh pages to fault in (a step's logits were ~1M page faults). In a child
    process: the test process's allocator keeps glibc's defaults, as the server does."""
    code = textwrap.dedent("""
        import resource, torch
        from chatserve.train_head import retain_freed_memory
        def faults_of_one_step():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB: over any mmap threshold
            del x
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        faults_of_one_step()
        plain = min(faults_of_one_step() for _ in range(3))
        assert retain_freed_memory()
        faults_of_one_step()
        print(plain, min(faults_of_one_step() for _ in range(3)))
    """)  # the fewest of 3: now and then one step still faults its pages in (seen ~1 in 10)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    plain, kept = map(int, out.stdout.split())
    assert plain > 8000 and kept < 500  # 64 MB is 16,384 pages of 4 KB


def test_each_run_warms_up_then_decays_its_learning_rate_over_its_budget():
    """lr_scale: linear warm-up, then a cosine from 1 to min_lr_ratio at the end of the run's
    budget, whichever of time and max_steps ends it; a resumed run (step past warm-up) starts
    again at the top."""
    from chatserve.train_head import lr_scale, run_fraction

    cfg = TrainConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_scale(cfg, 0, 0.0) == pytest.approx(0.1) and lr_scale(cfg, 9, 0.0) == pytest.approx(1.0)
    # how far a run is: by time alone, then by a resumed run's own steps (100 of 400 left) where they end it first
    assert run_fraction(cfg, 30.0, 120.0, 700, 600) == pytest.approx(0.25)
    steps_cfg = TrainConfig(max_steps=1000)
    assert run_fraction(steps_cfg, 30.0, 120.0, 700, 600) == pytest.approx(0.25)
    assert run_fraction(steps_cfg, 30.0, 120.0, 800, 600) == pytest.approx(0.5)
    assert run_fraction(steps_cfg, 90.0, 120.0, 800, 600) == pytest.approx(0.75)
    assert lr_scale(cfg, 500, 0.5) == pytest.approx(0.55) and lr_scale(cfg, 500, 1.0) == pytest.approx(0.1)
    assert lr_scale(cfg, 500, 0.0) == 1.0 and lr_scale(cfg, 500, 2.0) == pytest.approx(0.1)
    seen = []
    head = torch.nn.Linear(4, 4)
    head.lm_head = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)  # train() casts it once
    seq = [Sequence(torch.arange(40) % 7, torch.randn(40, 4), 0)]

    class Spy(torch.optim.AdamW):
        def step(self, *a, **k):
            seen.append(self.param_groups[0]["lr"])
            return super().step(*a, **k)

    def fake_loss(*a, **k):
        return (head.weight ** 2).sum(), {"loss": 1.0, "top1": 0.0}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(th.torch.optim, "AdamW", Spy)
        mp.setattr(th, "loss_fn", fake_loss)
        mp.setattr(th, "batch_windows", lambda *a, **k: ())
        state = th.train(head, None, seq, dataclasses.replace(cfg, max_steps=20, lr=1.0), 300.0, {"step": 10})
    assert state["step"] == 20 and len(seen) == 10
    assert seen[0] == pytest.approx(1.0) and seen == sorted(seen, reverse=True) and seen[-1] < 0.15


AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})


def never_measured() -> float:
    raise AssertionError("measured where the flags decide")


@pytest.mark.parametrize("flags, speedup, auto", [
    (AMX, None, torch.bfloat16), (frozenset({"avx2"}), None, torch.float32),
    (AVX512_BF16, 2.3, torch.bfloat16), (AVX512_BF16, 1.1, torch.float32), (AVX512_BF16, 0.6, torch.float32)])
def test_auto_trains_in_bf16_where_amx_or_a_measurement_says_it_is_faster(monkeypatch, flags, speedup, auto):
    """AMX: bf16 unmeasured; no AVX-512 BF16: float32 unmeasured; AVX-512 BF16 alone ran bf16 slower
    than fp32 on one Intel machine (161 against 277 GFLOP/s) and 2.3x faster on a Zen 4, so there
    the measurement decides, bf16 only from BF16_MIN_SPEEDUP up. A named dtype is taken as given."""
    monkeypatch.setattr(th, "bf16_matmul_speedup", never_measured if speedup is None else lambda: speedup)
    assert choose_train_dtype("auto", flags) == auto
    monkeypatch.setattr(th, "bf16_matmul_speedup", never_measured)
    assert choose_train_dtype("float32", flags) == torch.float32
    assert choose_train_dtype("bfloat16", flags) == torch.bfloat16
    with pytest.raises(ValueError, match="train_dtype"):
        choose_train_dtype("float16", flags)


def test_the_bf16_measurement_is_a_ratio_of_real_timings():
    """At train-head's own sizes (cached: a run pays it once): a 64 x 128 matmul took ~20 us, and one
    preemption by a neighbour made the ratio 250."""
    assert 0.05 < th.bf16_matmul_speedup() < 50


def head_and_sequences(engine, model_dir, conversation):
    target = engine.models.target
    sequences = [Sequence(torch.tensor(p + r), target_features(engine, p + r), len(p)) for p, r in conversation]
    ids = choose_vocab(sequences, target.vocab_size, 200, engine.tokenizer.special_token_ids)
    return new_head(target, model_dir, engine.max_model_len, ids, seed=0), sequences


@pytest.mark.parametrize("train_dtype, flags, speedup, autocast", [
    ("auto", AMX, None, True), ("auto", AVX512_BF16, 2.3, True), ("auto", AVX512_BF16, 0.6, False),
    ("float32", AMX, None, False), ("bfloat16", frozenset(), None, True)])
def test_the_training_step_runs_under_bf16_autocast_as_chosen(tiny_llama_dir, conversation, monkeypatch,
                                                              train_dtype, flags, speedup, autocast):
    """As choose_train_dtype says, with this CPU's bf16 measurement replaced by `speedup`."""
    engine = make_engine(tiny_llama_dir, method=None)
    head, sequences = head_and_sequences(engine, tiny_llama_dir, conversation)
    seen = []

    def spy(*a, **k):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return loss_fn(*a, **k)

    monkeypatch.setattr(th, "cpu_flags", lambda: flags)
    monkeypatch.setattr(th, "bf16_matmul_speedup", never_measured if speedup is None else lambda: speedup)
    monkeypatch.setattr(th, "loss_fn", spy)
    cfg = TrainConfig(max_steps=2, window=64, batch_tokens=128, train_dtype=train_dtype)
    with one_thread():
        train(head, engine.models.target.embed_tokens, sequences, cfg, 300.0, {})
    assert seen == [torch.bfloat16 if autocast else False] * 2


def test_a_bf16_run_learns_as_a_float32_one_and_keeps_float32_weights(tiny_llama_dir, conversation):
    """Two heads from the same init, data and steps: the one trained under bf16 autocast lowers
    the (float32) loss on fixed windows about as far, and its weights and optimizer state, the
    servable head's, stay float32."""
    engine = make_engine(tiny_llama_dir, method=None)
    embed = engine.models.target.embed_tokens
    losses, heads, states = {}, {}, {}
    for train_dtype in ("float32", "bfloat16"):
        head, sequences = head_and_sequences(engine, tiny_llama_dir, conversation)
        windows = batch_windows(sequences, 8, 64, torch.Generator().manual_seed(1))
        with torch.no_grad():
            before = loss_fn(head, embed, *windows)[1]["loss"]
        cfg = TrainConfig(max_steps=60, window=64, batch_tokens=512, lr=1e-3, warmup_steps=10, train_dtype=train_dtype)
        with one_thread():
            states[train_dtype] = train(head, embed, sequences, cfg, 300.0, {})
        with torch.no_grad():
            losses[train_dtype] = (before, loss_fn(head, embed, *windows)[1]["loss"])
        heads[train_dtype] = head
    (start, fp32), (bf16_start, bf16) = losses["float32"], losses["bfloat16"]
    assert start == bf16_start and bf16 < 0.5 * start and abs(bf16 - fp32) < 0.1 * fp32, losses
    assert {p.dtype for p in heads["bfloat16"].state_dict().values() if p.is_floating_point()} == {torch.float32}
    moments = states["bfloat16"]["optimizer"]["state"].values()
    assert {m[k].dtype for m in moments for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}


def test_a_head_can_start_as_the_targets_last_layer(tiny_llama_dir):
    """init "last-layer": the head's layer holds the target's last decoder layer's weights and fc
    passes the token's embedding through, so the head starts as that layer run on the embedding."""
    engine = make_engine(tiny_llama_dir, method=None)
    target = engine.models.target
    ids = torch.arange(100)
    head = new_head(target, tiny_llama_dir, engine.max_model_len, ids, seed=0, init="last-layer")
    last = dict(target.layers[-1].named_parameters())
    for name, param in head.layer.named_parameters():
        assert torch.equal(param, last[name].float()), name
    features, embeds = torch.randn(3, head.hidden_size), torch.randn(3, head.hidden_size)
    assert torch.allclose(head.fc(torch.cat((features, embeds), -1)), embeds)
    random = new_head(target, tiny_llama_dir, engine.max_model_len, ids, seed=0)
    assert not torch.equal(random.layer.mlp.down_proj.weight, head.layer.mlp.down_proj.weight)
    with pytest.raises(ValueError, match="init"):
        new_head(target, tiny_llama_dir, engine.max_model_len, ids, seed=0, init="zeros")


def test_unrolled_training_makes_the_second_drafted_token_better(tiny_llama_dir):
    """Two heads from the same init, data and steps, trained with unroll=1 and unroll=2: the
    second's 2nd chained prediction (from its own feature) agrees with the target more often."""
    engine = make_engine(tiny_llama_dir, method=None)
    tok, target = engine.tokenizer, engine.models.target
    texts = [tok.encode(p) for p in PROMPTS]
    texts = [p + engine.generate([p], dataclasses.replace(GREEDY, max_tokens=48))[0]["token_ids"] for p in texts]
    sequences = [Sequence(torch.tensor(ids), target_features(engine, ids), 0) for ids in texts]
    heads = {}
    for unroll in (1, 2):
        ids = choose_vocab(sequences, target.vocab_size, 200, tok.special_token_ids)
        head = new_head(target, tiny_llama_dir, engine.max_model_len, ids, seed=0)
        cfg = TrainConfig(max_steps=100, window=64, batch_tokens=512, lr=1e-3, warmup_steps=10, unroll=unroll)
        with one_thread():
            train(head, target.embed_tokens, sequences, cfg, 300.0, {})
        heads[unroll] = head
    windows = batch_windows(sequences, 16, 64, torch.Generator().manual_seed(1))
    with torch.no_grad():
        second = {u: loss_fn(h, target.embed_tokens, *windows, unroll=2)[1]["top1_1"] for u, h in heads.items()}
    assert second[2] > second[1], second


def test_feature_weight_zero_leaves_the_feature_regression_out_of_the_loss(tiny_llama_dir):
    """feature_weight scales EAGLE's feature regression: at 0 (EAGLE-3) the loss is the token
    loss's share alone, and with unrolled passes its gradient differs from the default loss's."""
    engine = make_engine(tiny_llama_dir, method=None)
    tok, target = engine.tokenizer, engine.models.target
    sequences = [Sequence(torch.tensor(ids), target_features(engine, ids), 0) for ids in map(tok.encode, PROMPTS)]
    head = new_head(target, tiny_llama_dir, engine.max_model_len,
                    choose_vocab(sequences, target.vocab_size, 200, tok.special_token_ids), seed=0)
    windows = batch_windows(sequences, 4, 16, torch.Generator().manual_seed(0))
    one = loss_fn(head, target.embed_tokens, *windows)[1]
    assert one["loss"] == pytest.approx(one["feature"] + th.CE_WEIGHT * one["token"], rel=1e-5)
    assert one["feature"] > 0.01 * one["token"]  # the regression is a real part of the default loss
    zero = loss_fn(head, target.embed_tokens, *windows, feature_weight=0.0)[1]
    assert zero["loss"] == pytest.approx(th.CE_WEIGHT * zero["token"], rel=1e-5)
    assert zero["token"] == pytest.approx(one["token"], rel=1e-6)
    head.zero_grad()
    loss_fn(head, target.embed_tokens, *windows, unroll=2, feature_weight=0.0)[0].backward()
    by_tokens = head.fc.weight.grad.clone()
    head.zero_grad()
    loss_fn(head, target.embed_tokens, *windows, unroll=2)[0].backward()
    assert not torch.allclose(head.fc.weight.grad, by_tokens)


def test_weighted_windows_draw_sequences_by_length_times_weight():
    """batch_windows(weights=...): a sequence is drawn in proportion to its length times its weight
    (weight 0: never; 3 on one of two equal lengths: ~3/4 of the windows), and weights of ones draw
    exactly the windows no weights do."""
    width, window = 2, 8
    sequences = [Sequence(torch.arange(40) + 100 * i, torch.zeros(40, width), 5) for i in range(3)]
    drawn = lambda w: batch_windows(sequences, 2000, window, torch.Generator().manual_seed(0), weights=w)[1][:, 0] // 100
    picks = drawn(torch.tensor([3.0, 1.0, 0.0]))
    assert not (picks == 2).any()
    assert 0.70 < float((picks == 0).float().mean()) < 0.80
    assert torch.equal(drawn(torch.ones(3)), drawn(None))
    with pytest.raises(ValueError, match="request-weight"):
        TrainConfig(request_weight=0)
    with pytest.raises(ValueError, match="questions-per-task"):
        TrainConfig(questions_per_task=0)


def test_sequence_kinds_and_request_weights_tell_requests_from_tasks_on_source(tiny_llama_dir, monkeypatch, tmp_path):
    """sequence_kinds reads what a sequence answered from its prompt's token ids: the shipped chat and
    code prompts and the questions the target wrote on chat / code topics are requests ("chat",
    "code requests"), a task on source is "other", a sequence without a reply "plain"; request_weights
    puts TrainConfig.request_weight on the requests and reports each kind's share."""
    import json

    from chatserve import head_data

    prompts = tmp_path / "head_prompts.json"
    prompts.write_text(json.dumps({"chat": ["Hi there"], "code": ["Write a sort"], "topics": ["bees"],
                                   "code_topics": ["SQL"]}))
    monkeypatch.setattr(head_data, "PROMPTS_FILE", prompts)
    tok = make_engine(tiny_llama_dir, method=None).tokenizer
    questions = {"bees": ["Do bees sleep?"], "SQL": ["Write a join"], "gone": ["Write a heap"]}
    asked = ["Hi there", "Write a sort", "Do bees sleep?", "Write a join", "Explain this code: x = 1", "Write a heap"]
    sequences = []
    for text in asked:
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        sequences.append(Sequence(torch.tensor(ids + [5, 6, 7]), torch.zeros(len(ids) + 3, 2), len(ids)))
    sequences.append(Sequence(torch.tensor([5, 6, 7]), torch.zeros(3, 2), 3))
    kinds = head_data.sequence_kinds(sequences, questions, tok)
    assert kinds == ["chat", "code requests", "chat", "code requests", "other", "other", "plain"]
    info = {}
    assert th.request_weights(sequences, questions, tok, 1.0, info) is None and not info
    weights = th.request_weights(sequences, questions, tok, 4.0, info)
    assert weights.tolist() == [4.0, 4.0, 4.0, 4.0, 1.0, 1.0, 1.0]
    assert sum(v["tokens"] for v in info["kind_shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert info["kind_shares"]["chat"]["drawn"] > info["kind_shares"]["chat"]["tokens"]


def test_greedy_weight_adds_the_cross_entropy_on_the_targets_top_token(tiny_llama_dir):
    """greedy_weight w adds w x -log q(the target's top token) to the token loss, the log of a greedy
    draft's acceptance, computed here from the head's own forward; at 0 the loss is the soft one."""
    engine = make_engine(tiny_llama_dir, method=None)
    tok, target = engine.tokenizer, engine.models.target
    sequences = [Sequence(torch.tensor(ids), target_features(engine, ids), 0) for ids in map(tok.encode, PROMPTS)]
    head = new_head(target, tiny_llama_dir, engine.max_model_len,
                    choose_vocab(sequences, target.vocab_size, 200, tok.special_token_ids), seed=0)
    features_in, token_ids, targets, mask = batch_windows(sequences, 4, 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = head.forward_dense(features_in, target.embed_tokens(token_ids).float())
        predicted = F.rms_norm(y, head.norm.weight.shape, head.norm.weight, head.norm.eps)[mask]
        top = F.linear(head.target_features(targets), head.lm_head.weight).argmax(-1)[mask]
        expected = float(F.cross_entropy(F.linear(predicted, head.lm_head.weight), top))
    soft = loss_fn(head, target.embed_tokens, features_in, token_ids, targets, mask, feature_weight=0.0)[1]
    both = loss_fn(head, target.embed_tokens, features_in, token_ids, targets, mask, feature_weight=0.0,
                   greedy_weight=2.0)[1]
    assert "greedy" not in soft and both["greedy"] == pytest.approx(expected, rel=1e-5)
    assert both["token"] == pytest.approx(soft["token"], rel=1e-6)
    assert both["loss"] == pytest.approx(soft["loss"] + th.CE_WEIGHT * 2.0 * expected, rel=1e-5)
    head.zero_grad()
    loss_fn(head, target.embed_tokens, features_in, token_ids, targets, mask, feature_weight=0.0)[0].backward()
    by_soft = head.fc.weight.grad.clone()
    head.zero_grad()
    loss_fn(head, target.embed_tokens, features_in, token_ids, targets, mask, feature_weight=0.0,
            greedy_weight=2.0)[0].backward()
    assert not torch.allclose(head.fc.weight.grad, by_soft)


def test_reply_only_windows_take_the_loss_over_replies_and_keep_the_prompt_as_context():
    """batch_windows(reply_only=True): a window of a prompted sequence holds at least one reply
    row, and its loss rows are exactly its reply positions (the prompt's tokens and features are
    still in it); a plain source keeps every row; without the flag, the windows are the ones
    every earlier run drew (same starts from the same generator)."""
    width, window = 3, 16
    lengths, prompts = [40, 40, 12, 30], [30, 5, 4, 30]  # the last: a plain source, no reply
    sequences = [Sequence(torch.arange(n) + 100 * i, torch.arange(n * width, dtype=torch.float).view(n, width) + i,
                          p) for i, (n, p) in enumerate(zip(lengths, prompts))]
    features_in, ids, targets, mask = batch_windows(sequences, 400, window, torch.Generator().manual_seed(0),
                                                    reply_only=True)
    assert mask.any(1).all()
    for b in range(len(ids)):
        seq = sequences[int(ids[b, 0]) // 100]
        start = int(ids[b, 0]) % 100
        w = min(window, len(seq.token_ids) - start)
        assert torch.equal(targets[b, :w], seq.features[start : start + w])  # the prompt's rows still in it
        loss_rows = torch.arange(start, start + window)
        expected = loss_rows < start + w
        if seq.num_prompt_tokens < len(seq.token_ids):
            expected &= loss_rows >= seq.num_prompt_tokens
        assert torch.equal(mask[b], expected), (b, start)
    starts = {int(ids[b, 0]) for b in range(len(ids)) if int(ids[b, 0]) // 100 == 0}
    assert min(starts) == 30 - window + 1  # sequence 0's earliest window ends at its first reply row
    plain = batch_windows(sequences, 400, window, torch.Generator().manual_seed(0))
    assert plain[3].sum() > mask.sum()  # the prompts' rows are loss rows again
    gen = torch.Generator().manual_seed(0)  # the windows earlier runs drew: the same starts
    picks = torch.multinomial(torch.tensor(lengths, dtype=torch.float), 400, replacement=True, generator=gen)
    for b, i in enumerate(picks.tolist()):
        start = int(torch.randint(max(lengths[i] - window, 0) + 1, (1,), generator=gen))
        assert int(plain[1][b, 0]) == 100 * i + start


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(one-layer target dir, head path): fc passes the token's embedding through and ignores the
    feature, the layer, norm and LM head are the target's own, so the head computes exactly the
    target's feature for every row: every greedy draft must be accepted."""
    model_dir = tmp_path_factory.mktemp("tiny_one_layer")
    from tests.tiny_models import make_tiny_model

    make_tiny_model(model_dir, "llama", seed=5, num_layers=1)
    target = make_engine(model_dir, method=None).models.target
    vocab, hidden = target.vocab_size, target.config.hidden_size
    head = EagleHead(target.config, 2048, torch.arange(vocab))
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.bias.zero_()
    head.layer.load_state_dict(target.layers[0].state_dict())
    head.norm.load_state_dict(target.norm.state_dict())
    head.lm_head.load_state_dict(target.lm_head.state_dict())
    path = model_dir / "oracle-head.pt"
    save_head(path, head, weights_hash(model_dir), {})
    return model_dir, path


def fill_with_noise(engine):
    """Head KV and block features full of noise: a row read before it is written shows."""
    runner, noise = engine.models.eagle_runner, torch.Generator().manual_seed(0)
    runner.kv_cache.pool.copy_(torch.randn(runner.kv_cache.pool.shape, generator=noise) * 30)
    runner.block_features.copy_(torch.randn(runner.block_features.shape, generator=noise) * 30)


def test_dense_forward_matches_the_paged_one(oracle, any_head, tiny_llama_dir):
    """forward_dense (training) and the paged forward (serving) are the same maths, in one prefill
    and row by row (decode-like, reading the rows before from the pool). Training feeds the raw
    features, serving what observe() made of them (input_features: a fused head's fuse)."""
    engine = make_engine(tiny_llama_dir, any_head)
    runner = engine.models.eagle_runner
    ids = engine.tokenizer.encode("Dense and paged, both ways. " * 2)
    raw = target_features(engine, ids).float()  # [T, width]
    assert raw.shape[1] == runner.head.feature_width
    features = runner.input_features(raw)  # [T, hidden]
    inputs = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])  # f_{i-1}
    raw_inputs = torch.cat([torch.zeros(1, raw.shape[1]), raw[:-1]])
    with torch.no_grad():
        embeds = engine.models.target.embed_tokens(torch.tensor(ids))
        dense = runner.head.forward_dense(raw_inputs[None], embeds[None])[0]
    blocks = list(range(-(-len(ids) // 16)))
    paged = runner.run([BatchItem(ids, 0, blocks, 0)], inputs)
    torch.testing.assert_close(paged, dense, atol=1e-4, rtol=1e-4)
    rows = torch.cat([runner.run([BatchItem([t], i, blocks, 0)], inputs[i : i + 1]) for i, t in enumerate(ids)])
    torch.testing.assert_close(rows, dense, atol=1e-4, rtol=1e-4)


def test_the_heads_layer_through_the_decode_stack_equals_its_modules(trained_head, tiny_llama_dir):
    """Rows of a drafting step run the head's layer as one C++ call (models/llama.LayerStack):
    the same numbers as the modules, bit for bit."""
    engine = make_engine(tiny_llama_dir, trained_head)
    runner = engine.models.eagle_runner
    ids = engine.tokenizer.encode("Stack and modules, the same numbers. " * 2)
    features = target_features(engine, ids).float()
    inputs = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])
    blocks = list(range(-(-len(ids) // 16)))
    runner.run([BatchItem(ids[:-3], 0, blocks, 0)], inputs[:-3])
    out = {}
    for use in (True, False):
        runner.head.stack.enabled = use
        out[use] = runner.run([BatchItem(ids[-3:], len(ids) - 3, blocks, 0)], inputs[-3:])
    assert runner.head.stack.built is not None
    assert torch.equal(out[True], out[False])


def test_the_oracle_head_has_every_draft_accepted_over_turns(oracle):
    """Greedy, fp32, on pools full of noise: output equals speculation off, every draft is
    accepted (chain drafts and bonus tokens included), turn after turn from the prefix cache."""
    model_dir, head_path = oracle
    plain = make_engine(model_dir, method=None)
    engine = make_engine(model_dir, head_path)
    fill_with_noise(engine)
    tok = engine.tokenizer
    prompt = tok.encode(HISTORY)
    for turn, question in enumerate(QUESTIONS):
        prompt = prompt + tok.encode(question)
        expected = plain.generate([prompt], GREEDY)[0]["token_ids"]
        out = engine.generate([prompt], GREEDY)[0]
        assert out["token_ids"] == expected
        assert out["stats"].num_accepted == out["stats"].num_drafted > 0
        if turn:
            assert out["stats"].cached_tokens >= (len(prompt) - 20) // 16 * 16
        prompt = prompt + out["token_ids"]
    outs = engine.generate([tok.encode(p) for p in PROMPTS], EAGLE)  # batched
    assert all(o["stats"].num_accepted == o["stats"].num_drafted > 0 for o in outs)
    assert_pool_empty(engine)


def test_adaptive_k_prices_the_heads_steps(oracle):
    """The oracle head's drafts are all accepted. With verification rows nearly free, drafts pay
    when head steps are free too; when each head step costs a whole target step, k drafts cost
    k + 1 steps for at most k + 1 tokens and the allocator drafts nothing (a probe of one draft
    every EagleMethod.probe_every steps excepted). The costs are measured at start for an engine with a head; output is
    unchanged either way."""
    from chatserve.spec_costs import SpecCosts

    model_dir, head_path = oracle
    engine = make_engine(model_dir, head_path, adaptive=True)
    # the pricing alone: the oracle is always right yet unsure (the random target's flat softmax),
    # so its chains would stop on their confidence
    engine.spec.config = dataclasses.replace(engine.spec.config, confidence_stop=False)
    measured = engine.spec.costs
    assert measured.head_seconds and all(t > 0 for t in measured.head_seconds.values())
    assert min(measured.head_seconds) == 1 and not measured.draft_seconds
    tok = engine.tokenizer
    prompt = tok.encode(HISTORY)
    params = dataclasses.replace(GREEDY, max_tokens=40)
    expected = make_engine(model_dir, method=None).generate([prompt], params)[0]["token_ids"]
    target = {r: 1.0 + 0.01 * (r - 1) for r in range(1, 65)}
    drafted = {}
    for name, head in (("free", {}), ("dear", {r: 1.0 for r in range(1, 17)})):
        engine.spec.costs = SpecCosts(target, {}, head_seconds=head)
        before = engine.spec.stats_by_method["eagle"].num_draft_tokens
        assert engine.generate([prompt], params)[0]["token_ids"] == expected
        drafted[name] = engine.spec.stats_by_method["eagle"].num_draft_tokens - before  # suffix drafts apart
    probe_every = engine.spec.methods["eagle"].probe_every
    assert drafted["free"] >= 20 and drafted["dear"] <= 40 // probe_every + 1, drafted
    assert_pool_empty(engine)


def test_each_method_probes_at_its_own_interval(tiny_llama_dir, trained_head):
    """A request's controller for a method probes after the method's probe_every steps priced out."""
    import types

    from chatserve.spec_methods.base import SpecState

    engine = make_engine(tiny_llama_dir, trained_head, adaptive=True)
    methods = engine.spec.methods
    req = types.SimpleNamespace(spec=SpecState(methods=tuple(methods.values())))
    for method in methods.values():
        controller = engine.spec._controller(req, method)
        assert controller.probe_every == method.probe_every
        for _ in range(method.probe_every - 1):
            assert not controller.probing
            controller.allocated(0)
        assert controller.probing
    methods["eagle"].probe_every = 3  # a method's own, as a benchmark's variant sets it
    req = types.SimpleNamespace(spec=SpecState(methods=tuple(methods.values())))
    assert engine.spec._controller(req, methods["eagle"]).probe_every == 3
    assert engine.spec._controller(req, methods["suffix"]).probe_every == 16


def test_each_method_weighs_a_steps_outcome_at_its_own_rate(tiny_llama_dir, trained_head):
    """A request's acceptance estimate for a method moves by the method's accept_ema: one rejected
    position takes an estimate r to r (1 - ema); the EAGLE head's moves less than a suffix proposal's."""
    import types

    from chatserve.spec_methods.base import SpecState

    engine = make_engine(tiny_llama_dir, trained_head, adaptive=True)
    methods = engine.spec.methods
    assert methods["eagle"].accept_ema < methods["suffix"].accept_ema
    req = types.SimpleNamespace(spec=SpecState(methods=tuple(methods.values())))
    for method in methods.values():
        controller = engine.spec._controller(req, method)
        start = controller.accept_rate
        assert start == pytest.approx(method.accept_rate.rate)
        controller.update(1, 0)
        assert controller.accept_rate == pytest.approx(start * (1 - method.accept_ema))


def test_the_heads_served_steps_reprice_its_start_up_table(oracle, monkeypatch):
    """propose times each draft position (the head's step with its drafting glue) and the engine's
    head table follows them, as the target's follows its forwards: a head timed at start-up as
    nearly free, then slowed by 30 ms a step, is priced at >= 30 ms once its steps are seen, and
    the allocator stops buying its drafts. Costs set by hand stay as set."""
    from chatserve import spec_costs
    from chatserve.spec_costs import ObservedForwards

    measure = spec_costs.measure_spec_costs

    def nearly_free_head(*args, **kwargs):
        costs = measure(*args, **kwargs)
        return dataclasses.replace(costs, head_seconds={r: t / 100 for r, t in costs.head_seconds.items()})

    monkeypatch.setattr(spec_costs, "measure_spec_costs", nearly_free_head)
    model_dir, head_path = oracle
    engine = make_engine(model_dir, head_path, adaptive=True)
    engine.spec.config = dataclasses.replace(engine.spec.config, confidence_stop=False)  # see above
    measured = engine.spec.costs
    prompt = engine.tokenizer.encode(HISTORY)
    runner = engine.spec.methods["eagle"].runner
    engine.spec.methods["eagle"].chain_in_cpp = False  # the modules' chain, each of whose forwards is slowed below
    run = runner.run
    timed = []
    observe = engine.spec.step_observers["head"].observe
    engine.spec.step_observers["head"].observe = lambda rows, seconds: (timed.append(rows), observe(rows, seconds))[1]
    runner.run = lambda *a, **kw: (time.sleep(0.03), run(*a, **kw))[1]
    params = dataclasses.replace(GREEDY, max_tokens=48)
    engine.generate([prompt], params)
    assert len(timed) >= ObservedForwards.MIN_SEEN and set(timed) == {1}
    assert sorted(engine.spec.costs.head_seconds) == sorted(measured.head_seconds)
    assert engine.spec.costs.head(1) >= 0.03 > measured.head(1)
    assert engine.spec.costs.target_seconds.keys() == measured.target_seconds.keys()
    before = engine.spec.stats_by_method["eagle"].num_draft_tokens
    engine.generate([prompt], params)
    # a draft now costs 30 ms beside a few-ms target step: only the probes draft (one in probe_every steps)
    probe_every = engine.spec.methods["eagle"].probe_every
    assert engine.spec.stats_by_method["eagle"].num_draft_tokens - before <= 48 // probe_every + 1
    by_hand = dataclasses.replace(measured)
    engine.spec.costs = by_hand
    engine.generate([prompt], dataclasses.replace(GREEDY, max_tokens=8))
    assert engine.spec.costs is by_hand
    assert_pool_empty(engine)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_is_equal_over_turns(tiny_llama_dir, any_head, conversation, adaptive):
    from tests.chatserve.test_long_context import FIXED_COSTS

    engine = make_engine(tiny_llama_dir, any_head, adaptive=adaptive)
    if adaptive:
        engine.spec.costs = FIXED_COSTS  # the tiny model's measured costs are noise on a busy machine
        # chains run to their k: stopped on the tiny head's confidence, the few drafts kept are all
        # accepted (test_a_greedy_chain_stops_... holds output equal with the stop)
        engine.spec.config = dataclasses.replace(engine.spec.config, confidence_stop=False)
    outs = []
    for turn, (prompt, expected) in enumerate(conversation):
        outs.append(engine.generate([prompt], GREEDY)[0])
        assert outs[-1]["token_ids"] == expected
        if turn:
            assert outs[-1]["stats"].cached_tokens >= len(conversation[turn - 1][0]) // 16 * 16
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = make_engine(tiny_llama_dir, method=None)
    outs += engine.generate(prompts, GREEDY)  # batched
    assert [o["token_ids"] for o in outs[3:]] == [o["token_ids"] for o in plain.generate(prompts, GREEDY)]
    drafted, accepted = (sum(getattr(o["stats"], name) for o in outs) for name in ("num_drafted", "num_accepted"))
    assert drafted > accepted > 0  # both sides of verification
    assert_pool_empty(engine)


def test_a_chains_confidence_is_the_softmax_probability_of_the_heads_argmax():
    from chatserve.spec_methods.eagle import _top_probs
    from spec.sampling import argmax_rows

    logits = torch.randn(3, 4111, generator=torch.Generator().manual_seed(0)) * 4
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the same probability either way
    best = argmax_rows(logits)
    want = logits.softmax(-1)[torch.arange(3), best]
    assert _top_probs(logits) == pytest.approx(want.tolist(), rel=1e-6)


def test_a_greedy_chain_keeps_and_goes_on_while_the_heads_probability_of_it_pays(
        tiny_llama_dir, trained_head, monkeypatch):
    """Adaptive greedy drafting keeps each draft of a chain while the head's probability of the
    whole chain (the product of its softmax probabilities of each draft) is at least `keep` (a
    verification row's price), and computes the next while it is at least `go_on` (a row and a
    head step, over the made drafts' acceptance: chain_stop_gains, set here): a chain is cut at
    the first draft below keep (its head step spent), or stops after the first kept one below
    go_on. At 0 every chain runs to its k; above 1 nothing is drafted, for a sampled request
    too, and the stops count as rejections in the acceptance rate that prices the drafts; with
    SpecConfig.confidence_stop off every chain runs to its k. Greedy output equals speculation
    off throughout (test_sampled_tokens_follow_the_target: sampled output follows the target
    with chains stopped)."""
    import chatserve.spec_methods.eagle as eagle_module
    import chatserve.spec_runner as spec_runner
    from chatserve.spec_costs import SpecCosts
    from spec.adaptive import AcceptanceEMA

    engine = make_engine(tiny_llama_dir, trained_head, adaptive=True)
    engine.spec.keeps_computed_drafts = True  # two prices (the default prices both as one: below)
    engine.spec.costs = SpecCosts({r: 1.0 + 0.01 * (r - 1) for r in range(1, 65)}, {},
                                  head_seconds={r: 0.01 for r in range(1, 17)})
    method = engine.spec.methods["eagle"]
    method.chain_in_cpp = False  # the modules' chain, whose probabilities _top_probs gives (the C++ one: below)
    engine.spec.methods["suffix"].corpus = None  # the prompts come back under each price: no earlier replies to offer
    calls, probs = [], []
    top_probs, propose = eagle_module._top_probs, method.propose

    def recorded_top_probs(logits):
        probs[-1].append(top_probs(logits))
        return probs[-1][-1]

    def recorded_propose(reqs, ks):
        probs.append([])
        propose(reqs, ks)
        calls.append((ks, [len(r.draft_token_ids) for r in reqs], [r.params.is_greedy for r in reqs],
                      [(r.spec.keep_gain, r.spec.least_gain) for r in reqs]))

    monkeypatch.setattr(eagle_module, "_top_probs", recorded_top_probs)
    monkeypatch.setattr(method, "propose", recorded_propose)
    plain = make_engine(tiny_llama_dir, method=None)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = [o["token_ids"] for o in plain.generate(prompts, GREEDY)]
    drafted, firsts = {}, []
    for keep, go_on in ((0.0, 0.0), (1e-9, 1e-9), ("median", "median"), ("median / 4", "median"), (1.01, 1.01)):
        if go_on == "median":  # of the first drafts' probabilities: some chains cut there, some go on
            median = float(torch.tensor(firsts).median())
            keep, go_on = (median / 4 if keep == "median / 4" else median), median
        monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *args, gains=(keep, go_on): gains)
        calls.clear()
        probs.clear()
        # each price as new: the head's rejections under the last one would price its requests out
        method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)
        rate_before = method.accept_rate.rate
        for prompt, want in zip(prompts, expected):  # one at a time: a call's probabilities are one chain's
            assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want
        drafted[keep, go_on] = [(k, d) for ks, ds, _, _ in calls for k, d in zip(ks, ds)]
        assert all(gains == [(keep, go_on)] for _, _, _, gains in calls)
        cut = stopped = 0
        for (ks, (d,), _, _), chain in zip(calls, probs):
            if go_on == 0.0:
                assert chain == [] and d == ks[0]  # never asked
                continue
            product = torch.tensor([p for (p,) in chain]).cumprod(0)
            assert bool((product[:d] >= keep).all()) and bool((product[: d - 1] >= go_on).all())
            if len(chain) == d + 1:  # the last head step's draft was cut
                assert float(product[d]) < keep
                cut += 1
            else:  # it ran to its k, or stopped going on after a kept draft
                assert len(chain) == d and (d == ks[0] or float(product[d - 1]) < go_on)
                stopped += d < ks[0]
        if keep == 1e-9:
            firsts = [chain[0][0] for chain in probs]
            assert all(d == k for k, d in drafted[keep, go_on])
        elif 0 < keep < 1:
            assert cut + stopped > 0 and sum(d for _, d in drafted[keep, go_on]) > 0, drafted[keep, go_on]
            if keep < go_on:  # drafts between the two prices are kept, and their chains stop there
                assert stopped > 0
    assert all(d == 0 for _, d in drafted[1.01, 1.01]) and len(drafted[1.01, 1.01]) > 0
    # a chain stopped before its first draft counts as rejected there in the rate that prices drafts
    assert method.accept_rate.rate < rate_before
    engine.spec.keeps_computed_drafts = False  # one price: the go-on price keeps a draft too
    monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *args: (0.2, 0.5))
    method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)
    calls.clear()
    engine.generate([engine.tokenizer.encode(PROMPTS[5])], GREEDY)  # no earlier reply for suffix decoding
    assert calls and all(gains == [(0.5, 0.5)] for *_, gains in calls)
    monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *args: (1.01, 1.01))
    sampled = dataclasses.replace(GREEDY, temperature=0.8)  # stops the same way (still at 1.01)
    method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)  # as new: priced to draft again
    calls.clear()
    engine.generate(prompts[:1], sampled)
    assert calls and all(d == 0 and greedy == [False] for ks, (d,), greedy, _ in calls)
    engine.spec.config = dataclasses.replace(engine.spec.config, confidence_stop=False)  # the switch
    method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)
    calls.clear()
    fresh = engine.tokenizer.encode(PROMPTS[4])  # no earlier reply for suffix decoding to offer instead
    assert engine.generate([fresh], GREEDY)[0]["token_ids"] == plain.generate([fresh], GREEDY)[0]["token_ids"]
    assert calls and all(d == ks[0] and gains == [(0.0, 0.0)] for ks, (d,), _, gains in calls)
    assert_pool_empty(engine)


def test_the_stop_power_is_fitted_to_how_often_chains_are_accepted():
    """fit_stop_power finds the a with which P ** a is a chain's chance of acceptance: chains drawn
    accepted with probability P ** 0.6 (an underconfident head) fit ~0.6, with P ** 1.3 ~1.3; no
    chains, 1.0 (P read as it is). Positions past a reply's end (sure 0) are left out."""
    from chatserve.train_head import fit_stop_power

    gen = torch.Generator().manual_seed(0)
    for power in (0.6, 1.3):
        chains = []
        for _ in range(40):
            sure = torch.rand(50, 4, generator=gen) * 0.9 + 0.1
            sure[-3:, 2:] = 0.0  # past the end
            chance = sure.cumprod(dim=1) ** power
            right = torch.rand(50, 4, generator=gen) < chance
            chains.append((right, sure))
        assert fit_stop_power(chains) == pytest.approx(power, abs=0.06)
    assert fit_stop_power([]) == 1.0


def test_a_greedy_chains_stop_reads_its_probability_through_the_heads_power(tiny_llama_dir, trained_head,
                                                                            monkeypatch, tmp_path):
    """At T = 0 a chain stops where P ** greedy_stop_power (with SpecConfig.calibrated_stop the
    head's saved fit, else 1.0) falls below the price, i.e. at P below price ** (1 / power): an underconfident head's (power
    below 1) chains go on longer at the same prices, greedy output still equal to speculation off;
    a sampled chain reads P as it is, and a request with a grammar never stops early."""
    from types import SimpleNamespace

    import chatserve.spec_runner as spec_runner
    from chatserve.sampling_params import SamplingParams
    from chatserve.spec_costs import SpecCosts
    from spec.adaptive import AcceptanceEMA

    fitted = tmp_path / "fitted-head.pt"  # the trained head with a fit in its info, as train-head saves one
    record = torch.load(trained_head, weights_only=True)
    record["info"]["greedy_stop_power"] = 0.5
    torch.save(record, fitted)
    for calibrated, power in ((False, 1.0), (True, 0.5)):
        spec = SpecConfig(method="eagle", eagle_head=str(fitted), calibrated_stop=calibrated)
        loaded = Engine(EngineConfig(model=str(tiny_llama_dir), spec=spec, kv_cache_memory=8 << 20))
        assert loaded.spec.methods["eagle"].greedy_stop_power == power
    engine = make_engine(tiny_llama_dir, trained_head, adaptive=True, stall_limit=0)
    method = engine.spec.methods["eagle"]
    assert method.greedy_stop_power == 1.0  # a head without a fit: P as it is
    # this head's drafts have probabilities ~0.02 (~0.0004 for two): chains stop at the first to third
    monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *args: (4.5e-4, 4.5e-4))
    engine.spec.costs = SpecCosts({r: 1.0 + 0.01 * (r - 1) for r in range(1, 65)}, {},
                                  head_seconds={r: 0.01 for r in range(1, 17)})
    engine.spec.gap_limit = 0
    del engine.spec.methods["suffix"]  # the head's chains alone
    plain = make_engine(tiny_llama_dir, method=None)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = [o["token_ids"] for o in plain.generate(prompts, GREEDY)]
    drafted, propose = [], method.propose

    def recorded(reqs, ks):
        timed = propose(reqs, ks)
        drafted.append((list(ks), [len(r.draft_token_ids) for r in reqs]))
        return timed

    monkeypatch.setattr(method, "propose", recorded)
    made = {}
    for power in (1.0, 0.5):
        method.greedy_stop_power = power
        method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)
        drafted.clear()
        for prompt, want in zip(prompts, expected):
            assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want
        made[power] = sum(sum(ds) for _, ds in drafted) / len(drafted)  # drafts a drafting step
        assert drafted
    assert made[0.5] > made[1.0]
    greedy = SimpleNamespace(grammar=None, params=GREEDY)
    sampled = SimpleNamespace(grammar=None, params=SamplingParams(temperature=0.8, max_tokens=8))
    with_grammar = SimpleNamespace(grammar=object(), params=GREEDY)
    assert method._stop_below(greedy, 0.09) == pytest.approx(0.09 ** 2)
    assert method._stop_below(sampled, 0.09) == 0.09 and method._stop_below(with_grammar, 0.09) == 0.0
    assert method._stop_below(greedy, 0.0) == 0.0
    assert_pool_empty(engine)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_greedy_chain_in_one_cpp_call_drafts_as_the_modules_do(tiny_llama_dir, trained_head, monkeypatch,
                                                                 quantization):
    """DecodeStack.draft_chain (HeadRunner.greedy_chain) drafts what propose's loop over the modules
    drafts: the same tokens, cut and stopped at the same places, over turns, batches with deferred
    rows, and prices that stop some chains; the steps it times are the ones it ran. Float32 (the
    embedding's rows as they are) and int4 (int8 embedding rows, an int4 fc and kept LM head, where
    the target's LM head stays int8)."""
    import chatserve.spec_runner as spec_runner
    from chatserve.spec_costs import SpecCosts

    # this head's drafts have probabilities ~0.02 (~0.0004 for two): chains cut and stopped at the first to third
    monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *args: (3e-4, 4.5e-4))
    runs = {}
    for in_cpp in (True, False):
        engine = make_engine(tiny_llama_dir, trained_head, adaptive=True, stall_limit=0, quantization=quantization)
        if quantization:
            assert type(engine.models.eagle_runner.head.lm_head).__name__ == "Int4Linear"
            assert type(engine.models.target.lm_head).__name__ == "Int8Linear"
        engine.spec.costs = SpecCosts({r: 1.0 + 0.01 * (r - 1) for r in range(1, 65)}, {},
                                      head_seconds={r: 0.01 for r in range(1, 17)})  # by hand, and
        engine.spec.gap_limit = 0  # no gap limit: no timing decides what is drafted
        method, runner = engine.spec.methods["eagle"], engine.models.eagle_runner
        engine.spec.keeps_computed_drafts = True  # both prices
        method.chain_in_cpp = in_cpp
        calls, chains, propose, greedy_chain = [], [], method.propose, runner.greedy_chain

        def recorded_propose(reqs, ks, propose=propose, calls=calls):
            timed = propose(reqs, ks)
            calls.append((list(ks), [list(r.draft_token_ids) for r in reqs]))
            return timed

        def recorded_chain(*args, greedy_chain=greedy_chain, chains=chains):
            chains.append(greedy_chain(*args))
            return chains[-1]

        monkeypatch.setattr(method, "propose", recorded_propose)
        monkeypatch.setattr(runner, "greedy_chain", recorded_chain)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        outs = [o["token_ids"] for o in engine.generate(prompts[:3], GREEDY)]  # a batch of three
        outs += [o["token_ids"] for o in engine.generate(prompts[3:], dataclasses.replace(GREEDY, max_tokens=40))]
        runs[in_cpp] = outs, calls, chains
        assert_pool_empty(engine)
    (outs, calls, chains), (ref_outs, ref_calls, ref_chains) = runs[True], runs[False]
    assert outs == ref_outs and calls == ref_calls
    assert ref_chains == [] and len(chains) == len(calls) and all(c is not None for c in chains)
    assert any(len(ks) > 1 for ks, _ in calls) and any(0 < len(d) < k for ks, ds in calls for k, d in zip(ks, ds))
    for (ks, drafts), (chain_drafts, timed) in zip(calls, chains):
        assert chain_drafts == drafts
        ran = [rows for rows, _ in timed]  # a forward for every request at the first position, then those going on
        assert ran[0] == len(ks) and ran == sorted(ran, reverse=True) and all(s > 0 for _, s in timed)
        assert len(ran) <= max(ks) and sum(ran) >= sum(len(d) for d in drafts)


def test_a_chain_goes_on_at_a_row_and_a_step_over_the_made_drafts_acceptance(tiny_llama_dir, trained_head):
    """The prices a drafting request's chain stops at are chain_stop_gains' for its step, with the
    share of the head's drafts made so far that were accepted (1.0 before 32 were made): keep is
    a row's price, go_on a row's and a head step's over that share."""
    from chatserve.spec_costs import SpecCosts
    from spec.adaptive import chain_stop_gains

    engine = make_engine(tiny_llama_dir, trained_head, adaptive=True)
    engine.spec.keeps_computed_drafts = True
    costs = SpecCosts({r: 1.0 + 0.01 * (r - 1) for r in range(1, 65)}, {}, head_seconds={r: 0.01 for r in range(1, 17)})
    engine.spec.costs = costs
    method = engine.spec.methods["eagle"]
    del engine.spec.methods["suffix"]  # the head's prices alone: the tiny model's loops would go to suffix proposals
    seen, propose = [], method.propose
    method.propose = lambda reqs, ks: (seen.append((ks[0], engine.spec.stats_by_method["eagle"].num_draft_tokens,
                                                    engine.spec.stats_by_method["eagle"].num_accepted_tokens,
                                                    reqs[0].spec.keep_gain, reqs[0].spec.least_gain)),
                                       propose(reqs, ks))[1]
    for prompt in PROMPTS:
        engine.generate([engine.tokenizer.encode(prompt)], dataclasses.replace(GREEDY, max_tokens=48))
    assert any(made < 32 for _, made, _, _, _ in seen) and any(made >= 32 for _, made, _, _, _ in seen)
    for k, made, accepted, keep, go_on in seen:
        rate = accepted / made if made >= 32 else 1.0
        assert (keep, go_on) == pytest.approx(chain_stop_gains(costs.target, costs.head, 1, k, rate))
    assert_pool_empty(engine)


def test_an_eagle_request_takes_suffix_proposals_and_stays_equal(tiny_llama_dir, trained_head, conversation):
    """Code repeated back: an EAGLE request also drafts from suffix decoding's matches (mixed in as a
    draft-model request's are) when they promise more than the head, over turns from the prefix
    cache, with output equal to speculation off; the head's rows stay right around the suffix
    steps (it drafts and is accepted between them). The head here was trained on these very
    replies, so its measured rate starts low (0.2) for the suffix matches to promise more."""
    from spec.adaptive import AcceptanceEMA

    engine = make_engine(tiny_llama_dir, trained_head)
    engine.spec.methods["eagle"].accept_rate = AcceptanceEMA(ema=0.05, prior=0.2)
    for prompt, expected in conversation:
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == expected
    by_method = engine.spec.stats_by_method
    assert by_method["suffix"].num_draft_tokens > 0 and by_method["suffix"].num_accepted_tokens > 0
    assert by_method["eagle"].num_accepted_tokens > 0
    assert_pool_empty(engine)


def head_kv_by_position(engine, prompt, params) -> torch.Tensor:
    """Run one request; -> the head's K at positions [0, num_computed_tokens) read back from
    the pool through the request's block table, [positions, num_kv_heads, head_dim]."""
    rid = engine.add_request(prompt, params)
    req, blocks = engine.requests[rid], []
    while engine.has_unfinished():
        blocks, computed = list(req.table.block_ids), req.num_computed_tokens
        engine.step()
    num = min(computed, len(prompt))
    k_cache = engine.models.eagle_runner.kv_cache.layers[0].k_cache  # [num_blocks, block_size, Hkv, D]
    return torch.stack([k_cache[blocks[p // 16], p % 16] for p in range(num)])


def test_head_kv_from_the_prefix_cache_equals_a_cold_run(tiny_llama_dir, any_head, conversation):
    """The second turn starts at a block boundary inside the first turn's blocks: its first row
    reads the cached block's last feature. Every head row of its prompt must equal a cold
    engine's (prefix cache off), and so must the drafts."""
    (prompt1, reply1), (prompt2, _) = conversation[:2]
    warm = make_engine(tiny_llama_dir, any_head)
    fill_with_noise(warm)
    warm.generate([prompt1], GREEDY)
    cold = make_engine(tiny_llama_dir, any_head, enable_prefix_caching=False)
    params = dataclasses.replace(GREEDY, max_tokens=8)
    cached_kv, cold_kv = head_kv_by_position(warm, prompt2, params), head_kv_by_position(cold, prompt2, params)
    torch.testing.assert_close(cached_kv, cold_kv, atol=1e-4, rtol=1e-4)
    assert len(cached_kv) == len(prompt2)
    assert_pool_empty(warm)


def test_a_decode_step_that_drafts_and_writes_nothing_makes_no_head_input(tiny_llama_dir, trained_head,
                                                                           conversation):
    """The head's input of a raw feature (HeadRunner.input_features: an EAGLE-3 head's fuse, whose
    weights a step reads cold) is made where it is read: a request that never drafts keeps its
    deferred decode rows raw, so only the steps that write them (every FLUSH_ROWS) or complete a
    block make any (the KV those rows write: the tests around this one)."""
    from chatserve.spec_methods.eagle import FLUSH_ROWS

    engine = make_engine(tiny_llama_dir, trained_head)
    runner = engine.models.eagle_runner
    made, input_features = [], runner.input_features
    runner.input_features = lambda raw: (made.append(len(raw)), input_features(raw))[1]
    rid = engine.add_request(conversation[0][0], dataclasses.replace(GREEDY, max_tokens=64, num_draft_tokens=0))
    req, steps, making = engine.requests[rid], 0, 0
    while engine.has_unfinished():
        decoding, before = req.num_output_tokens > 0, len(made)
        engine.step()
        steps, making = steps + decoding, making + (decoding and len(made) > before)
    assert steps >= 60 and 0 < making <= 2 * (steps // min(FLUSH_ROWS, 16) + 1), (steps, making)
    assert_pool_empty(engine)


def test_head_rows_deferred_by_an_aborted_request_are_written(tiny_llama_dir, trained_head, conversation):
    """A request that does not draft defers its decode rows (fewer than FLUSH_ROWS here); aborted,
    it writes them while it still holds its blocks, so a next turn over its committed blocks
    reads the same head KV as a cold engine."""
    prompt1 = conversation[0][0]
    warm = make_engine(tiny_llama_dir, trained_head)
    fill_with_noise(warm)
    rid = warm.add_request(prompt1, dataclasses.replace(GREEDY, num_draft_tokens=0))
    req = warm.requests[rid]
    while req.num_output_tokens < 14:
        warm.step()
    assert req.head_pending is not None and req.num_computed_tokens // 16 > len(prompt1) // 16  # a committed block waits
    warm.abort(rid)
    prompt2 = req.token_ids + warm.tokenizer.encode(QUESTIONS[1])
    cold = make_engine(tiny_llama_dir, trained_head, enable_prefix_caching=False)
    params = dataclasses.replace(GREEDY, max_tokens=4)
    cached_kv, cold_kv = head_kv_by_position(warm, prompt2, params), head_kv_by_position(cold, prompt2, params)
    torch.testing.assert_close(cached_kv, cold_kv, atol=1e-4, rtol=1e-4)
    assert_pool_empty(warm)


@pytest.mark.parametrize("stop", [False, True])
def test_sampled_tokens_follow_the_target(tiny_llama_dir, trained_head, monkeypatch, stop):
    """T = 0.5, 2000 requests of one prompt, 3 tokens each: the first from the prefill, the second
    from verifying one draft sampled from the head. The second must follow the target's marginal
    sum_t1 P(t1) P(t2 | t1) (transformers computes it), drafts accepted and rejected both. Seeded
    with a fixed k; or (stop) adaptive, unseeded, each chain stopped on the head's probability
    at about its median: some chains are cut, and still the target's distribution."""
    from transformers import AutoModelForCausalLM

    import chatserve.spec_methods.eagle as eagle_module
    import chatserve.spec_runner as spec_runner
    from chatserve.spec_costs import SpecCosts

    temperature, n = 0.5, 2000
    engine = make_engine(tiny_llama_dir, trained_head, adaptive=stop)
    if stop:  # rows and head steps nearly free: priced to draft even as the stops pull the rate down
        engine.spec.costs = SpecCosts({r: 1.0 + 0.001 * (r - 1) for r in range(1, 65)}, {})
        seen, top_probs = [], eagle_module._top_probs
        monkeypatch.setattr(eagle_module, "_top_probs",
                            lambda logits: seen.extend(top_probs(logits)) or seen[-len(logits):])
        monkeypatch.setattr(spec_runner, "chain_stop_gains", lambda *a: (median, median))
        median = 1e-12  # every draft kept, its probability seen
        # and no floor on the rate: a request lives two steps (no probe), so once the engine-wide rate fell
        # below the default 0.1 every later request started below it and drafted nothing (4% drafted, 1 run in ~8)
        monkeypatch.setattr(spec_runner, "AdaptiveDraftLength",
                            functools.partial(spec_runner.AdaptiveDraftLength, min_accept_rate=0.0))
    prompt = engine.tokenizer.encode(PROMPTS[3])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    vocab = engine.models.vocab_size
    with torch.no_grad():
        first_probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)  # [vocab]
        seconds = torch.tensor([prompt + [t] for t in range(vocab)])  # [vocab, len(prompt) + 1]
        second_probs = torch.softmax(hf(seconds).logits[:, -1].double() / temperature, -1)  # [vocab, vocab]
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=None if stop else seed, ignore_eos=True)
              for seed in range(n)]
    with one_thread():
        if stop:  # the head's probabilities of its first draft here, then stopped at their median
            engine.generate([prompt] * 50, params[:50])
            median = float(torch.tensor(seen).median())
            seen.clear()
        outs = engine.generate([prompt] * n, params)
    assert all(len(o["token_ids"]) == 3 for o in outs)
    drafted = sum(o["stats"].num_drafted for o in outs) / n
    if stop:  # chains cut (a head step, no draft) and chains kept, enough of them to test
        assert len(seen) > drafted * n > 0.05 * n, (len(seen), drafted)
    else:
        assert drafted == 1
    p_value = chi_square_p_value(torch.tensor([o["token_ids"][1] for o in outs]), first_probs @ second_probs)
    assert p_value > 1e-6, p_value
    accepted = sum(o["stats"].num_accepted for o in outs) / n / drafted
    assert 0.1 < accepted < 0.95, accepted
    assert_pool_empty(engine)


def test_pool_stays_whole_with_drafts_rollbacks_preemption_and_aborts(tiny_llama_dir, any_head):
    """EAGLE, suffix, n-gram and plain requests, greedy and sampled, in a pool small enough to
    preempt, with random aborts: the block manager's invariants hold after every step, and
    every block comes back."""
    probe = make_engine(tiny_llama_dir, any_head)
    runner = probe.models.eagle_runner
    per_block = (probe.models.target_runner.kv_cache.num_bytes + runner.num_bytes) // probe.block_manager.num_blocks
    # stall_limit 0: prompt chunks sized by the token budget alone, not by step times measured
    # on a machine that may be busy, so the schedule (and its preemptions) is the same every run
    engine = make_engine(tiny_llama_dir, any_head, kv_cache_memory=24 * per_block, stall_limit=0)
    assert engine.block_manager.num_blocks == 24
    methods = [{"spec_method": "eagle"}, {"spec_method": "suffix"}, {"spec_method": "eagle"}, {"num_draft_tokens": 0},
               {"spec_method": "ngram"}]
    run_with_random_aborts(engine, methods, 15)
    assert engine.scheduler.num_preemptions > 0
    stats = engine.spec.stats_by_method["eagle"]
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert_pool_empty(engine)


def test_the_weight_hash_memo_forgets_models_that_are_gone(tmp_path, monkeypatch):
    """weights_hash() memoizes by path; a model directory removed (a test's temporary one) leaves
    the memo when the next hash is written, so the file does not grow with every run."""
    import json
    import shutil

    from chatserve.head_store import heads_dir
    from tests.tiny_models import make_tiny_model

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a", tmp_path / "b"
    for d, seed in ((first, 1), (second, 2)):
        make_tiny_model(d, "llama", seed=seed, num_layers=1)
    hash_a = weights_hash(first)
    assert weights_hash(first) == hash_a != weights_hash(second)
    memo = json.loads((heads_dir() / "weight_hashes.json").read_text())
    assert sorted(memo.values()) == sorted([hash_a, weights_hash(second)])
    shutil.rmtree(first)
    make_tiny_model(tmp_path / "c", "llama", seed=3, num_layers=1)
    weights_hash(tmp_path / "c")
    memo = json.loads((heads_dir() / "weight_hashes.json").read_text())
    assert len(memo) == 2 and hash_a not in memo.values() and all(str(first) not in k for k in memo)


def test_a_head_for_other_weights_is_refused(tiny_llama_dir, tiny_draft_dir, trained_head, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="trained for other weights.*chatserve train-head --model"):
        make_engine(tiny_draft_dir, trained_head)
    with pytest.raises(ValueError, match="no EAGLE head for .*chatserve train-head --model"):
        make_engine(tiny_draft_dir)  # none in the cache for these weights
    engine = make_engine(tiny_llama_dir, method="ngram")
    with pytest.raises(ValueError, match="spec_method: 'eagle' needs an EAGLE head"):
        engine.add_request([1, 2, 3], EAGLE)


def test_train_head_command_saves_by_weight_hash_and_resumes(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`chatserve train-head` on the tiny model: data (its own replies + stdlib source), a few
    steps, the head in the cache under the weights' hash, where `--draft eagle` finds it; run
    again, it continues from the checkpoint."""
    from chatserve.cli import main
    from chatserve.head_store import default_head_path

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path))
    args = ["train-head", "--model", str(tiny_llama_dir), "--dtype", "float32", "-q", "none",
            "--reply-tokens", "16", "--head-vocab-size", "100", "--minutes", "5",  # max-steps ends it
            "--min-free-gb", "0"]  # whatever this disk has free
    assert main([*args, "--max-data-tokens", "600", "--max-steps", "2", "--train-dtype", "float32"]) == 0
    # the progress bar counts the run by whichever budget ends it: done at 2 steps, long before 5 minutes
    assert "training: 100%" in capsys.readouterr().err.replace("\r", "\n")
    args.append("--quiet")
    path = default_head_path(weights_hash(tiny_llama_dir))
    first = torch.load(path, weights_only=True)
    assert first["info"]["steps"] == 2 and first["info"]["num_kept"] >= 100
    assert first["info"]["train_dtype"] == "float32"
    assert first["info"]["num_tokens"] >= 600  # one round: 16 replies and a source piece
    # a new head reads EAGLE-3's features by default (both layers of this 2-layer target), the data
    # holds them beside the final feature
    assert first["feature_layers"] == [0, 1] == first["info"]["feature_layers"]
    saved = load_collected(path.with_name("eagle-head-data.pt"), weights_hash(tiny_llama_dir))
    assert saved.feature_layers == (0, 1) and saved.sequences[0].features.shape[1] == 3 * 64
    # resuming it on other features is refused, data and checkpoint kept
    assert main([*args, "--feature-layers", "final", "--max-steps", "3"]) == 2
    # run again with a larger data budget: more data first (the saved data kept), then the checkpoint goes on
    more = first["info"]["num_tokens"] + 1
    assert main([*args, "--max-data-tokens", str(more), "--max-steps", "4"]) == 0
    data = load_collected(path.with_name("eagle-head-data.pt"), weights_hash(tiny_llama_dir))
    assert data.rounds == 2 and data.num_tokens >= more
    # the resumed head took the vocabulary of the grown training data, with the target's rows
    ckpt = torch.load(path.with_name("eagle-head-checkpoint.pt"), weights_only=True)["head"]
    train_seqs, _ = split_validation(data.sequences)
    engine = make_engine(tiny_llama_dir, method=None)
    ids = choose_vocab(train_seqs, engine.models.target.vocab_size, 100, engine.tokenizer.special_token_ids)
    assert torch.equal(ckpt["head_token_ids"], ids)
    assert torch.equal(ckpt["lm_head.weight"], engine.models.target.lm_head.weight[ids].float())
    # 32 replies now, one held out: the run validated, and kept on disk whichever head scored best
    second = torch.load(path, weights_only=True)["info"]
    assert second["last_steps"] == 4 and 0.0 <= second["last_val_top1"] <= 1.0
    assert 1.0 <= second["last_val_accepted"] <= 1.0 + VAL_DEPTH and 1.0 <= second["last_val_walked"] <= 1.0 + VAL_DEPTH
    assert 0.2 <= second["greedy_stop_power"] <= 2.0  # fitted on the held-out reply, served by its greedy chains
    assert "greedy_stop_power" not in first  # nothing held out: nothing to fit on
    # a checkpoint from before the walked length (its state holds val_accepted alone) resumes with the bar shown
    ckpt_path = path.with_name("eagle-head-checkpoint.pt")
    old = torch.load(ckpt_path, weights_only=True)
    del old["state"]["val_walked"]
    torch.save(old, ckpt_path)
    capsys.readouterr()
    assert main([a for a in args if a != "--quiet"] + ["--data-share", "0", "--max-steps", "5"]) == 0
    assert "val_len=" in capsys.readouterr().err
    # resumed without --head-vocab-size: the head keeps its size (not the default's 32768)
    no_size = [a for a in args if a not in ("--head-vocab-size", "100")]
    # (and in windows of another size, at another lr, the loss over replies, with the greedy term, requests drawn
    # and validated 3x: the flags reach the training loop)
    assert main([*no_size, "--data-share", "0", "--max-steps", "6", "--window", "24", "--batch-tokens", "72",
                 "--lr", "1e-3", "--loss-rows", "replies", "--greedy-weight", "0.5", "--request-weight", "3"]) == 0
    resumed = torch.load(path.with_name("eagle-head-checkpoint.pt"), weights_only=True)["head"]
    assert len(resumed["head_token_ids"]) == len(ids)
    # a disk that could not take another round's features: collecting stops and says why, the steps go on
    rounds = load_collected(path.with_name("eagle-head-data.pt"), None).rounds
    assert main([*args, "--max-data-tokens", "10000000", "--min-free-gb", "1e9", "--max-steps", "7"]) == 0
    assert "collecting stopped at" in (err := capsys.readouterr().err) and "--min-free-gb 1e+09 GB free" in err
    assert load_collected(path.with_name("eagle-head-data.pt"), None).rounds == rounds
    assert torch.load(path.with_name("eagle-head-checkpoint.pt"), weights_only=True)["state"]["step"] == 7
    # --data-share 1: the whole budget collects (another round), nothing is trained or written
    before = path.stat().st_mtime_ns
    assert main([*args, "--minutes", "0.05", "--data-share", "1", "--max-data-tokens", "10000000",
                 "--questions-per-task", "2"]) == 0
    assert torch.load(path.with_name("eagle-head-data.pt"), weights_only=True)["rounds"] >= 3  # rounds fit in 3 s
    assert path.stat().st_mtime_ns == before
    assert f"Train with: chatserve train-head --model {tiny_llama_dir} --data-share 0" in capsys.readouterr().err
    # with --out, the command it suggests names the same file (the data lies beside it)
    apart = tmp_path / "apart dir" / "head.pt"
    assert main([*args, "--minutes", "0.05", "--data-share", "1", "--max-data-tokens", "10000000",
                 "--out", str(apart)]) == 0
    assert f"--out '{apart}' --data-share 0" in capsys.readouterr().err
    assert load_collected(apart.with_name("head-data.pt"), weights_hash(tiny_llama_dir)).num_tokens > 0
    # --data-share 0 with no data anywhere: a clear error, not a crash
    assert main([*args, "--data-share", "0", "--out", str(tmp_path / "other.pt")]) == 2
    # EAGLE-1's features asked for: a head on the final feature alone (and its MLP narrower than the model's)
    other = tmp_path / "final.pt"
    assert main([*args, "--max-data-tokens", "300", "--max-steps", "1", "--feature-layers", "final",
                 "--head-intermediate-size", "40", "--out", str(other)]) == 0
    narrow = torch.load(other, weights_only=True)
    assert narrow["feature_layers"] == [] and narrow["info"]["intermediate_size"] == 40
    assert narrow["state_dict"]["layer.mlp.down_proj.weight"].shape == (64, 40)
    # resumed, it keeps its width; another one asked for is refused
    assert main([*args, "--data-share", "0", "--max-steps", "2", "--out", str(other)]) == 0
    assert main([*args, "--data-share", "0", "--max-steps", "3", "--head-intermediate-size", "56",
                 "--out", str(other)]) == 2
    assert torch.load(other, weights_only=True)["info"]["last_steps"] == 2
    # `serve` with no drafter named takes the trained head, unless a drafter is named
    from chatserve.cli import build_parser, speculation
    method, draft, why = speculation(build_parser().parse_args(["serve", "--model", str(tiny_llama_dir)]))
    assert (method, draft) == ("eagle", None) and str(path) in why
    named = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--draft", "ngram"])
    assert speculation(named)[0] == "ngram"
    engine = make_engine(tiny_llama_dir)  # no head named: the cache's, for these weights
    prompt = engine.tokenizer.encode(PROMPTS[1])
    assert engine.generate([prompt], EAGLE)[0]["stats"].num_drafted > 0


def test_a_head_travels_as_a_portable_file_and_train_head_goes_on_from_it(tiny_llama_dir, tiny_draft_dir, fused_head,
                                                                           tmp_path, monkeypatch, capsys):
    """export-head writes a head without the target's LM-head rows, its weights in int8 by groups of
    columns; import-head on the same weights makes it servable again: the rows the target's, each
    weight within half a step of its group's scale, greedy output equal to speculation off; other
    weights are refused, and a head already there is replaced only with --force. train-head goes on
    from the imported head (it has no checkpoint): the lr warms up again from step 0, and the
    imported head's steps are kept as prior steps."""
    import chatserve.head_store as head_store
    from chatserve.cli import main
    from chatserve.head_store import PORTABLE_GROUP, default_head_path

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path / "cache"))
    portable = tmp_path / f"{tiny_llama_dir.name}.eagle.pt"
    assert main(["export-head", "--model", str(tiny_llama_dir), "--head", str(fused_head), str(portable)]) == 0
    # a checkout that ships a head for the model names it where no head is found
    monkeypatch.setattr(head_store, "SHIPPED_HEADS", tmp_path)
    with pytest.raises(ValueError, match=f"no EAGLE head .* chatserve import-head --model {tiny_llama_dir} {portable}"):
        make_engine(tiny_llama_dir)
    record = torch.load(portable, weights_only=True)
    assert "lm_head.weight" not in record["weights"] and record["feature_layers"] == [0, 1]
    assert record["weights"]["layer.mlp.down_proj.weight"]["q"].dtype == torch.int8
    assert main(["import-head", "--model", str(tiny_draft_dir), str(portable)]) == 2  # other weights
    assert not default_head_path(weights_hash(tiny_draft_dir)).exists()
    assert main(["import-head", "--model", str(tiny_llama_dir), str(portable)]) == 0
    assert main(["import-head", "--model", str(tiny_llama_dir), str(portable)]) == 2  # a head is there
    assert main(["import-head", "--model", str(tiny_llama_dir), "--force", str(portable)]) == 0
    path = default_head_path(weights_hash(tiny_llama_dir))
    original = torch.load(fused_head, weights_only=True)["state_dict"]
    imported = torch.load(path, weights_only=True)["state_dict"]
    assert imported.keys() == original.keys()
    for name, weight in original.items():
        if name in ("lm_head.weight", "head_token_ids") or weight.dim() < 2:
            assert torch.equal(imported[name], weight), name
        else:
            rows, cols = weight.shape
            step = weight.reshape(rows, cols // PORTABLE_GROUP, -1).abs().amax(-1, keepdim=True) / 127
            error = (imported[name] - weight).abs().reshape(rows, cols // PORTABLE_GROUP, -1)
            assert bool((error <= 0.51 * step + 1e-7).all()) and float(error.max()) > 0, name
    prompt = make_engine(tiny_llama_dir, method=None).tokenizer.encode(PROMPTS[1])
    off = make_engine(tiny_llama_dir, method=None).generate([prompt], GREEDY)[0]["token_ids"]
    served = make_engine(tiny_llama_dir).generate([prompt], EAGLE)[0]  # the cache's head: the imported one
    assert served["token_ids"] == off and served["stats"].num_drafted > 0
    assert main(["train-head", "--model", str(tiny_llama_dir), "--dtype", "float32", "-q", "none", "--quiet",
                 "--reply-tokens", "16", "--max-data-tokens", "600", "--max-steps", "2", "--minutes", "5",
                 "--train-dtype", "float32"]) == 0
    ckpt = torch.load(path.with_name("eagle-head-checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["prior_steps"] == 100 and ckpt["state"]["step"] == 2 and ckpt["feature_layers"] == [0, 1]
    # two steps at a warming-up lr (6e-4 x 1 / 20, then x 2 / 20): the head went on from the imported one
    moved = max(float((ckpt["head"][n] - imported[n]).abs().max()) for n in imported if n.startswith("layer."))
    assert 0 < moved < 1e-4
    # the head kept is the better validated of the imported one and this run's
    info = torch.load(path, weights_only=True)["info"]
    assert info["last_steps"] == 2 and (info.get("imported_from") == portable.name or info["prior_steps"] == 100)
    # imported over a head with a checkpoint: train-head would go on from that checkpoint, and is said to
    capsys.readouterr()
    assert main(["import-head", "--model", str(tiny_llama_dir), "--force", str(portable)]) == 0
    assert "eagle-head-checkpoint.pt is the replaced head's training checkpoint" in capsys.readouterr().err


def test_training_data_skips_prompts_longer_than_the_context(tiny_llama_dir, monkeypatch):
    """A stdlib snippet without blank lines can exceed the context: collect() skips it (a real
    SmolLM2 run failed on a 5,795-token prompt)."""
    from chatserve import head_data

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    turns = iter(["short question", "x " * 400, "another short one"])
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: turns)
    monkeypatch.setattr(head_data, "plain_sources", lambda tok, seed: iter([]))
    sequences = head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=8, batch=2).sequences
    assert len(sequences) == 2 and all(len(s.token_ids) <= 256 for s in sequences)


def test_question_lines_take_one_message_a_line():
    from chatserve.head_data import question_lines

    text = ('Here are some messages:\n1. How do I keep basil alive indoors?\n2) "Which herbs grow well on a '
            'windowsill?"\n- Can mint share a pot with other herbs?\n\n* water\n\u2022 Write me a short care '
            'plan for a rosemary plant.')
    assert question_lines(text) == ["How do I keep basil alive indoors?",
                                     "Which herbs grow well on a windowsill?",
                                     "Can mint share a pot with other herbs?",
                                     "Write me a short care plan for a rosemary plant."]
    # what a sampled code request brought along: bold, a field's label, the code itself
    text = ('**Merge two DataFrames on their id column.**\n*Output:** Merged DataFrame\n'
            'func Concat(a string, b string) (string, error) {\nreturn "", errors.New("both must be set")\n'
            'if a == "" || b == "" {\n// Concatenate two strings and return an error\nx = compute(a, b, c);')
    assert question_lines(text) == ["Merge two DataFrames on their id column."]


def test_user_turns_mix_the_targets_own_questions_into_the_tasks():
    """Shipped prompts first (each followed by a task), then tasks alternating with questions."""
    import json

    from chatserve import head_data

    data = json.loads(head_data.PROMPTS_FILE.read_text())
    shipped = set(data["chat"] + data["code"])
    n = len(shipped)
    turns = list(itertools.islice(head_data.user_turns(0, iter(["Q one?", "Q two?"])), 2 * n + 5))
    assert set(turns[0 : 2 * n : 2]) == shipped and not shipped & set(turns[1 : 2 * n : 2])
    assert turns[2 * n + 1] == "Q one?" and turns[2 * n + 3] == "Q two?"
    assert not {turns[2 * n], turns[2 * n + 2], turns[2 * n + 4]} & ({"Q one?", "Q two?"} | shipped)  # tasks
    # per_task questions after each task, while they last; then tasks alone
    three = list(itertools.islice(head_data.user_turns(0, iter(["Q1", "Q2", "Q3", "Q4"]), per_task=3), 2 * n + 7))
    assert three[2 * n + 1 : 2 * n + 4] == ["Q1", "Q2", "Q3"] and three[2 * n + 5] == "Q4"
    assert not {three[2 * n], three[2 * n + 4], three[2 * n + 6]} & ({"Q1", "Q2", "Q3", "Q4"} | shipped)
    with pytest.raises(ValueError, match="per_task"):
        next(head_data.user_turns(0, iter(()), per_task=0))
    assert len(data["topics"]) >= 200 and "{topic}" in data["question_request"]
    assert len(data["code_topics"]) >= 100 and "{topic}" in data["code_request"] and "{n}" in data["code_request"]
    assert not set(data["topics"]) & set(data["code_topics"])  # one `written` dict holds both kinds
    assert all(len(set(data[k])) == len(data[k]) for k in ("topics", "code_topics"))  # a topic written once


def test_alternate_takes_one_of_each_in_turn_until_all_are_done():
    from chatserve.head_data import alternate

    assert list(alternate(iter("ab"), iter("xyz"), iter(()))) == ["a", "x", "b", "y", "z"]


def test_source_tasks_ask_a_new_seed_about_other_snippets_and_functions(monkeypatch):
    """Two snippets and one documented function per file, chosen by the seed: ten seeds between
    them ask about most of a file's snippets and functions (the first two and the first function
    every time left later seeds nothing new to ask)."""
    from chatserve import head_data

    functions = "\n\n".join(f'def f{i}(x):\n    """Return x with the thing number {i} done to it, as asked."""\n'
                               f'    return x\n' for i in range(3))
    text = functions + "\n\n" + "\n".join("" if i % 2 else f"x{i} = {i}" for i in range(300))
    monkeypatch.setattr(head_data, "stdlib_sources", lambda seed: iter([text]))
    monkeypatch.setattr(head_data, "doc_topics", lambda seed: iter(()))
    pieces = head_data.snippets(text, head_data.SNIPPET_LINES)
    assert len(pieces) >= 6 and len(head_data.writing_tasks(text)) == 3
    seen_snippets, seen_functions = set(), set()
    for seed in range(10):
        tasks = list(head_data.source_tasks(["snip:{code}"], seed))
        assert tasks == list(head_data.source_tasks(["snip:{code}"], seed))  # deterministic
        snips = [t[len("snip:"):] for t in tasks if t.startswith("snip:")]
        wants = [t for t in tasks if t.startswith("Write a Python function")]
        assert len(snips) == 2 and set(snips) <= set(pieces) and len(wants) == 1
        seen_snippets.update(snips)
        seen_functions.update(wants)
    assert len(seen_snippets) >= 5 and len(seen_functions) == 3


def test_source_tasks_paste_whole_files_of_a_pastable_length(monkeypatch):
    """A stdlib file of FILE_LINES lines is also asked about whole (a question with the file
    pasted, the templates in turn), before its snippets' tasks; a longer one only in snippets."""
    import json

    from chatserve import head_data

    lo, hi = head_data.FILE_LINES
    body = lambda n: "\n".join("" if i % 2 else f"x{i} = {i}" for i in range(n))  # noqa: E731  n lines
    files = [body(lo), body(hi + 10), body(hi)]
    monkeypatch.setattr(head_data, "stdlib_sources", lambda seed: iter(files))
    tasks = list(head_data.source_tasks(["snip:{code}"], 0, ["file:{code}", "whole:{code}"]))
    kinds = [t.split(":")[0] for t in tasks if t.split(":")[0] in ("snip", "file", "whole")]
    assert kinds == ["file", "snip", "snip", "snip", "snip", "whole", "snip", "snip"]
    assert tasks[0] == "file:" + files[0].strip() and "whole:" + files[2].strip() in tasks
    assert all("{code}" in t for t in json.loads(head_data.PROMPTS_FILE.read_text())["file_tasks"])


def test_model_questions_ask_the_target_once_per_topic(tiny_llama_dir, monkeypatch, tmp_path):
    """The target is asked about each topic (batched), and every line it writes of 3 words or
    more, up to QUESTIONS_PER_TOPIC a topic, is a prompt; the pool is empty after."""
    import json

    from chatserve import head_data

    prompts = tmp_path / "head_prompts.json"
    prompts.write_text(json.dumps({"topics": ["bees", "tea", "maps"], "question_request": "{n} on {topic}"}))
    monkeypatch.setattr(head_data, "PROMPTS_FILE", prompts)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    asked = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda ps, params: asked.append(len(ps)) or generate(ps, params))
    monkeypatch.setattr(head_data, "question_lines", lambda text: ["a b c"] * 9)
    questions = list(head_data.model_questions(engine, seed=0, batch=2))
    assert asked == [2, 1] and questions == ["a b c"] * (3 * head_data.QUESTIONS_PER_TOPIC)
    assert_pool_empty(engine)


def test_model_questions_of_kind_code_ask_for_code_and_drop_the_held_out_prompts(tiny_llama_dir, monkeypatch,
                                                                                 tmp_path):
    """kind="code" asks about code_topics with code_request; a line that is a held-out prompt
    (prompts.json, spaces and case aside) is not kept, so no benchmark prompt is trained on."""
    import json

    from chatserve import head_data

    prompts = tmp_path / "head_prompts.json"
    prompts.write_text(json.dumps({"topics": ["bees"], "question_request": "chat {n} on {topic}",
                                   "code_topics": ["SQL joins", "Go"], "code_request": "code {n} on {topic}"}))
    held = tmp_path / "prompts.json"
    held.write_text(json.dumps({"code": ["Write a SQL query that joins two tables."], "about": "not a list"}))
    monkeypatch.setattr(head_data, "PROMPTS_FILE", prompts)
    monkeypatch.setattr(head_data, "HELD_OUT_FILE", held)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    asked = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda ps, params: asked.extend(ps) or generate(ps, params))
    monkeypatch.setattr(head_data, "question_lines",
                        lambda text: ["write a SQL query  that joins two TABLES.", "Write a Go web server please"])
    written = {}
    tasks = list(head_data.model_questions(engine, seed=0, batch=4, written=written, kind="code"))
    texts = [engine.tokenizer.decode(p) for p in asked]
    assert len(asked) == 2 and all(f"code {head_data.QUESTIONS_PER_TOPIC} on" in t for t in texts)
    assert not any("chat" in t for t in texts)
    assert tasks == ["Write a Go web server please"] * 2 and sorted(written) == ["Go", "SQL joins"]
    assert_pool_empty(engine)


def test_sampled_questions_are_new_for_each_seed_and_ask_for_specific_code(tiny_llama_dir, monkeypatch, tmp_path):
    """sampled=True: code topics are asked with specific_code_request, every topic's set is sampled
    (a seed per topic and seed) and kept under question_key(topic, seed), so another seed writes a new
    set beside the greedy ones and the same seed reuses its own; sequence_kinds still knows their kind."""
    import json

    from chatserve import head_data

    prompts = tmp_path / "head_prompts.json"
    prompts.write_text(json.dumps({"topics": ["bees"], "question_request": "chat {n} on {topic}",
                                   "code_topics": ["C# classes"], "code_request": "code {n} on {topic}",
                                   "specific_code_request": "specific {n} on {topic}"}))
    monkeypatch.setattr(head_data, "PROMPTS_FILE", prompts)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    asked, params = [], []
    generate = engine.generate

    def spy(ps, sp):
        asked.extend(engine.tokenizer.decode(p) for p in ps)
        params.extend(sp)
        return generate(ps, sp)

    monkeypatch.setattr(engine, "generate", spy)
    monkeypatch.setattr(head_data, "question_lines", lambda text: [f"Write {len(asked)} things please"])
    written = {"C# classes": ["Write a greedy one please"]}
    code = list(head_data.model_questions(engine, seed=3, batch=4, written=written, kind="code", sampled=True))
    assert len(asked) == 1 and "specific 6 on C# classes" in asked[0]
    assert params[0].temperature == head_data.QUESTION_TEMPERATURE and params[0].seed is not None
    key = head_data.question_key("C# classes", 3)
    assert code == written[key] and head_data.question_topic(key) == "C# classes"
    assert head_data.question_topic("C# classes") == "C# classes"
    assert list(head_data.model_questions(engine, seed=3, batch=4, written=written, kind="code", sampled=True)) == code
    assert len(asked) == 1  # the same seed: its set is kept
    list(head_data.model_questions(engine, seed=4, batch=4, written=written, kind="code", sampled=True))
    chat = list(head_data.model_questions(engine, seed=4, batch=4, written=written, sampled=True))
    assert len(asked) == 3 and "chat 6 on bees" in asked[2] and params[1].seed != params[0].seed
    assert sorted(written) == ["C# classes", "C# classes [seed 3]", "C# classes [seed 4]", "bees [seed 4]"]
    tok = engine.tokenizer
    sequences = []
    for text in ["Write a greedy one please", code[0], chat[0], "Explain this"]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        sequences.append(Sequence(torch.tensor(ids + [5, 6]), torch.zeros(len(ids) + 2, 2), len(ids)))
    assert head_data.sequence_kinds(sequences, written, tok) == ["code requests", "code requests", "chat", "other"]
    assert_pool_empty(engine)


def test_no_benchmark_prompt_is_a_shipped_training_prompt():
    """head_prompts.json's own chat and code prompts are answered as they are (only the target's
    written questions are filtered, model_questions), so none of them may be a prompt benchmarks
    measure a head on (every list of prompts.json, chat_wide and code_wide included)."""
    import json

    from chatserve import head_data

    data = json.loads(head_data.PROMPTS_FILE.read_text())
    held_out = head_data.held_out_prompts()
    assert len(held_out) >= 8 * 3 + 40 + 24  # chat, code, edit and the wide sets
    assert not {head_data._normal(p) for p in data["chat"] + data["code"]} & held_out


def test_model_questions_kept_in_the_data_are_not_written_again(tiny_llama_dir, monkeypatch, tmp_path):
    """The questions written on each topic go into `written` (the data phase's state, saved with
    its data): a resumed phase yields them in the same order without asking the target again,
    and asks only about the topics not written yet."""
    import json

    from chatserve import head_data

    prompts = tmp_path / "head_prompts.json"
    prompts.write_text(json.dumps({"topics": ["bees", "tea", "maps"], "question_request": "{n} on {topic}"}))
    monkeypatch.setattr(head_data, "PROMPTS_FILE", prompts)
    monkeypatch.setattr(head_data, "question_lines", lambda text: [f"about {text[:12]!r}?"])
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    written = {}
    first = list(head_data.model_questions(engine, seed=0, batch=2, written=written))
    assert len(first) == 3 and sorted(written) == ["bees", "maps", "tea"]
    assert first == [q for topic in written for q in written[topic]]  # written in the order asked
    asked = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda ps, params: asked.append(len(ps)) or generate(ps, params))
    assert list(head_data.model_questions(engine, seed=0, batch=2, written=dict(written))) == first and not asked
    partial = {topic: written[topic] for topic in list(written)[:2]}  # the first batch's topics only
    assert list(head_data.model_questions(engine, seed=0, batch=2, written=partial)) == first and asked == [1]
    assert partial == written
    assert_pool_empty(engine)


def test_a_killed_data_phase_resumes_where_its_checkpoint_left_it(tiny_llama_dir, monkeypatch):
    """The data phase checkpoints as it goes: a run killed after its first checkpoint, resumed from
    it, ends with the sequences of a run never interrupted (same prompts, same source, in order),
    and the resumed part's time counts against the budget."""
    import copy

    from chatserve import head_data

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    turns = [f"question number {i}" for i in range(6)]
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: iter(turns))
    monkeypatch.setattr(head_data, "plain_sources", lambda tok, seed: iter([[5, 6, 7, 8]] * 3))
    whole = head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=6, batch=2)
    assert whole.exhausted and whole.rounds == 4 and len(whole.sequences) == 6 + 3

    saved = []

    class Killed(Exception):
        pass

    def checkpoint(state):
        saved.append(copy.deepcopy(state))
        raise Killed

    with pytest.raises(Killed):
        head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=6, batch=2,
                          checkpoint=checkpoint, checkpoint_seconds=0)
    assert saved[0].rounds == 1 and not saved[0].exhausted and len(saved[0].sequences) == 3
    resumed = head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=6, batch=2, resume=saved[0])
    assert resumed.exhausted and resumed.rounds == 4
    assert [s.token_ids.tolist() for s in resumed.sequences] == [s.token_ids.tolist() for s in whole.sequences]
    assert len(saved[0].sequences) == 3  # the resumed state is a copy
    # the prompt set reordered (or grown) between runs: what was answered is not asked again
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: iter(turns[::-1]))
    reordered = head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=6, batch=2, resume=saved[0])
    prompts = [tuple(s.token_ids[: s.num_prompt_tokens].tolist()) for s in reordered.sequences
               if s.num_prompt_tokens < len(s.token_ids)]
    assert len(prompts) == len(set(prompts)) == 6
    assert_pool_empty(engine)


def test_the_data_phase_stops_before_a_round_that_could_fill_the_disk(tiny_llama_dir, monkeypatch, tmp_path):
    """collect(disk=, keep_free=) starts no round whose features, with those not yet saved, could
    leave less than keep_free bytes free on the disk: with more kept free than the disk has, nothing
    is collected; with room for one round's rows, the second does not start. Either way the phase
    is not exhausted, and a run with room goes on to what an uninterrupted run collects."""
    from chatserve import head_data

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20))
    turns = [f"question number {i}" for i in range(6)]
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: iter(turns))
    monkeypatch.setattr(head_data, "plain_sources", lambda tok, seed: iter([[5, 6, 7, 8]] * 3))
    kwargs = dict(max_tokens=10**6, seconds=60, reply_tokens=6, batch=2)
    whole = head_data.collect(engine, **kwargs)
    assert whole.exhausted and not whole.disk_full

    none = head_data.collect(engine, **kwargs, disk=tmp_path, keep_free=head_data.free_bytes(tmp_path) + (1 << 30))
    assert none.disk_full and not none.exhausted and none.rounds == 0 and not none.sequences

    row_bytes = whole.sequences[0].features.shape[1] * head_data.FEATURE_DTYPE.itemsize
    round_bytes = (2 * 2 * 6 + head_data.RAW_TOKENS) * row_bytes
    monkeypatch.setattr(head_data, "free_bytes", lambda folder: round_bytes + 1000)  # nothing saved: rows pile up
    one = head_data.collect(engine, **kwargs, disk=tmp_path, keep_free=1000)
    assert one.disk_full and not one.exhausted and one.rounds == 1 and len(one.sequences) == 3
    resumed = head_data.collect(engine, **kwargs, resume=one)
    assert resumed.exhausted and not resumed.disk_full
    assert [s.token_ids.tolist() for s in resumed.sequences] == [s.token_ids.tolist() for s in whole.sequences]
    assert_pool_empty(engine)


def test_saved_data_is_appended_to_and_read_back_memory_mapped(tmp_path):
    """save_collected appends only the sequences not yet saved to the feature file, and points
    their features at a memory map of it; load_collected gives back the same sequences, mapped.
    Rows past the recorded ones (a run killed between its two writes) are cut at the next save;
    a feature file short of its rows, or data for other weights, is not taken."""
    from chatserve.head_data import Collected, features_path, save_collected

    def seq(n, num_prompt, seed):
        g = torch.Generator().manual_seed(seed)
        features = torch.randn(n, 8, generator=g).bfloat16()
        return Sequence(torch.randint(0, 1000, (n,), generator=g), features, num_prompt)

    def same(a, b):
        return [(s.token_ids.tolist(), s.features.tolist(), s.num_prompt_tokens) for s in a] == \
            [(s.token_ids.tolist(), s.features.tolist(), s.num_prompt_tokens) for s in b]

    path, row_bytes = tmp_path / "eagle-head-data.pt", 8 * 2
    first = [seq(5, 2, 0), seq(7, 7, 1)]
    state = Collected([dataclasses.replace(s) for s in first], rounds=1, seconds=2.5, asked={3, 4},
                      questions={"bees": ["How do bees dance?"], "tea": []})
    save_collected(path, state, "abc")
    assert state.saved == 2 and features_path(path).stat().st_size == 12 * row_bytes
    assert same(state.sequences, first)
    assert all(s.features.untyped_storage().data_ptr() == state.sequences[0].features.untyped_storage().data_ptr()
               for s in state.sequences)  # both views of the one map, the heap copies gone
    with open(features_path(path), "ab") as f:  # killed after writing rows it never recorded
        f.write(b"\x01" * 3 * row_bytes)
    more = [seq(4, 1, 2)]
    state.sequences += [dataclasses.replace(s) for s in more]
    state.rounds, state.exhausted = 2, True
    save_collected(path, state, "abc")
    assert features_path(path).stat().st_size == 16 * row_bytes
    loaded = load_collected(path, "abc")
    assert same(loaded.sequences, first + more) and loaded.saved == 3
    assert (loaded.rounds, loaded.seconds, loaded.exhausted, loaded.asked) == (2, 2.5, True, {3, 4})
    assert loaded.questions == {"bees": ["How do bees dance?"], "tea": []}
    assert load_collected(path, "other weights") is None and load_collected(tmp_path / "none.pt", "abc") is None
    assert same(load_collected(path, None).sequences, first + more)  # None: whatever target it was saved for
    with open(features_path(path), "r+b") as f:
        f.truncate(15 * row_bytes)
    with pytest.raises(ValueError, match="fewer than 16 feature rows"):
        load_collected(path, "abc")


def test_a_feature_file_bigger_than_memory_maps(tmp_path):
    """The feature file outgrows RAM (Qwen 1.5B's 2.11M tokens: 25.9 GB on 23 GiB): its map must not
    count against the kernel's commit limit, as a private writable map does (refused under the
    default overcommit heuristic). A sparse file larger than RAM + swap stands in; nothing is allocated."""
    from chatserve.head_data import FEATURE_DTYPE, _map_features, features_path

    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    limit = sum(int(meminfo[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    hidden = 4096
    rows = limit // (hidden * FEATURE_DTYPE.itemsize) + 4096
    fpath = features_path(tmp_path / "eagle-head-data.pt")
    with open(fpath, "wb") as f:
        f.truncate(rows * hidden * FEATURE_DTYPE.itemsize)
    mapped = _map_features(fpath, rows, hidden)
    assert mapped.shape == (rows, hidden) and mapped[-1].float().abs().sum().item() == 0.0


def test_data_saved_before_the_feature_file_loads_and_moves_to_it(tmp_path):
    from chatserve.head_data import save_collected

    path = tmp_path / "eagle-head-data.pt"
    seqs = [Sequence(torch.arange(n), torch.randn(n, 4).bfloat16(), 3) for n in (6, 3)]
    torch.save({"target_hash": "abc", "rounds": 4, "seconds": 9.0, "exhausted": False, "asked": [1],
                "sequences": [dataclasses.astuple(s) for s in seqs]}, path)
    old = load_collected(path, "abc")
    assert old.saved == 0 and old.rounds == 4 and torch.equal(old.sequences[0].features, seqs[0].features)
    save_collected(path, old, "abc")
    new = load_collected(path, "abc")
    assert new.saved == 2 and [s.token_ids.tolist() for s in new.sequences] == [[0, 1, 2, 3, 4, 5], [0, 1, 2]]
    assert torch.equal(new.sequences[1].features, seqs[1].features) and new.sequences[1].num_prompt_tokens == 3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_training_data_records_features_while_generating(tiny_llama_dir, monkeypatch, prefix_caching):
    """collect() keeps the features the engine computed as it generated each reply (prefill chunks
    and decodes): they match one prefill over the same tokens. With the prefix cache on, the
    prompt admitted second finds the first's head cached, never fed: its features come from
    that prefill instead."""
    from chatserve import head_data

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20,
                                 max_num_batched_tokens=16, enable_prefix_caching=prefix_caching))
    shared = "def add(a, b):\n    return a + b\n" * 2
    turns = iter([shared + "what does it do?", shared + "rename it"])
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: turns)
    monkeypatch.setattr(head_data, "plain_sources", lambda tok, seed: iter([]))
    fed = []
    monkeypatch.setattr(head_data, "target_features",
                        lambda engine, ids: fed.append(len(ids)) or target_features(engine, ids))
    sequences = head_data.collect(engine, max_tokens=10**6, seconds=60, reply_tokens=12, batch=2).sequences
    assert len(sequences) == 2 and engine.feature_observer is None
    for seq in sequences:
        assert seq.num_prompt_tokens < len(seq.token_ids) and len(seq.features) == len(seq.token_ids)
        torch.testing.assert_close(seq.features.float(), target_features(engine, seq.token_ids.tolist()).float(),
                                   atol=2e-2, rtol=2e-2)
    assert len(fed) == prefix_caching and set(fed) <= {len(s.token_ids) for s in sequences}
    assert_pool_empty(engine)


def test_the_data_round_ends_at_the_deadline_and_shows_progress_every_step(tiny_llama_dir, monkeypatch):
    """A round of 128 prompts takes minutes on 2 cores: collect() reports progress after every
    step, and at its deadline it aborts the round's requests and keeps what they fed (a reply cut
    short); a prompt cut off before its reply began is dropped and left to be asked again."""
    import time

    from chatserve import head_data

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=512, kv_cache_memory=8 << 20,
                                 max_num_batched_tokens=64))
    engine.generate([engine.tokenizer.encode("warm up")], SamplingParams(max_tokens=2))
    long_one = "x " * 150  # ~320 tokens in chunks of at most 64: still prefilling at the deadline
    turns = iter(["short question", "another short one", long_one, "never asked this round"])
    monkeypatch.setattr(head_data, "user_turns", lambda seed, questions, **_: turns)
    monkeypatch.setattr(head_data, "plain_sources", lambda tok, seed: iter([[1, 2, 3, 4, 5]]))
    step, steps = engine.step, []

    def slow_fourth_step():
        steps.append(1)
        deltas = step()
        if len(steps) == 4:
            time.sleep(3.2)  # the deadline passes during this step
        return deltas

    monkeypatch.setattr(engine, "step", slow_fourth_step)
    seen = []
    state = head_data.collect(engine, max_tokens=10**6, seconds=3.0, reply_tokens=64, batch=3,
                              progress=seen.append)
    assert len(steps) == 4 and state.rounds == 1 and not state.exhausted
    assert len(seen) >= 4 and seen[:4] == sorted(seen[:4]) and seen[0] > 0  # tokens fed, step by step
    assert state.sequences  # replies cut short; no plain source after the deadline
    for seq in state.sequences:
        assert seq.num_prompt_tokens < len(seq.token_ids) < seq.num_prompt_tokens + 64
        torch.testing.assert_close(seq.features.float(), target_features(engine, seq.token_ids.tolist()).float(),
                                   atol=2e-2, rtol=2e-2)
    # asked: the prompts kept; the long one (and any other without a reply token fed yet) is asked again
    assert len(state.asked) == len(state.sequences) and head_data.prompt_key(long_one) not in state.asked
    assert_pool_empty(engine)


def test_the_unrolled_training_passes_equal_drafting_in_a_chain(tiny_qwen_dir):
    """forward_unrolled's pass s at row i is what drafting computes for the (s+1)-th token of a
    chain from position i - s: rows up to it from the target's features, then each next row from
    the head's own predicted feature, attending causally (forward_dense over the grown prefix)."""
    import torch.nn.functional as F
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_qwen_dir))
    torch.manual_seed(0)
    head = EagleHead(cfg, 64, torch.arange(cfg.vocab_size)).float()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    t, hidden = 10, cfg.hidden_size
    features, embeds = torch.randn(1, t, hidden), torch.randn(1, t, hidden)
    norm = lambda y: F.rms_norm(y, head.norm.weight.shape, head.norm.weight, head.norm.eps)  # noqa: E731
    with torch.no_grad():
        passes = head.forward_unrolled(features, embeds, depth=3)
        torch.testing.assert_close(passes[0], head.forward_dense(features, embeds), atol=1e-4, rtol=1e-4)
        for anchor in range(t - 2):
            feats = features[:, : anchor + 1].clone()
            y = head.forward_dense(feats, embeds[:, : anchor + 1])
            for s in range(1, 3):
                feats = torch.cat((feats, norm(y[:, -1:])), dim=1)  # the next row reads the prediction
                y = head.forward_dense(feats, embeds[:, : anchor + 1 + s])
                torch.testing.assert_close(passes[s][:, anchor + s], y[:, -1], atol=1e-4, rtol=1e-4)


def test_a_greedy_draft_from_the_kept_logits_is_the_argmax_over_the_vocabulary(tiny_qwen_dir):
    """EagleMethod.propose takes a greedy draft as head_token_ids[argmax(kept_logits)] instead of
    building compute_logits' [vocab] row: the same token, ties included (the ids are sorted)."""
    from transformers import AutoConfig

    from spec.sampling import argmax_rows

    cfg = AutoConfig.from_pretrained(str(tiny_qwen_dir))
    torch.manual_seed(0)
    kept_ids = torch.tensor(sorted(set(range(0, cfg.vocab_size, 3)) | {cfg.vocab_size - 1}))
    head = EagleHead(cfg, 64, kept_ids).float()
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.randn_like(head.lm_head.weight))
        head.lm_head.weight[5:9] = head.lm_head.weight[4]  # tied rows: the first id among them wins
        predicted = torch.randn(6, cfg.hidden_size)
        predicted[0] = head.lm_head.weight[4] * 10
        kept, full = head.kept_logits(predicted), head.compute_logits(predicted)
    assert torch.equal(head.over_vocab(kept), full)
    assert torch.isinf(full[:, 1]).all() and torch.equal(full[:, kept_ids], kept)
    assert kept_ids[argmax_rows(kept)].tolist() == full.argmax(-1).tolist()
    assert int(argmax_rows(kept)[0]) == 4


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.9, top_p=0.8),
                                      dict(temperature=1.2, top_k=3), dict(temperature=1.0, top_k=500, min_p=0.05)])
def test_a_draft_over_the_kept_logits_has_the_distribution_of_one_over_the_vocabulary(tiny_qwen_dir, settings):
    """EagleMethod._draft_over_kept (no grammar) draws from the request's distribution over the head's
    kept logits: the distribution sample_draft gives over compute_logits' [vocab] row (-inf elsewhere),
    handed over as [1, vocab]; a greedy draft is the kept argmax, with no distribution."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from chatserve.request import Request
    from chatserve.sampler import Sampler
    from chatserve.spec_methods.base import sample_draft
    from chatserve.spec_methods.eagle import EagleMethod

    cfg = AutoConfig.from_pretrained(str(tiny_qwen_dir))
    torch.manual_seed(0)
    kept_ids = torch.tensor(sorted(set(range(0, cfg.vocab_size, 3)) | {cfg.vocab_size - 1}))
    head = EagleHead(cfg, 64, kept_ids).float()
    method = EagleMethod(SimpleNamespace(head=head), Sampler((0,)))
    kept = torch.randn(1, len(kept_ids)) * 3
    full = head.over_vocab(kept)
    params = SamplingParams(max_tokens=4, seed=3, **settings)
    token, probs = method._draft_over_kept(Request("a", [1, 2], params), kept, int(kept.argmax()))
    want_token, want_probs = sample_draft(method.sampler, Request("b", [1, 2], params), full)
    if params.is_greedy:
        assert probs is None and want_probs is None and token == want_token == int(kept_ids[kept.argmax()])
        return
    assert probs.shape == (1, cfg.vocab_size) and token in kept_ids.tolist() and probs[0, token] > 0
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=1e-5)
    assert float(probs[0, kept_ids].sum()) == pytest.approx(1.0, abs=1e-5) and not probs[0, 1].item()
