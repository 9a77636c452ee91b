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


def test_draft_requests_attach_only_blocks_with_draft_kv():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    ngram = BlockTable()  # a request that never runs the draft model
    bm.allocate(ngram, 9)
    bm.commit(ngram, tokens, 8, has_draft_kv=False)
    probe = BlockTable()
    assert bm.match_prefix(probe, tokens, need_draft_kv=True) == 0  # no draft KV there
    shared = BlockTable()
    assert bm.match_prefix(shared, tokens) == 8  # requests without a draft model may share
    bm.free(shared)
    bm.free(probe)
    draft = BlockTable()
    bm.allocate(draft, 9)
    bm.commit(draft, tokens, 8, has_draft_kv=True)  # same hashes: the marked blocks take over
    assert bm.draft_kv_blocks == set(draft.block_ids[:2])
    assert {bm.hash_to_block[h] for h in draft.block_hashes} == set(draft.block_ids[:2])
    bm.check_invariants([ngram, draft])
    bm.free(ngram)  # its old blocks are no longer hashed: plain free, not cached
    assert len(bm.cached_free) == 0
    bm.free(draft)
    assert len(bm.cached_free) == 2
    for need in (True, False):  # marked blocks serve both kinds
        t = BlockTable()
        assert bm.match_prefix(t, tokens, need_draft_kv=need) == 8
        bm.free(t)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4)
        self.seqs: list[tuple[BlockTable, list[int], bool]] = []  # (table, tokens, has_draft_kv)
        self.draft_written: set[int] = set()  # ghost: blocks whose draft KV a draft request wrote

    def _allocate(self, table: BlockTable, num_tokens: int, has_draft_kv: bool) -> bool:
        """Allocate, and track which blocks hold draft KV: a draft request writes it into its
        new blocks; any other request's new block holds stale draft KV."""
        before = len(table.block_ids)
        if not self.bm.allocate(table, num_tokens):
            return False
        new = set(table.block_ids[before:])
        self.draft_written = self.draft_written | new if has_draft_kv else self.draft_written - new
        return True

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=20), has_draft_kv=st.booleans())  # 2 ids: many shared prefixes
    def add(self, prompt, has_draft_kv):
        table = BlockTable()
        cached = self.bm.match_prefix(table, prompt, need_draft_kv=has_draft_kv)
        assert cached % 4 == 0 and cached < len(prompt)
        if has_draft_kv:
            assert set(table.block_ids) <= self.draft_written, "a draft request attached a block without draft KV"
        if self._allocate(table, len(prompt), has_draft_kv):
            self.bm.commit(table, prompt, len(prompt), has_draft_kv)
            self.seqs.append((table, list(prompt), has_draft_kv))
        else:
            self.bm.free(table)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 3), min_size=1, max_size=6), accept=st.integers(0, 6))
    def speculate(self, i, new, accept):
        """Reserve lookahead for drafts, then keep `accept` of them and roll back the rest."""
        table, tokens, has_draft_kv = self.seqs[i % len(self.seqs)]
        if not self._allocate(table, len(tokens) + len(new), has_draft_kv):
            return
        kept = new[: min(accept, len(new))]
        tokens.extend(kept)
        self.bm.truncate(table, len(tokens))
        self.bm.commit(table, tokens, len(tokens), has_draft_kv)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        table, _, _ = self.seqs.pop(i % len(self.seqs))
        self.bm.free(table)

    @invariant()
    def consistent(self):
        self.bm.check_invariants([t for t, _, _ in self.seqs])
        assert self.bm.draft_kv_blocks <= self.draft_written
        for table, tokens, _ in self.seqs:
            assert len(table.block_ids) == -(-len(tokens) // 4)

    def teardown(self):
        for table, _, _ in self.seqs:
            self.bm.free(table)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
