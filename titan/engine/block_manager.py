"""Paged KV cache bookkeeping: block tables, free list, reference counts and prefix caching.

A full block is identified by a hash chained over its parent's hash and its own token ids, so equal
prefixes map to equal blocks. Blocks are shared by reference count; a block whose count drops to zero
keeps its cached content and waits in the free list (least recently used first) until a new allocation
needs it.

The hash is SHA-256, not Python's `hash()`: a tuple hash of small ints can be steered to collide, and a
prompt crafted to collide would publish its blocks under another prompt's hash, so every later request
with that prefix would read its K/V (the class of vLLM's CVE-2025-25183). A sequence's `cache_salt` seeds
its chain: requests with different salts (tenants) never share blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Tokens

from titan.engine.sequence import Sequence

# Token ids as 4-byte unsigned integers: every vocabulary fits, and the bytes of a block are fixed-size.
_TOKEN_CODE = "I" if array("I").itemsize == 4 else "L"


def chain_root(cache_salt: str | None) -> bytes:
    """The parent digest of a sequence's first block."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"titan-cache-salt\0" + cache_salt.encode()).digest()


def chain_hash(parent: bytes, token_ids: Tokens[int]) -> bytes:
    """The digest of a full block after `parent`'s: equal only for equal token prefixes (and salts)."""
    return hashlib.sha256(parent + array(_TOKEN_CODE, token_ids).tobytes()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is reused first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.cache_version = 0  # changes whenever hash_to_block does: lookups made before may be stale
        # Per sequence: how many of its full blocks are registered in the prefix cache.
        self.num_registered_blocks: dict[int, int] = {}
        # Full prompt blocks a running sequence has still to publish (hash → seq_id): a request that
        # shares them waits for them instead of computing them a second time.
        self.in_flight: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole cache holds: the most one sequence can ever hold."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached but unreferenced blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache ------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Extend the sequence's chained block hashes to cover `num_full_blocks` blocks."""
        hashes = seq.block_hashes
        size = self.block_size
        for index in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else chain_root(seq.cache_salt)
            hashes.append(chain_hash(parent, seq.token_ids_slice(index * size, (index + 1) * size)))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq` (takes no references).

        At least one token is always left to compute, because sampling needs its logits.
        """
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for block_hash in self._block_hashes(seq, seq.num_tokens // self.block_size):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        if len(found) * self.block_size >= seq.num_tokens:
            found.pop()
        return found

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks whose K/V are written: call after the step that computed
        them returned. Registering earlier (when the step is only scheduled) would let a later request
        "hit" blocks that a preemption, an abort or a failed step left unwritten."""
        if not self.enable_prefix_caching:
            return
        start = self.num_registered_blocks.get(seq.seq_id, 0)
        # Computed positions past the last token (drafts after a stop token) have no token to hash.
        end = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        if end <= start:
            return
        hashes = self._block_hashes(seq, end)
        for index in range(start, end):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and hashes[index] not in self.hash_to_block:
                block.block_hash = hashes[index]
                self.hash_to_block[hashes[index]] = block.block_id
                self.cache_version += 1
            if self.in_flight.get(hashes[index]) == seq.seq_id:
                del self.in_flight[hashes[index]]
        self.num_registered_blocks[seq.seq_id] = end

    # ---- allocation --------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                self.cache_version += 1
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        total_blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        held = len(seq.block_table) + len(cached_blocks)
        reclaimed = sum(1 for block_id in cached_blocks if self.blocks[block_id].ref_count == 0)
        return total_blocks - held <= self.num_free_blocks - reclaimed

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make `seq.block_table` cover `num_new_tokens` more tokens; False (and no change) if it can't.

        `cached_blocks` (from `find_cached_prefix`, for a sequence with no blocks yet) are shared, and
        `seq.num_computed_tokens` must already count their tokens.
        """
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        if cached_blocks:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached_blocks) * self.block_size
        elif not seq.block_table and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_blocks:
            self.num_registered_blocks[seq.seq_id] = len(cached_blocks)
        total_tokens = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < cdiv(total_tokens, self.block_size):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching:
            # The whole prompt's full blocks: a request sharing them trails this one chunk by chunk.
            first = self.num_registered_blocks.get(seq.seq_id, 0)
            last = seq.num_prompt_tokens // self.block_size
            for block_hash in self._block_hashes(seq, last)[first:last]:
                if block_hash not in self.hash_to_block:
                    self.in_flight.setdefault(block_hash, seq.seq_id)
        return True

    def computing_elsewhere(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether the block right after `seq`'s cached prefix is being computed by another sequence."""
        if not self.in_flight or (num_cached_blocks + 1) * self.block_size >= seq.num_tokens:
            return False
        block_hash = self._block_hashes(seq, num_cached_blocks + 1)[num_cached_blocks]
        owner = self.in_flight.get(block_hash)
        return owner is not None and owner != seq.seq_id

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` positions (rejected drafts' K/V). They were
        never published, so they go to the front of the free list."""
        keep = cdiv(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. Tail blocks go first in line for reuse: they are the least
        likely to be shared; blocks without cached content go to the very front."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        self.num_registered_blocks.pop(seq.seq_id, None)
        self._forget_in_flight(seq)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block joins the free list (at the front without cached content)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.block_hash is None:
                self.free_blocks.move_to_end(block_id, last=False)

    def _forget_in_flight(self, seq: Sequence) -> None:
        """A preempted or finished sequence computes none of its unpublished blocks any more."""
        if self.in_flight:
            for block_hash in seq.block_hashes:
                if self.in_flight.get(block_hash) == seq.seq_id:
                    del self.in_flight[block_hash]
