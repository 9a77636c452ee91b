import ast
import pathlib

import pytest

from spec.stats import SpecStats


def test_update_and_derived_numbers():
    stats = SpecStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 0.0
    stats.update(4, 4)
    stats.update(4, 1)
    stats.update(2, 0)
    stats.update(0, 0)  # plain decode step: not a speculative step
    assert (stats.num_spec_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 5)
    assert stats.accepted_by_position == [2, 1, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == (5 + 3) / 3


def test_merge_grows_positions_and_adds():
    a = SpecStats()
    a.update(2, 2)
    b = SpecStats()
    b.update(5, 3)
    a.merge(b)
    assert a.accepted_by_position == [2, 2, 1, 0, 0]
    assert a.to_dict() == {
        "num_spec_steps": 2,
        "num_draft_tokens": 7,
        "num_accepted_tokens": 5,
        "accepted_by_position": [2, 2, 1, 0, 0],
        "acceptance_rate": 5 / 7,
        "mean_accepted_length": 3.5,
    }


def test_invalid_update():
    with pytest.raises(ValueError):
        SpecStats().update(1, 2)


def test_spec_never_imports_chatserve():
    spec_dir = pathlib.Path(__file__).resolve().parents[2] / "spec"
    for path in spec_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "chatserve" for n in names), path
