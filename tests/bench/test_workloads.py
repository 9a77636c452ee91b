"""Workloads: built-in prompt sets, JSONL conversations, session plans, Poisson arrivals."""

import json
import random

import pytest

from chatserve.bench.workloads import (PROMPT_SETS, builtin_conversations, load_dataset, plan_sessions,
                                       poisson_arrivals, think_time)


def test_builtin_sets_load_with_multi_turn_and_long_prompts():
    convs = builtin_conversations(PROMPT_SETS)
    cats = {c.category for c in convs}
    assert cats == set(PROMPT_SETS)
    assert all(len(c.user_turns) >= 2 for c in convs if c.category == "multiturn")
    assert min(len(c.user_turns[0]) for c in convs if c.category == "long") > 2000
    with pytest.raises(ValueError, match="unknown prompt set"):
        builtin_conversations(("nope",))


def test_dataset_jsonl_keeps_user_turns_and_system(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                           {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]},
             {"prompt": "single"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = load_dataset(path)
    assert convs[0].user_turns == ("a", "b") and convs[0].system == "be brief"
    assert convs[1].user_turns == ("single",) and convs[1].system is None
    path.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=":1:"):
        load_dataset(path)


def test_plan_sessions_totals_exactly_num_requests():
    convs = builtin_conversations(("multiturn",))
    sessions = plan_sessions(convs, num_requests=10, max_turns=3, seed=1)
    assert sum(s.num_turns for s in sessions) == 10
    assert all(1 <= s.num_turns <= 3 for s in sessions)
    assert [s.session_idx for s in sessions] == list(range(len(sessions)))
    single = plan_sessions(convs, num_requests=20, max_turns=1)  # cycles through the 6 conversations
    assert len(single) == 20 and all(s.num_turns == 1 for s in single)
    assert plan_sessions(convs, 5, 1, seed=3) == plan_sessions(convs, 5, 1, seed=3)


def test_poisson_arrivals_have_the_requested_rate():
    times = poisson_arrivals(4000, rate=5.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.05)
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    assert think_time(0.0, random.Random(0)) == 0.0
