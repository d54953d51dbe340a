"""The HPACK encoder of the HTTP/2 adapters: RFC 7541 with a lookup per field, not a scan.

python-h2 encodes every header block it sends with its connection's public ``encoder``
attribute, setting ``header_table_size`` when the peer's SETTINGS_HEADER_TABLE_SIZE changes and
calling ``encode`` with the block's fields. The adapters put a ``HeaderEncoder`` there (as they
put their own decoder, ``h2decode``), because hpack's own encoder is most of the cost of a
response head: it scans its whole dynamic table for every field (dozens of entries once the
table is full), and it calls ``logging`` for every field. What it sends and what this sends
decode to the same fields.

Obeys RFC 7541:

- An entry of the dynamic table is found in one dict lookup by (name, value), a name in
  another; an entry's index is derived from its insertion number (§2.3.3: the newest entry is
  index 62), so inserting moves no other entry. Eviction is oldest first (§4.4), by the entry
  size of §4.1 (name + value + 32).
- The table's size is what the peer allows (SETTINGS_HEADER_TABLE_SIZE), at most
  ``MAX_TABLE_SIZE``; a change is signalled at the start of the next block, the smallest size
  since the last block first (§4.2, §6.3).
- A field that is in a table is sent as its index (§6.1); otherwise as a literal (§6.2) with
  the name's index where a table has the name, and Huffman-coded strings where shorter (§5.2).
  Literals are indexed incrementally (§6.2.1) except:
  - fields the caller marks sensitive (``hpack.NeverIndexedHeaderTuple``, a third tuple item
    that is true) and the ones h2 marks so itself (Authorization, Proxy-Authorization, a
    Cookie under 20 bytes, which CRIME-like guessing could recover one character at a time):
    never indexed (§6.2.3, §7.1.3);
  - fields whose value differs in every message (``UNINDEXED``: the request id every message
    carries, a request's traceparent) and entries larger than three quarters of the table:
    without indexing (§6.2.2), so that they do not push the fields that do repeat out of the
    table.

A cache of whole header blocks was considered and left out: a block is only
reusable while the table is as it was when the block was made, and an answer's head always
carries a field seen for the first time (its request id), so no block repeats; the per-field
lookups give what such a cache would, field by field.

The names and values arrive as bytes: h2 converts every field before it calls ``encode``
(``utf8_encode_headers``), and strings from any other caller are converted here.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import hpack

from muxproxy.core.http2.h2huffman import huffman_or_raw

DEFAULT_TABLE_SIZE = 4096
"""RFC 7541 §4.2 / RFC 9113 §6.5.2: SETTINGS_HEADER_TABLE_SIZE until the peer sets it."""

MAX_TABLE_SIZE = 4096
"""The largest dynamic table used, whatever the peer allows (§4.2: an encoder may use less).
The default size: it holds the fields a route's answers repeat; more would be memory per
connection for fields that are rarely sent twice."""

UNINDEXED = frozenset({b"x-request-id", b"traceparent"})
"""Field names whose values are new in every message: sent without indexing (§6.2.2). The
request id every message carries (``observe.access.REQUEST_ID``; the layers above set it, so
the name is repeated here, and a test keeps the two equal) and W3C Trace Context's traceparent
(``observe.tracecontext``), whose span id is new in every request."""

_SECRET = frozenset({b"authorization", b"proxy-authorization"})
_SHORT_COOKIE = 20
"""h2's rule (``_secure_headers``, after Firefox and nghttp2): a cookie shorter than this is
never indexed (a short value is the one that guessing recovers)."""

_ENTRY_OVERHEAD = 32
"""RFC 7541 §4.1: an entry's size is its name's and value's lengths plus 32."""

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)
"""RFC 7541 Appendix A: entry i + 1 of the static table."""

_STATIC_FIELDS: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAMES: dict[bytes, int] = {}
for _index, _field in enumerate(STATIC_TABLE, 1):
    _STATIC_FIELDS.setdefault(_field, _index)
    _STATIC_NAMES.setdefault(_field[0], _index)
del _index, _field

_FIRST_DYNAMIC = len(STATIC_TABLE) + 1
"""§2.3.3: the newest dynamic entry's index."""

_INDEXED = tuple(bytes((0x80 | index,)) for index in range(0x7F))
"""§6.1: an indexed field under 127, one octet."""

_INCREMENTAL, _WITHOUT, _NEVER = 0x40, 0x00, 0x10
"""§6.2.1-§6.2.3: the first octet's pattern of each literal."""
_PREFIX_BITS = {_INCREMENTAL: 6, _WITHOUT: 4, _NEVER: 4}

_NAME_CACHE_SIZE = 256
"""Encoded literal names kept (names repeat; a value rarely does, so values are not kept)."""


def integer(value: int, prefix_bits: int, pattern: int) -> bytes:
    """RFC 7541 §5.1: ``value`` in a ``prefix_bits`` prefix, ``pattern`` in the octet's
    other bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((pattern | value,))
    out = bytearray((pattern | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def string(value: bytes) -> bytes:
    """RFC 7541 §5.2: a string literal, Huffman-coded where that is shorter."""
    coded, octets = huffman_or_raw(value)
    return integer(len(octets), 7, 0x80 if coded else 0) + octets


def _as_bytes(item: bytes | str) -> bytes:
    return item if isinstance(item, bytes) else item.encode("utf-8")


class HeaderEncoder(hpack.Encoder):
    """An ``hpack.Encoder`` (h2's type for its ``encoder``) encoding as the module comment
    says. A subclass so that h2 and mypy take it where an encoder goes; hpack's ``__init__``
    is not called and every method h2 calls is overridden, so hpack's table stays unbuilt."""

    def __init__(self) -> None:
        self.max_size = DEFAULT_TABLE_SIZE
        """The dynamic table's size limit in use (§4.2)."""
        self.size = 0
        """The entries' total size (§4.1)."""
        self.entries: collections.deque[tuple[int, bytes, bytes, int]] = collections.deque()
        """(insertion number, name, value, size), oldest first."""
        self.inserted = 0
        """The insertion number of the newest entry (the first is 1)."""
        self.fields: dict[tuple[bytes, bytes], int] = {}
        """(name, value) -> the insertion number of its newest entry."""
        self.names: dict[bytes, int] = {}
        """name -> the insertion number of the newest entry with that name."""
        self.size_updates: list[int] = []
        """Sizes to signal at the start of the next block (§6.3): the smallest, then the last."""
        self.literal_names: dict[bytes, bytes] = {}

    @property
    def header_table_size(self) -> int:
        return self.max_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE (h2 sets it on every change)."""
        size = min(value, MAX_TABLE_SIZE)
        if size == self.max_size:
            return
        updates = self.size_updates
        self.size_updates = [min(updates[0], size) if updates else size, size]
        self.max_size = size
        self._evict(size)

    def encode(
        self,
        headers: Iterable[
            hpack.HeaderTuple
            | tuple[bytes | str, bytes | str]
            | tuple[bytes | str, bytes | str, bool | None]
        ]
        | dict[bytes | str, bytes | str],
        huffman: bool = True,
    ) -> bytes:
        """The header block of ``headers`` (pseudo-header fields first: the caller's order is
        kept). ``huffman`` False sends every string as it is."""
        block: list[bytes] = []
        append = block.append
        if self.size_updates:
            first, last = self.size_updates
            append(integer(first, 5, 0x20))
            if last != first:
                append(integer(last, 5, 0x20))
            self.size_updates = []
        fields = self.fields
        top = self.inserted + _FIRST_DYNAMIC
        items = headers.items() if isinstance(headers, dict) else headers
        for field in items:
            if type(field) is tuple and len(field) == 2:
                index = _STATIC_FIELDS.get(field)  # type: ignore[arg-type]  # bytes: h2 converts
                if index is None:
                    number = fields.get(field)  # type: ignore[arg-type]  # as above
                    if number is not None:
                        index = top - number
                if index is not None:
                    append(_INDEXED[index] if index < 0x7F else integer(index, 7, 0x80))
                    continue
                append(self._literal(field[0], field[1], False, huffman))  # type: ignore[arg-type]  # as above
            else:
                sensitive = bool(
                    not field.indexable
                    if isinstance(field, hpack.HeaderTuple)
                    else len(field) > 2 and field[2]  # a triple
                )
                name, value = _as_bytes(field[0]), _as_bytes(field[1])
                if not sensitive:
                    index = _STATIC_FIELDS.get((name, value))
                    number = fields.get((name, value))
                    if index is None and number is not None:
                        index = top - number
                    if index is not None:
                        append(_INDEXED[index] if index < 0x7F else integer(index, 7, 0x80))
                        continue
                append(self._literal(name, value, sensitive, huffman))
            top = self.inserted + _FIRST_DYNAMIC  # a literal may have added an entry
        return b"".join(block)

    def _literal(self, name: bytes, value: bytes, sensitive: bool, huffman: bool) -> bytes:
        """§6.2: a field no table holds; indexed incrementally unless the module comment says
        otherwise."""
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        if sensitive or name in _SECRET or (name == b"cookie" and len(value) < _SHORT_COOKIE):
            pattern = _NEVER
        elif name in UNINDEXED or 4 * size > 3 * self.max_size:
            pattern = _WITHOUT
        else:
            pattern = _INCREMENTAL
        index = _STATIC_NAMES.get(name)
        if index is None:
            number = self.names.get(name)
            if number is not None:
                index = self.inserted + _FIRST_DYNAMIC - number
        if index is not None:
            head = integer(index, _PREFIX_BITS[pattern], pattern)
        else:
            head = bytes((pattern,)) + self._name(name, huffman)
        out = head + (string(value) if huffman else integer(len(value), 7, 0) + value)
        if pattern == _INCREMENTAL:
            self._insert(name, value, size)
        return out

    def _name(self, name: bytes, huffman: bool) -> bytes:
        if not huffman:
            return integer(len(name), 7, 0) + name
        cache = self.literal_names
        encoded = cache.get(name)
        if encoded is None:
            if len(cache) >= _NAME_CACHE_SIZE:
                cache.clear()
            encoded = cache[name] = string(name)
        return encoded

    def _insert(self, name: bytes, value: bytes, size: int) -> None:
        """§4.4: make room (oldest first), then add the entry as the newest."""
        self._evict(self.max_size - size)
        self.inserted = number = self.inserted + 1
        self.entries.append((number, name, value, size))
        self.fields[name, value] = number
        self.names[name] = number
        self.size += size

    def _evict(self, room: int) -> None:
        """Evict the oldest entries until the table's size is at most ``room``."""
        entries = self.entries
        while self.size > room and entries:
            number, name, value, size = entries.popleft()
            self.size -= size
            # A newer entry of the same field or name has its own number: keep its mapping.
            if self.fields.get((name, value)) == number:
                del self.fields[name, value]
            if self.names.get(name) == number:
                del self.names[name]
