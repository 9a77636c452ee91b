"""BlockManager: hand cases plus a hypothesis state machine checking invariants after every step."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chatserve.block_manager import BlockManager, BlockTable


def test_allocate_truncate_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTable()
    assert bm.allocate(t, 10) and len(t.block_ids) == 3
    bm.truncate(t, 5)  # rollback: an integer, whole blocks past the end return
    assert len(t.block_ids) == 2 and bm.num_free_blocks == 6
    assert not bm.allocate(t, 100)  # all or nothing
    assert len(t.block_ids) == 2
    bm.free(t)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_prefix_cache_shares_full_committed_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    a = BlockTable()
    bm.allocate(a, 10)
    bm.commit(a, tokens, 10)  # two full blocks hashed
    b = BlockTable()
    assert bm.match_prefix(b, tokens + [99]) == 8
    assert b.block_ids == a.block_ids[:2]
    c = BlockTable()
    # exactly two full blocks: the last one is recomputed so logits exist for the last token
    assert bm.match_prefix(c, tokens[:8]) == 4
    bm.check_invariants([a, b, c])
    for t in (a, b, c):
        bm.free(t)
    assert bm.num_free_blocks == 8 and len(bm.cached_free) == 2
    d = BlockTable()
    assert bm.match_prefix(d, tokens) == 8  # still cached after all owners left
    bm.free(d)


def test_lru_eviction_only_when_free_list_is_empty():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = BlockTable()
    bm.allocate(a, 4)
    bm.commit(a, [1, 2, 3, 4], 4)
    bm.free(a)
    t = BlockTable()
    assert bm.allocate(t, 4)  # two plain free blocks are used first
    assert len(bm.cached_free) == 2
    assert bm.allocate(t, 6)  # now one cached block is evicted
    assert len(bm.cached_free) == 1
    bm.check_invariants([t])


def test_blocks_commit_at_the_target_horizon_and_carry_draft_marks():
    """Two horizons: a request that never ran the draft model commits its blocks all the same;
    a later draft request attaches them and catches its draft up from the first unmarked block."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    ngram = BlockTable()  # a request that never runs the draft model
    bm.allocate(ngram, 9)
    bm.commit(ngram, tokens, 8)
    bm.mark_draft_kv(ngram, 0)
    draft = BlockTable()
    assert bm.match_prefix(draft, tokens) == 8  # every request shares the target's blocks
    assert draft.block_ids == ngram.block_ids[:2]
    assert bm.draft_kv_prefix(draft) == 0  # ...and its draft starts from the first unmarked one
    bm.mark_draft_kv(draft, 4)  # the draft caught up on the first block
    assert bm.draft_kv_blocks == {draft.block_ids[0]}
    later = BlockTable()
    assert bm.match_prefix(later, tokens) == 8 and bm.draft_kv_prefix(later) == 4
    bm.free(later)
    bm.mark_draft_kv(draft, 8)
    assert bm.draft_kv_blocks == set(ngram.block_ids[:2])
    bm.check_invariants([ngram, draft])
    for t in (ngram, draft):
        bm.free(t)
    assert len(bm.cached_free) == 2 and bm.num_free_blocks == 8
    t = BlockTable()
    assert bm.match_prefix(t, tokens) == 8 and bm.draft_kv_prefix(t) == 8
    bm.free(t)
    bm.check_invariants()


def test_a_block_with_draft_kv_takes_over_an_unmarked_hash():
    """Two requests computed the same prefix side by side; the one whose draft also computed it
    becomes the cached copy, and the other's block is freed, not cached, when it leaves."""
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    a, b = BlockTable(), BlockTable()
    for t in (a, b):
        bm.allocate(t, 9)
        bm.commit(t, tokens, 8)
    assert {bm.hash_to_block[h] for h in a.block_hashes} == set(a.block_ids[:2])  # the first to commit
    bm.mark_draft_kv(b, 8)
    assert {bm.hash_to_block[h] for h in b.block_hashes} == set(b.block_ids[:2]) == bm.draft_kv_blocks
    bm.check_invariants([a, b])
    bm.free(a)
    assert len(bm.cached_free) == 0  # a's blocks lost their hashes: plain free
    bm.free(b)
    assert len(bm.cached_free) == 2
    bm.check_invariants()
    assert bm.num_free_blocks == 8


class PoolMachine(RuleBasedStateMachine):
    """Sequences of two kinds: draft sequences run the draft model (their draft horizon moves),
    the others never do. A ghost set tracks which blocks truly hold draft KV for their contents."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)
        self.seqs: list[dict] = []  # {"table", "tokens", "is_draft", "draft_horizon"}
        self.draft_written: set[int] = set()  # ghost: blocks whose draft KV is valid for their tokens

    def _allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Allocate; a fresh block holds stale draft KV until a draft writes it."""
        before = len(table.block_ids)
        if not self.bm.allocate(table, num_tokens):
            return False
        self.draft_written -= set(table.block_ids[before:])
        return True

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=20), is_draft=st.booleans())  # 2 ids: many shared prefixes
    def add(self, prompt, is_draft):
        table = BlockTable()
        cached = self.bm.match_prefix(table, prompt)
        assert cached % 4 == 0 and cached < len(prompt)
        assert cached == len(table.block_hashes) * 4  # every hashed block of the prefix is attached
        draft_start = self.bm.draft_kv_prefix(table)
        assert draft_start <= cached
        assert set(table.block_ids[: draft_start // 4]) <= self.draft_written, "draft KV trusted where none was written"
        if self._allocate(table, len(prompt)):
            self.bm.commit(table, prompt, len(prompt))
            self.seqs.append({"table": table, "tokens": list(prompt), "is_draft": is_draft, "draft_horizon": draft_start})
        else:
            self.bm.free(table)

    @precondition(lambda self: any(s["is_draft"] for s in self.seqs))
    @rule(i=st.integers(0, 100), n=st.integers(1, 12))
    def catch_up(self, i, n):
        """A draft sequence's draft sees n more of its tokens (writing KV into shared blocks too)."""
        seq = [s for s in self.seqs if s["is_draft"]][i % sum(s["is_draft"] for s in self.seqs)]
        table, start = seq["table"], seq["draft_horizon"]
        seq["draft_horizon"] = min(len(seq["tokens"]), start + n)
        # the blocks whose every token the draft has now computed (the horizon starts block-aligned
        # at admission, and everything before it was valid already)
        self.draft_written |= set(table.block_ids[start // 4 : seq["draft_horizon"] // 4])
        self.bm.mark_draft_kv(table, seq["draft_horizon"])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 3), min_size=1, max_size=6), accept=st.integers(0, 6))
    def speculate(self, i, new, accept):
        """Reserve lookahead for drafts, then keep `accept` of them and roll back the rest."""
        seq = self.seqs[i % len(self.seqs)]
        table, tokens = seq["table"], seq["tokens"]
        if not self._allocate(table, len(tokens) + len(new)):
            return
        kept = new[: min(accept, len(new))]
        tokens.extend(kept)
        self.bm.truncate(table, len(tokens))
        self.bm.commit(table, tokens, len(tokens))
        self.bm.mark_draft_kv(table, seq["draft_horizon"])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs))["table"])

    @invariant()
    def consistent(self):
        self.bm.check_invariants([s["table"] for s in self.seqs])
        assert self.bm.draft_kv_blocks <= self.draft_written
        for seq in self.seqs:
            table = seq["table"]
            assert len(table.block_ids) == -(-len(seq["tokens"]) // 4)
            assert len(table.block_hashes) == len(seq["tokens"]) // 4  # committed up to the target's horizon

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq["table"])
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
