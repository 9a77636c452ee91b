"""The order benchmarks/eagle_head.py's lockstep runs take engines in, round by round."""

from benchmarks.eagle_head import turn_order


def followers(order: list[str]) -> set[tuple[str, str]]:
    """(engine, the one whose turn comes just before it), around the cycle."""
    return {(order[i], order[i - 1]) for i in range(len(order))}


def test_two_rounds_put_each_of_three_engines_after_each_other_once():
    names = ["off", "eagle1", "eagle2"]
    for start in range(6):
        first, second = followers(turn_order(names, start)), followers(turn_order(names, start + 1))
        assert not first & second
        assert first | second == {(a, b) for a in names for b in names if a != b}


def test_each_round_is_led_by_the_next_engine_and_keeps_every_engine_once():
    names = ["off", "eagle", "draft", "eagle_k8"]
    for r in range(8):
        order = turn_order(names, r)
        assert order[0] == names[r % 4]
        assert sorted(order) == sorted(names)


def test_two_engines_alternate_the_lead():
    assert [turn_order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
