"""Block manager: reference counts, free list, prefix caching and eviction — no model needed."""

from titan.engine.block_manager import BlockManager, chain_hash, chain_root
from titan.engine.sampling_params import SamplingParams
from titan.engine.sequence import Sequence


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=8))


def computed(manager: BlockManager, seq: Sequence, num_tokens: int) -> bool:
    """Allocate, then do what the engine does once the step that wrote those tokens returned."""
    if not manager.allocate(seq, num_tokens):
        return False
    seq.num_computed_tokens += num_tokens
    manager.commit(seq)
    return True


def test_blocks_are_published_only_at_commit() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert manager.allocate(seq, 10)
    assert manager.find_cached_prefix(make_seq(list(range(12)))) == []  # scheduled, not yet written
    seq.num_computed_tokens = 10
    manager.commit(seq)
    assert manager.find_cached_prefix(make_seq(list(range(12)))) == seq.block_table[:2]


def test_allocate_and_free_restore_every_block() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert manager.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert manager.num_free_blocks == 5
    assert all(manager.blocks[b].ref_count == 1 for b in seq.block_table)
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_allocation_fails_without_side_effects_when_pool_is_short() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not manager.allocate(seq, 12)
    assert seq.block_table == []
    assert manager.num_free_blocks == 2


def test_growth_allocates_a_block_only_at_block_boundaries() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq([1, 2, 3])
    assert manager.allocate(seq, 3)
    seq.num_computed_tokens = 3
    seq.output_token_ids.append(9)
    assert manager.allocate(seq, 1)  # 4 tokens still fit in one block
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    seq.output_token_ids.append(10)
    assert manager.allocate(seq, 1)
    assert len(seq.block_table) == 2


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(10)))  # two full blocks + 2 tokens
    assert computed(manager, first, 10)
    second = make_seq(list(range(8)) + [77, 78, 79])
    cached = manager.find_cached_prefix(second)
    assert cached == first.block_table[:2]
    second.num_computed_tokens = 8
    assert manager.allocate(second, 3, cached)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [manager.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    assert manager.prefix_cache_hits == 8
    assert manager.prefix_cache_queries == 10 + 11
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 16
    assert all(block.ref_count == 0 for block in manager.blocks)


def test_full_prefix_hit_leaves_a_token_to_compute() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(8)))
    assert computed(manager, first, 8)
    twin = make_seq(list(range(8)))
    cached = manager.find_cached_prefix(twin)
    assert len(cached) == 1  # the last block is recomputed so that sampling has logits


def test_freed_cached_blocks_are_reused_until_evicted_least_recently_used_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    assert computed(manager, old, 5)
    old_table = list(old.block_table)
    manager.free(old)
    assert manager.num_free_blocks == 4
    # The partial block (no cached content) is reused first; cached blocks survive.
    other = make_seq([9])
    assert computed(manager, other, 1)
    assert other.block_table == [old_table[2]]
    again = make_seq([1, 2, 3, 4, 6])
    assert len(manager.find_cached_prefix(again)) == 2
    # Now demand every block: the cached ones get evicted and the cache forgets them.
    big = make_seq(list(range(100, 106)))
    assert computed(manager, big, 6)
    assert manager.find_cached_prefix(again) == []
    assert manager.hash_to_block == {
        manager.blocks[b].block_hash: b for b in big.block_table if manager.blocks[b].block_hash is not None
    }


def test_cache_version_changes_whenever_a_lookup_could_answer_differently() -> None:
    """The scheduler keeps a waiting prompt's cache hit for the rest of a step while this version holds."""
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5])
    version = manager.cache_version
    assert manager.allocate(seq, 5) and manager.cache_version == version  # scheduled, nothing published
    seq.num_computed_tokens = 5
    manager.commit(seq)
    assert manager.cache_version > version  # two blocks published
    version = manager.cache_version
    manager.free(seq)
    assert manager.cache_version == version  # freed, still cached
    probe = make_seq([1, 2, 3, 4, 6])
    assert len(manager.find_cached_prefix(probe)) == 2
    big = make_seq(list(range(100, 108)))
    assert manager.allocate(big, 8)  # every block: the cached ones are evicted
    assert manager.cache_version > version and manager.find_cached_prefix(probe) == []


def test_prefix_caching_disabled_finds_nothing() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_seq(list(range(8)))
    assert computed(manager, first, 8)
    assert manager.find_cached_prefix(make_seq(list(range(9)))) == []
    assert manager.hash_to_block == {}


def test_hash_chains_over_parent_so_equal_blocks_at_different_depths_differ() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    first = make_seq([1, 2, 3, 4, 0])
    assert computed(manager, first, 5)
    # [3, 4] is cached, but only after [1, 2]; a prompt starting with [3, 4] must miss.
    assert manager.find_cached_prefix(make_seq([3, 4, 5])) == []
    assert len(manager.find_cached_prefix(make_seq([1, 2, 3, 4, 9]))) == 2


def test_cache_salt_seeds_the_hash_chain() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    owner = Sequence(tokens, SamplingParams(max_tokens=8), cache_salt="a")
    assert computed(manager, owner, 9)
    assert manager.find_cached_prefix(Sequence(tokens, SamplingParams(), cache_salt="a")) == owner.block_table[:2]
    assert manager.find_cached_prefix(Sequence(tokens, SamplingParams(), cache_salt="b")) == []
    assert manager.find_cached_prefix(make_seq(tokens)) == []
    # SHA-256 over the parent's digest and the block's token ids (Python's hash() can be made to collide).
    first = chain_hash(chain_root("a"), tokens[:4])
    assert owner.block_hashes == [first, chain_hash(first, tokens[4:8])] and len(first) == 32
    assert chain_root(None) == b"" and chain_hash(b"", [1, 2]) != chain_hash(b"", [2, 1])
