"""The per-engine index of cached blocks, fed by KV-cache events, and placement by it."""

from __future__ import annotations

import pytest

from muxproxy.routing.kvindex import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlocks,
    best_cached,
    block_keys,
)
from muxproxy.routing.load import within_bounds

SIZE = 4
SYSTEM = tuple(range(100, 108))  # two blocks
QUESTION = tuple(range(200, 206))  # one block and a partial one


def stored(
    hashes: list[int], parent: int | None, tokens: tuple[int, ...], **extra: object
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=SIZE,
        **extra,  # type: ignore[arg-type]
    )


def engine_with_system_and_question() -> EngineBlocks:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(stored([11, 12], None, SYSTEM))
    engine.apply(stored([13], 12, QUESTION[:SIZE]))
    return engine


def test_block_keys_chain_whole_blocks_only() -> None:
    keys = block_keys(SYSTEM + QUESTION, SIZE)
    assert len(keys) == 3  # 14 tokens: three full blocks of 4, two tokens left over
    # The same tokens after another prefix are another block.
    assert block_keys(QUESTION[:SIZE], SIZE)[0] != keys[2]
    # A LoRA adapter's blocks are apart from the base model's.
    assert block_keys(SYSTEM, SIZE, lora_id=3) != keys[:2]


def test_stored_chain_scores_the_longest_cached_prefix() -> None:
    engine = engine_with_system_and_question()
    assert len(engine) == 3
    assert engine.cached_tokens(SYSTEM + QUESTION) == 12
    assert engine.cached_tokens((*SYSTEM, 1, 2, 3, 4)) == 8
    assert engine.cached_tokens((1, 2, 3, 4, *SYSTEM)) == 0
    assert engine.cached_tokens(SYSTEM[:3]) == 0  # not one whole block


def test_removed_block_ends_the_prefix_there() -> None:
    engine = engine_with_system_and_question()
    engine.apply(BlockRemoved(block_hashes=(12,)))
    # The first block is still there; the third is unreachable without the second.
    assert engine.cached_tokens(SYSTEM + QUESTION) == 4
    assert len(engine) == 2


def test_all_blocks_cleared_forgets_everything() -> None:
    engine = engine_with_system_and_question()
    engine.apply(AllBlocksCleared())
    assert len(engine) == 0
    assert engine.cached_tokens(SYSTEM + QUESTION) == 0
    # A block stored after the clear whose parent went with it is an orphan.
    engine.apply(stored([14], 13, QUESTION[:SIZE]))
    assert engine.orphans == 1
    assert len(engine) == 0


def test_block_with_unknown_parent_is_skipped_and_counted() -> None:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(stored([21, 22], 99, SYSTEM))
    assert engine.orphans == 2
    assert engine.cached_tokens(SYSTEM) == 0


def test_cap_forgets_the_block_stored_longest_ago() -> None:
    engine = EngineBlocks(max_blocks=2)
    engine.apply(stored([11, 12], None, SYSTEM))
    engine.apply(stored([31], None, QUESTION[:SIZE]))
    assert len(engine) == 2
    assert engine.forgotten == 1
    assert engine.cached_tokens(SYSTEM) == 0  # its first block went first
    assert engine.cached_tokens(QUESTION) == 4
    # The forgotten hash is gone from the hash map too: removing it changes nothing.
    engine.apply(BlockRemoved(block_hashes=(11,)))
    assert len(engine) == 2


def test_the_same_tokens_stored_again_are_one_block() -> None:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(stored([11, 12], None, SYSTEM))
    engine.apply(stored([41, 42], None, SYSTEM))  # recomputed after an eviction we missed
    assert len(engine) == 2
    engine.apply(BlockRemoved(block_hashes=(11, 12)))  # the old hashes name nothing now
    assert engine.cached_tokens(SYSTEM) == 8
    engine.apply(BlockRemoved(block_hashes=(41,)))
    assert engine.cached_tokens(SYSTEM) == 0


def test_other_media_and_malformed_events_are_ignored() -> None:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(stored([11, 12], None, SYSTEM, medium="CPU"))
    assert len(engine) == 0
    engine.apply(stored([11, 12], None, SYSTEM[:7]))  # 7 tokens for two blocks of 4
    assert engine.malformed == 1
    assert len(engine) == 0
    engine.apply(stored([11, 12], None, SYSTEM, medium="GPU"))
    engine.apply(BlockRemoved(block_hashes=(11, 12), medium="CPU"))
    assert engine.cached_tokens(SYSTEM) == 8


def test_lora_blocks_score_only_for_their_adapter() -> None:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(stored([11, 12], None, SYSTEM, lora_id=7))
    assert engine.cached_tokens(SYSTEM) == 0
    assert engine.cached_tokens(SYSTEM, lora_id=7) == 8


def test_bytes_hashes_as_vllm_sends_them() -> None:
    engine = EngineBlocks(max_blocks=100)
    engine.apply(
        BlockStored(
            block_hashes=(b"\x01" * 32, b"\x02" * 32),
            parent_block_hash=None,
            token_ids=SYSTEM,
            block_size=SIZE,
        )
    )
    engine.apply(
        BlockStored(
            block_hashes=(b"\x03" * 32,),
            parent_block_hash=b"\x02" * 32,
            token_ids=QUESTION[:SIZE],
            block_size=SIZE,
        )
    )
    assert engine.cached_tokens(SYSTEM + QUESTION) == 12


def test_empty_engine_scores_nothing() -> None:
    assert EngineBlocks(max_blocks=1).cached_tokens(SYSTEM) == 0
    with pytest.raises(ValueError):
        EngineBlocks(max_blocks=0)


@pytest.mark.parametrize(
    ("order", "cached", "expected"),
    [
        ([0, 1, 2], [(2, 64)], [2, 0, 1]),  # the holder goes first
        ([0, 1, 2], [(1, 32), (2, 64)], [2, 0, 1]),  # the longest prefix wins
        ([2, 0, 1], [(0, 32), (1, 32)], [0, 2, 1]),  # a tie keeps the order's first
        ([0, 1, 2], [], [0, 1, 2]),  # nothing cached: unchanged
        ([1, 0, 2], [(1, 16)], [1, 0, 2]),  # already first
    ],
)
def test_best_cached_moves_the_longest_prefix_first(
    order: list[int], cached: list[tuple[int, int]], expected: list[int]
) -> None:
    assert best_cached(order, cached) == expected


def test_best_cached_never_moves_a_server_past_its_load_bound() -> None:
    weights = [1, 1, 1]
    streams = [0, 0, 6]  # server 2 holds the prefix but runs far more than its share
    within = within_bounds(weights, streams, [0, 1, 2], factor=1.25)
    assert not within(2)
    assert best_cached([0, 1, 2], [(2, 64), (1, 16)], within) == [1, 0, 2]
    assert best_cached([0, 1, 2], [(2, 64)], within) == [0, 1, 2]
