"""Block bookkeeping for the paged KV pool. Knows nothing about tensors or the model.

One block id addresses storage in every layer of the target *and* the draft model, so one
block table per sequence serves both. A full block of committed tokens is named by a chain
hash (its tokens + its parent's hash) so a later request with the same prefix reuses it.

Block states:
    in use        ref_count > 0 (maybe hashed, maybe shared by several sequences)
    cached free   ref_count == 0, hashed: reusable by hash, evicted LRU when the pool runs dry
    free          ref_count == 0, not hashed

Two commit horizons. A block is committed (hashed, shareable) as soon as the target's KV for
its tokens is valid, whatever the request's speculation method. Whether the draft model's KV
is valid too is a mark on the block (`draft_kv_blocks`), set by `mark_draft_kv` when a draft
has computed the whole block, never a condition for committing it. Every request attaches
every hashed block of its prefix; a request that runs the draft model brings the draft up to
date from the first unmarked block (`draft_kv_prefix`). Draft KV written into a hashed block
is a function of the block's tokens and its prefix (the hash), so any holder writing it writes
the same values; a mark therefore stays true while the hash lives and goes with it (eviction,
takeover). When a request marks a block whose hash names another, unmarked block, its own block
takes over the hash, so draft requests find the draft KV; the old block keeps its contents for
whoever holds it and is freed, not cached, later.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class BlockTable:
    """A sequence's view of the pool: its block ids and how many leading blocks are hashed."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # one per leading full, committed block
    num_draft_checked: int = 0  # leading blocks mark_draft_kv has handled (marked, or marked elsewhere)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent_hash or b"root", digest_size=16)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.block_to_hash: dict[int, bytes] = {}
        self.draft_kv_blocks: set[int] = set()  # hashed blocks whose draft-model KV is valid too
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    def num_blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Extra blocks `table` needs to hold `num_tokens` tokens in all."""
        return max(0, -(-num_tokens // self.block_size) - len(table.block_ids))

    # -- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Attach the longest cached run of full blocks of `token_ids` to an empty table.

        Returns the number of tokens whose target KV is already in the pool (draft_kv_prefix
        says how many of them have draft KV too). At least one token is always left to compute
        (the model must produce logits for the last one), so a prompt that is all full cached
        blocks gives back its last block.
        """
        assert not table.block_ids
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        parent = None
        for i in range(max_blocks):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            self._ref(block_id)
            table.block_ids.append(block_id)
            table.block_hashes.append(h)
            parent = h
        num_cached = len(table.block_ids) * bs
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += num_cached
        return num_cached

    def draft_kv_prefix(self, table: BlockTable) -> int:
        """Tokens at the start of `table` whose draft-model KV is in the pool: its leading run
        of marked blocks."""
        num_blocks = 0
        while num_blocks < len(table.block_hashes) and table.block_ids[num_blocks] in self.draft_kv_blocks:
            num_blocks += 1
        return num_blocks * self.block_size

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_committed: int) -> None:
        """Hash the full blocks among the first `num_committed` tokens (verified, target KV
        computed) so later requests can share them. Never call it with draft tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.block_hashes), num_committed // bs):
            parent = table.block_hashes[-1] if table.block_hashes else None
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            table.block_hashes.append(h)
            block_id = table.block_ids[i]
            if block_id not in self.block_to_hash and h not in self.hash_to_block:
                self.hash_to_block[h] = block_id
                self.block_to_hash[block_id] = h

    def mark_draft_kv(self, table: BlockTable, num_tokens: int) -> None:
        """The draft model's KV is valid for the first `num_tokens` tokens of `table`: mark its
        committed blocks among them (taking over a hash whose block has no mark)."""
        if not self.enable_prefix_caching:
            return
        for i in range(table.num_draft_checked, min(num_tokens // self.block_size, len(table.block_hashes))):
            block_id, h = table.block_ids[i], table.block_hashes[i]
            registered = self.hash_to_block.get(h)
            if registered not in (None, block_id) and registered not in self.draft_kv_blocks:
                self._unhash(registered)  # ours has draft KV too: take over the hash
                registered = None
            if registered is None:
                self.hash_to_block[h] = block_id
                self.block_to_hash[block_id] = h
                registered = block_id
            if registered == block_id:
                self.draft_kv_blocks.add(block_id)
            table.num_draft_checked = i + 1

    # -- allocate / truncate / free -------------------------------------------------------
    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow `table` to hold `num_tokens` tokens. All or nothing: False if the pool is short."""
        needed = self.num_blocks_needed(table, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.block_ids.append(self._take_free_block())
        return True

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep the blocks covering the first `num_tokens` tokens; release the rest.

        Rollback of rejected drafts is this call: an integer, no tensor copy. Stale slots
        in the kept last block are simply overwritten by the next write.
        """
        keep = -(-num_tokens // self.block_size)
        assert keep >= len(table.block_hashes), "truncating into committed (hashed) blocks"
        while len(table.block_ids) > keep:
            self._unref(table.block_ids.pop())

    def free(self, table: BlockTable) -> None:
        """Release every block, last first, so the tail of a sequence is evicted first."""
        while table.block_ids:
            self._unref(table.block_ids.pop())
        table.block_hashes.clear()
        table.num_draft_checked = 0

    # -- internals ------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if not self.free_ids:  # evict the least recently used cached block
            self._unhash(next(iter(self.cached_free)))
        block_id = self.free_ids.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def _unhash(self, block_id: int) -> None:
        """Forget block_id's hash; if it was cached free it becomes plain free."""
        del self.hash_to_block[self.block_to_hash.pop(block_id)]
        self.draft_kv_blocks.discard(block_id)
        if block_id in self.cached_free:
            del self.cached_free[block_id]
            self.free_ids.append(block_id)

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.cached_free[block_id]
        self.ref_counts[block_id] += 1

    def _unref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            if block_id in self.block_to_hash:
                self.cached_free[block_id] = None
            else:
                self.free_ids.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (e.g. after the pool's contents became invalid)."""
        for block_id in list(self.cached_free):
            self._unhash(block_id)

    def check_invariants(self, tables: Sequence[BlockTable] = ()) -> None:
        """Free, cached-free and in-use blocks partition the pool; ref counts match `tables`
        (pass every live table); the hash maps are mutual inverses."""
        free = set(self.free_ids)
        cached = set(self.cached_free)
        assert len(free) == len(self.free_ids), "duplicate id in free list"
        assert not free & cached
        in_use = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not in_use & (free | cached)
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "a block leaked"
        assert all(self.block_to_hash.get(b) is None for b in free)
        assert all(b in self.block_to_hash for b in cached)
        assert {v: k for k, v in self.hash_to_block.items()} == self.block_to_hash
        assert self.draft_kv_blocks <= self.block_to_hash.keys(), "draft-KV mark on an unhashed block"
        if tables:
            counts = [0] * self.num_blocks
            for t in tables:
                for b in t.block_ids:
                    counts[b] += 1
            assert counts == self.ref_counts, "ref counts disagree with block tables"
