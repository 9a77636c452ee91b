from chatserve.scale.affinity import AffinityPolicy, RoundRobin, least_loaded, prompt_key, session_key


def test_new_key_goes_to_least_loaded_then_sticks():
    policy = AffinityPolicy()
    assert policy.choose("conv-1", {"a": 3, "b": 1}) == "b"
    # b is busier now, but conv-1's prefix lives there
    assert policy.choose("conv-1", {"a": 0, "b": 9}) == "b"


def test_gone_replica_rehomes_to_least_loaded_and_sticks_there():
    policy = AffinityPolicy()
    assert policy.choose("conv-1", {"a": 1, "b": 0}) == "b"
    assert policy.choose("conv-1", {"a": 5, "c": 2}) == "c"  # b died, c replaced it
    assert policy.choose("conv-1", {"a": 0, "b": 0, "c": 7}) == "c"


def test_no_key_is_never_remembered():
    policy = AffinityPolicy()
    assert policy.choose(None, {"a": 2, "b": 1}) == "b"
    assert policy.choose(None, {"a": 0, "b": 1}) == "a"
    assert not policy.homes


def test_keys_spread_over_equally_loaded_replicas():
    loads = {f"r{i}": 0 for i in range(4)}
    homes = {least_loaded(f"conv-{k}", loads) for k in range(64)}
    assert homes == set(loads)


def test_oldest_key_forgotten_past_the_bound():
    policy = AffinityPolicy(max_sessions=2)
    for key in ("k1", "k2", "k1", "k3"):  # k1 used again: k2 is the oldest
        policy.choose(key, {"a": 0})
    assert list(policy.homes) == ["k1", "k3"]


def test_ranked_puts_home_first_then_by_load():
    policy = AffinityPolicy()
    policy.choose("k", {"a": 0, "b": 5, "c": 9})
    assert policy.ranked("k", {"a": 4, "b": 1, "c": 3}) == ["a", "b", "c"]


def test_prompt_key_hashes_first_full_blocks_only():
    ids = list(range(1, 11))
    assert prompt_key(ids, block_size=4, num_blocks=2) == prompt_key(ids[:8] + [99, 98], block_size=4, num_blocks=2)
    assert prompt_key(ids, block_size=4, num_blocks=2) != prompt_key([0] + ids[1:], block_size=4, num_blocks=2)
    assert prompt_key(ids[:3], block_size=4) is None
    # a conversation's next turn shares its first blocks, so it finds the same replica
    policy = AffinityPolicy()
    first = policy.choose(prompt_key(list(range(64))), {"a": 0, "b": 0})
    assert policy.choose(prompt_key(list(range(64)) + [7] * 40), {"a": 0, "b": 0, first: 1}) == first  # within PROMPT_KEY_SLACK


def test_session_key_from_header_then_query():
    assert session_key({"headers": [(b"X-Session-Id", b"h1")], "query_string": b"session=q1"}) == "h1"
    assert session_key({"headers": [(b"x_session_id", b"h2")]}) == "h2"
    assert session_key({"headers": [], "query_string": b"api_key=k&session=q1"}) == "q1"
    assert session_key({"headers": [], "query_string": b"session="}) is None
    assert session_key({"type": "websocket"}) is None


def test_round_robin_ignores_keys():
    policy = RoundRobin()
    firsts = [policy.ranked("same-key", {"b": 0, "a": 9})[0] for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]
