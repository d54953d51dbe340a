"""The bytes of vLLM's KV-cache event batches: MessagePack, decoded into ``kvindex`` events.

Obeys the routing rules: pure code, standard library only, no I/O. The ZeroMQ transport that
carries these payloads is ``muxproxy/trio/zmtp.py``'s.

What it obeys: the MessagePack specification (msgpack/spec.md: every type but ``ext``, which
vLLM never sends), and vLLM's ``vllm/distributed/kv_events.py``, whose publisher encodes a
``KVEventBatch(ts, events, data_parallel_rank)`` with msgspec. The events are tagged structs
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). vLLM has sent them two ways, and
both are read:

* as maps (current vLLM): ``{"ts": .., "events": [{"type": "BlockStored", "block_hashes":
  .., ..}], "data_parallel_rank": 0}``, msgspec's default tag field ``type``, fields left out
  when they hold their default;
* as arrays (``array_like=True``, vLLM before 0.11): ``[ts, [["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium], ..]]``, the tag first and the
  fields in declaration order, trailing defaults left out.

A block hash is bytes (vLLM's ``ExternalBlockHash`` since 0.11) or an int (before). Fields
the index does not use (``lora_name``, ``kv_cache_spec_kind``, ..) are skipped. Two fields
change what a block is: a block with ``extra_keys`` (multimodal inputs, a cache salt, a
LoRA name: vLLM hashes them in) is stored under a medium the index never matches (a request
known only by its tokens cannot claim it), and a ``group_idx`` above 0 (a hybrid model's
other KV-cache groups) is skipped: the index follows the first group only.

Errors are the peer's: :class:`WireError`, with what was wrong. A batch with one bad event
loses that event only (counted by the caller from :func:`decode_batch`'s ``skipped``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import attrs

from muxproxy.routing.kvindex import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

__all__ = ["Batch", "WireError", "decode_batch", "encode_batch", "pack", "unpack"]

MAX_DEPTH = 16
"""Nesting deeper than a batch ever is (batch, events, event, hashes) by a margin."""

UNMATCHABLE_MEDIUM = "muxproxy:extra-keys"
"""The medium given to blocks hashed with extra keys: never the device's, never matched."""


class WireError(ValueError):
    """The payload is not MessagePack, or not a KV event batch."""


# --- MessagePack -------------------------------------------------------------------------

_FIXED = {
    0xC0: None,
    0xC2: False,
    0xC3: True,
}
_SIZED = {  # marker -> (struct format of the length, kind)
    0xC4: (">B", "bin"),
    0xC5: (">H", "bin"),
    0xC6: (">I", "bin"),
    0xD9: (">B", "str"),
    0xDA: (">H", "str"),
    0xDB: (">I", "str"),
    0xDC: (">H", "array"),
    0xDD: (">I", "array"),
    0xDE: (">H", "map"),
    0xDF: (">I", "map"),
}
_NUMBERS = {
    0xCA: ">f",
    0xCB: ">d",
    0xCC: ">B",
    0xCD: ">H",
    0xCE: ">I",
    0xCF: ">Q",
    0xD0: ">b",
    0xD1: ">h",
    0xD2: ">i",
    0xD3: ">q",
}


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise WireError(f"truncated: {size} bytes wanted at offset {self.at}")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def number(self, fmt: str) -> object:
        value: object = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def value(self, depth: int = 0) -> object:
        if depth > MAX_DEPTH:
            raise WireError(f"nested deeper than {MAX_DEPTH}")
        marker = self.take(1)[0]
        if marker <= 0x7F:
            return marker
        if marker >= 0xE0:
            return marker - 0x100
        if 0x80 <= marker <= 0x8F:
            return self.map(marker & 0x0F, depth)
        if 0x90 <= marker <= 0x9F:
            return self.array(marker & 0x0F, depth)
        if 0xA0 <= marker <= 0xBF:
            return self.text(marker & 0x1F)
        if marker in _FIXED:
            return _FIXED[marker]
        if marker in _NUMBERS:
            return self.number(_NUMBERS[marker])
        if marker in _SIZED:
            fmt, kind = _SIZED[marker]
            size = self.number(fmt)
            assert isinstance(size, int)
            if kind == "bin":
                return self.take(size)
            if kind == "str":
                return self.text(size)
            if kind == "array":
                return self.array(size, depth)
            return self.map(size, depth)
        raise WireError(f"unsupported MessagePack marker 0x{marker:02x}")

    def text(self, size: int) -> str:
        try:
            return self.take(size).decode()
        except UnicodeDecodeError as error:
            raise WireError(f"a string is not UTF-8: {error}") from None

    def array(self, size: int, depth: int) -> list[object]:
        if size > len(self.data) - self.at:  # each item is one byte at least
            raise WireError(f"truncated: an array of {size} items")
        return [self.value(depth + 1) for _ in range(size)]

    def map(self, size: int, depth: int) -> dict[object, object]:
        if 2 * size > len(self.data) - self.at:
            raise WireError(f"truncated: a map of {size} entries")
        result: dict[object, object] = {}
        for _ in range(size):
            key = self.value(depth + 1)
            if not isinstance(key, (str, int, bytes)):
                raise WireError(f"a map key of type {type(key).__name__}")
            result[key] = self.value(depth + 1)
        return result


def unpack(data: bytes) -> object:
    """One MessagePack value filling ``data``; raises :class:`WireError`."""
    reader = _Reader(data)
    value = reader.value()
    if reader.at != len(data):
        raise WireError(f"{len(data) - reader.at} bytes after the value")
    return value


def pack(value: object) -> bytes:
    """``value`` (None, bool, int, float, str, bytes, lists, tuples, dicts) as MessagePack."""
    out = bytearray()
    _pack(value, out)
    return bytes(out)


def _pack(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xC0)
    elif value is True or value is False:
        out.append(0xC3 if value else 0xC2)
    elif isinstance(value, int):
        if 0 <= value <= 0x7F or -32 <= value < 0:
            out += struct.pack(">b" if value < 0 else ">B", value)
        elif 0 <= value < 1 << 64:
            out += b"\xcf" + struct.pack(">Q", value)
        elif -(1 << 63) <= value < 0:
            out += b"\xd3" + struct.pack(">q", value)
        else:
            raise ValueError(f"an integer beyond 64 bits: {value}")
    elif isinstance(value, float):
        out += b"\xcb" + struct.pack(">d", value)
    elif isinstance(value, str):
        _sized(value.encode(), 0xA0, 0xDB, out, fixed_below=32)
    elif isinstance(value, bytes):
        _sized(value, None, 0xC6, out)
    elif isinstance(value, (list, tuple)):
        _header(len(value), 0x90, 0xDD, out)
        for item in value:
            _pack(item, out)
    elif isinstance(value, dict):
        _header(len(value), 0x80, 0xDF, out)
        for key, item in value.items():
            _pack(key, out)
            _pack(item, out)
    else:
        raise TypeError(f"cannot pack {type(value).__name__}")


def _header(size: int, fixed: int, long: int, out: bytearray) -> None:
    if size < 16:
        out.append(fixed | size)
    else:
        out += bytes([long]) + struct.pack(">I", size)


def _sized(data: bytes, fixed: int | None, long: int, out: bytearray, fixed_below: int = 0) -> None:
    if fixed is not None and len(data) < fixed_below:
        out.append(fixed | len(data))
    else:
        out += bytes([long]) + struct.pack(">I", len(data))
    out += data


# --- vLLM's batches ----------------------------------------------------------------------

_FIELDS = {  # declaration order, for the array form
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


@attrs.frozen(kw_only=True)
class Batch:
    """One decoded ``KVEventBatch``."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    skipped: int = 0
    """Events left out: malformed, of an unknown kind, or of a group the index does not
    follow."""


def decode_batch(payload: bytes) -> Batch:
    """The batch in ``payload`` (either form, see the header); raises :class:`WireError`
    when the payload is not a batch at all."""
    value = unpack(payload)
    if isinstance(value, dict):
        ts, events, rank = value.get("ts"), value.get("events"), value.get("data_parallel_rank")
    elif isinstance(value, list) and len(value) >= 2:
        ts, events = value[0], value[1]
        rank = value[2] if len(value) > 2 else None
    else:
        raise WireError("a batch is a map or an array of ts, events[, data_parallel_rank]")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise WireError("a batch's ts is not a number or its events not an array")
    decoded: list[KVEvent] = []
    skipped = 0
    for raw in events:
        event = _event(raw)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return Batch(
        ts=float(ts),
        events=tuple(decoded),
        data_parallel_rank=rank if isinstance(rank, int) else None,
        skipped=skipped,
    )


def _fields(raw: object) -> tuple[str, Mapping[object, object]] | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        return (tag, raw) if isinstance(tag, str) and tag in _FIELDS else None
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _FIELDS:
        names = _FIELDS[raw[0]]
        return raw[0], dict(zip(names, raw[1:], strict=False))
    return None


def _event(raw: object) -> KVEvent | None:
    found = _fields(raw)
    if found is None:
        return None
    tag, fields = found
    group = fields.get("group_idx")
    if group not in (None, 0):
        return None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(fields.get("block_hashes"))
    medium = fields.get("medium")
    if hashes is None or not (medium is None or isinstance(medium, str)):
        return None
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, medium=medium)
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    lora = fields.get("lora_id")
    extra = fields.get("extra_keys")
    if (
        not (parent is None or isinstance(parent, (bytes, int)))
        or not _ints(tokens)
        or not isinstance(size, int)
        or not (lora is None or isinstance(lora, int))
    ):
        return None
    if isinstance(extra, list) and any(key is not None for key in extra):
        medium = UNMATCHABLE_MEDIUM
    assert isinstance(tokens, list)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=lora,
        medium=medium,
    )


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def _hashes(value: object) -> tuple[BlockHash, ...] | None:
    if not isinstance(value, list) or not all(isinstance(item, (bytes, int)) for item in value):
        return None
    return tuple(value)


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """``events`` as current vLLM sends them (the map form), for engines that publish."""
    return pack(
        {
            "ts": ts,
            "events": [_encode_event(event) for event in events],
            "data_parallel_rank": data_parallel_rank,
        }
    )


def _encode_event(event: KVEvent) -> dict[str, object]:
    match event:
        case BlockStored():
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
                "lora_name": None,
            }
        case BlockRemoved():
            return {
                "type": "BlockRemoved",
                "block_hashes": list(event.block_hashes),
                "medium": event.medium,
            }
        case AllBlocksCleared():
            return {"type": "AllBlocksCleared"}
