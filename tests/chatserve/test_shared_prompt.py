"""Requests that share a prompt (the choices of an n > 1 request): the prompt is computed once and
the others attach its blocks from the prefix cache (Engine.add_request's prompt_source_id)."""

import pytest

from chatserve.config import SpecConfig
from chatserve.sampling_params import SamplingParams

from .test_engine import assert_pool_empty, make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt_of(engine, num_tokens: int) -> list[int]:
    """Token ids no earlier request has used: nothing of it is cached before."""
    return [(7 * i + 3) % (engine.tokenizer.vocab_size - 10) + 5 for i in range(num_tokens)]


def run(engine, ids: list[str]) -> dict[str, list[int]]:
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for d in engine.step():
            outputs[d.request_id] += d.token_ids
        engine.block_manager.check_invariants([r.table for r in engine.requests.values()])
    return outputs


@pytest.mark.parametrize("is_drafted", [False, True])
def test_choices_compute_the_prompt_once(tiny_llama_dir, tiny_draft_dir, is_drafted):
    """Choice 0 computes the 3 full blocks and the 5-token tail; choices 1 and 2 wait for it, then
    attach the full blocks and compute only the tail (whose last token gives their first logits)."""
    spec = SpecConfig(draft_model=str(tiny_draft_dir), num_draft_tokens=3, adaptive=False) if is_drafted else None
    engine = make_engine(tiny_llama_dir, spec=spec)
    bs = engine.block_manager.block_size
    prompt = prompt_of(engine, 3 * bs + 5)
    ids = [engine.add_request(prompt, GREEDY, "c0")]
    ids += [engine.add_request(prompt, GREEDY, f"c{i}", prompt_source_id="c0") for i in (1, 2)]
    outputs = run(engine, ids)
    assert engine.num_prompt_tokens_computed == len(prompt) + 2 * 5
    assert engine.pool_stats()["prompt_tokens_computed"] == len(prompt) + 2 * 5
    assert outputs["c0"] == outputs["c1"] == outputs["c2"] and len(outputs["c0"]) == 12  # greedy: the same
    assert_pool_empty(engine)


@pytest.mark.parametrize("is_linked, num_computed", [(False, 3 * 53), (True, 53 + 2 * 5)])
def test_the_link_holds_choices_back_when_all_prompts_fit_one_step(tiny_llama_dir, is_linked, num_computed):
    """Without stall-free batching (stall_limit 0) the three prompts fit one step's token budget:
    unlinked, all are prefilled in that step, before any block is cached; linked, once."""
    engine = make_engine(tiny_llama_dir, stall_limit=0)
    prompt = prompt_of(engine, 3 * engine.block_manager.block_size + 5)
    assert len(prompt) == 53
    source = "c0" if is_linked else None
    ids = [engine.add_request(prompt, GREEDY, "c0")]
    ids += [engine.add_request(prompt, GREEDY, f"c{i}", prompt_source_id=source) for i in (1, 2)]
    run(engine, ids)
    assert engine.num_prompt_tokens_computed == num_computed
    assert_pool_empty(engine)


def test_choices_cached_tokens_are_the_shared_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    bs = engine.block_manager.block_size
    prompt = prompt_of(engine, 2 * bs + 1)
    engine.add_request(prompt, GREEDY, "c0")
    engine.add_request(prompt, GREEDY, "c1", prompt_source_id="c0")
    stats = {}
    while engine.has_unfinished():
        stats |= {d.request_id: d.stats for d in engine.step() if d.finished}
    assert (stats["c0"].cached_tokens, stats["c1"].cached_tokens) == (0, 2 * bs)


def test_a_source_aborted_before_its_prefill_releases_its_choices(tiny_llama_dir):
    """The choices do not wait for a request that is gone: they compute the prompt themselves
    and finish, and every block returns to the pool."""
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(engine, 40)
    engine.add_request(prompt, GREEDY, "c0")
    engine.add_request(prompt, GREEDY, "c1", prompt_source_id="c0")
    engine.add_request(prompt, GREEDY, "c2", prompt_source_id="c0")
    engine.abort("c0")
    outputs = run(engine, ["c1", "c2"])
    assert outputs["c1"] == outputs["c2"] and len(outputs["c1"]) == 12
    assert_pool_empty(engine)


def test_a_source_with_another_prompt_is_not_waited_for(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request(prompt_of(engine, 40), GREEDY, "a")
    engine.add_request(prompt_of(engine, 41), GREEDY, "b", prompt_source_id="a")
    assert engine.requests["b"].prompt_source is None
    run(engine, ["a", "b"])
    assert_pool_empty(engine)
