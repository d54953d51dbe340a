"""One engine's subscription state: messages applied, gaps and bad messages counted, trust."""

from __future__ import annotations

from muxproxy.routing.kvfeed import EngineFeed, place_by_cache
from muxproxy.routing.kvindex import BlockStored, EngineBlocks
from muxproxy.routing.kvwire import encode_batch

TOKENS = tuple(range(8))


def message(sequence: int, first: int = 1) -> list[bytes]:
    stored = BlockStored(
        block_hashes=(first, first + 1), parent_block_hash=None, token_ids=TOKENS, block_size=4
    )
    return [b"kv-events", sequence.to_bytes(8, "big"), encode_batch(1.0, [stored])]


def feed() -> EngineFeed:
    return EngineFeed(EngineBlocks(max_blocks=100), stale_after=5.0)


def test_messages_in_sequence_fill_the_index() -> None:
    state = feed()
    state.up(0.0)
    assert state.message(message(0), 1.0) is None
    assert state.message(message(1, first=10), 2.0) is None
    assert state.blocks.cached_tokens(TOKENS) == 8
    assert (state.batches, state.gaps, state.bad) == (1 + 1, 0, 0)


def test_a_sequence_gap_is_counted_and_said_and_the_batch_still_applied() -> None:
    state = feed()
    state.message(message(0), 1.0)
    note = state.message(message(5, first=10), 2.0)
    assert note is not None and "sequence 5 after 0" in note
    assert state.gaps == 1
    assert len(state.blocks) == 2  # the same tokens under the new hashes


def test_bad_messages_are_refused_with_a_reason() -> None:
    state = feed()
    assert "frames" in (state.message([b"kv-events", b"x"], 1.0) or "")
    assert "frames" in (state.message([b"other", b"\x00" * 8, b"\x90"], 1.0) or "")
    assert "unreadable" in (state.message([b"kv-events", b"\x00" * 8, b"\xc1"], 1.0) or "")
    assert state.bad == 3
    assert len(state.blocks) == 0


def test_trusted_while_connected_and_while_busy_only_if_fresh() -> None:
    state = feed()
    assert not state.usable(0.0, busy=False)  # never connected
    state.up(0.0)
    assert state.usable(100.0, busy=False)  # idle engines publish nothing
    assert not state.usable(100.0, busy=True)  # busy and silent for 100 s
    state.message(message(0), 98.0)
    assert state.usable(100.0, busy=True)
    state.down()
    assert not state.usable(100.0, busy=False)
    assert state.blocks.cached_tokens(TOKENS) == 8  # kept across the drop


def fleet() -> dict[int, EngineFeed]:
    """Three engines: 1 holds TOKENS (connected), 2 holds them but its feed dropped."""
    feeds = {index: feed() for index in range(3)}
    for index in (0, 1, 2):
        feeds[index].up(0.0)
    feeds[1].message(message(0), 1.0)
    feeds[2].message(message(0), 1.0)
    feeds[2].down()
    return feeds


def idle(index: int) -> bool:
    return False


def test_placement_moves_the_trusted_holder_first() -> None:
    assert place_by_cache([0, 2, 1], fleet(), TOKENS, 2.0, idle) == [1, 0, 2]


def test_placement_ignores_a_dropped_or_silent_busy_feed() -> None:
    feeds = fleet()
    del feeds[1]
    assert place_by_cache([0, 2, 1], feeds, TOKENS, 2.0, idle) == [0, 2, 1]  # 2 dropped
    feeds = fleet()
    # 1 is busy and has said nothing for longer than stale_after: the prefix key stands.
    assert place_by_cache([0, 2, 1], feeds, TOKENS, 60.0, lambda index: True) == [0, 2, 1]


def test_placement_without_tokens_or_within_bounds_keeps_the_order() -> None:
    assert place_by_cache([0, 2, 1], fleet(), None, 2.0, idle) == [0, 2, 1]
    assert place_by_cache([0, 2, 1], fleet(), TOKENS, 2.0, idle, lambda index: index != 1) == [
        0,
        2,
        1,
    ]
