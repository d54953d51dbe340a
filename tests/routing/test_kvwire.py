"""vLLM's KV event batches as bytes: MessagePack read and written, both forms of the batch."""

from __future__ import annotations

import pytest

from muxproxy.routing.kvindex import AllBlocksCleared, BlockRemoved, BlockStored
from muxproxy.routing.kvwire import (
    UNMATCHABLE_MEDIUM,
    WireError,
    decode_batch,
    encode_batch,
    pack,
    unpack,
)


@pytest.mark.parametrize(
    ("data", "value"),
    [
        (b"\xc0", None),
        (b"\xc3", True),
        (b"\x7f", 127),
        (b"\xff", -1),
        (b"\xcc\xc8", 200),
        (b"\xcd\x01\x00", 256),
        (b"\xd0\x80", -128),
        (b"\xcf" + (2**63 + 1).to_bytes(8, "big"), 2**63 + 1),
        (b"\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00", 1.5),
        (b"\xa3abc", "abc"),
        (b"\xd9\x03abc", "abc"),
        (b"\xc4\x02\x00\x01", b"\x00\x01"),
        (b"\x92\x01\xa1x", [1, "x"]),
        (b"\x81\xa2ts\x01", {"ts": 1}),
        (b"\xdc\x00\x01\xc2", [False]),
    ],
)
def test_unpack_reads_each_messagepack_type(data: bytes, value: object) -> None:
    assert unpack(data) == value


@pytest.mark.parametrize(
    "value",
    [
        None,
        False,
        0,
        127,
        128,
        -1,
        -33,
        2**64 - 1,
        -(2**63),
        0.25,
        "",
        "é" * 40,
        b"\x00" * 300,
        list(range(20)),
        {"a": [1, {"b": None}]},
    ],
)
def test_pack_then_unpack_gives_the_value_back(value: object) -> None:
    assert unpack(pack(value)) == value


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x92\x01", "truncated"),
        (b"\xa5ab", "truncated"),
        (b"\x01\x02", "after the value"),
        (b"\xc1", "unsupported"),
        (b"\xd4\x00\x00", "unsupported"),  # ext: never sent by vLLM
        (b"\x91" * 40 + b"\x01", "deeper"),
        (b"\xa2\xff\xfe", "UTF-8"),
        (b"\xdd\xff\xff\xff\xff", "truncated"),  # a huge length is refused before any work
    ],
)
def test_unpack_refuses_bad_bytes_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        unpack(data)


STORED = BlockStored(
    block_hashes=(b"\x01" * 32, b"\x02" * 32),
    parent_block_hash=None,
    token_ids=tuple(range(32)),
    block_size=16,
)


def test_batch_round_trips_in_the_map_form() -> None:
    events = (STORED, BlockRemoved(block_hashes=(b"\x01" * 32,)), AllBlocksCleared())
    batch = decode_batch(encode_batch(12.5, events, data_parallel_rank=1))
    assert batch.ts == 12.5
    assert batch.events == events
    assert batch.data_parallel_rank == 1
    assert batch.skipped == 0


def test_batch_in_the_array_form_of_older_vllm() -> None:
    payload = pack(
        [
            3.0,
            [
                ["BlockStored", [7, -8], None, list(range(8)), 4, None, None],
                ["BlockStored", [9], -8, [1, 2, 3, 4], 4],  # trailing defaults left out
                ["BlockRemoved", [7], None],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.events[0] == BlockStored(
        block_hashes=(7, -8), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4
    )
    assert batch.events[1] == BlockStored(
        block_hashes=(9,), parent_block_hash=-8, token_ids=(1, 2, 3, 4), block_size=4
    )
    assert batch.events[2:] == (BlockRemoved(block_hashes=(7,)), AllBlocksCleared())
    assert batch.data_parallel_rank is None


def test_blocks_that_tokens_alone_do_not_name_are_set_apart_or_skipped() -> None:
    base = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
    }
    payload = pack(
        {
            "ts": 1.0,
            "events": [
                base | {"extra_keys": [["salt"]]},  # hashed with a cache salt
                base | {"extra_keys": [None]},  # no extra key: a plain block
                base | {"group_idx": 1},  # a hybrid model's other group
                {"type": "BlockStored", "block_hashes": [1], "token_ids": ["x"]},
                {"type": "Unknown"},
                "junk",
            ],
        }
    )
    batch = decode_batch(payload)
    assert [event.medium for event in batch.events] == [UNMATCHABLE_MEDIUM, None]  # type: ignore[union-attr]
    assert batch.skipped == 4


@pytest.mark.parametrize(
    "value", [[], [1.0], {"ts": "x", "events": []}, {"ts": 1.0}, "batch", [1.0, {}]]
)
def test_a_payload_that_is_no_batch_is_refused(value: object) -> None:
    with pytest.raises(WireError):
        decode_batch(pack(value))
