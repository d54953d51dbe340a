"""The HPACK decoder of the HTTP/2 server adapter: limits, error codes, and Content-Length.

python-h2 decodes each header block (HEADERS plus CONTINUATION) with its connection's public
``decoder`` attribute, an ``hpack.Decoder``, in the middle of ``receive_data``. ``H2Server``
puts this subclass there, so that what h2 cannot be told by configuration happens while it
decodes, before it acts on the block:

- **COMPRESSION_ERROR** (RFC 9113 §4.3): h2 turns every HPACK error into a PROTOCOL_ERROR
  GOAWAY. A decoding error here raises ``CompressionError`` instead, an h2 ``ProtocolError``
  whose ``error_code`` is COMPRESSION_ERROR, so h2's one GOAWAY carries that code (and no
  library text: h2 sends no debug data of its own).
- **Header list size** (RFC 9113 §10.5.1, RFC 6585 §5): a decoded list above the configured
  ``limit`` is replaced by one ``OVERSIZED`` marker field, and the adapter answers 431 on
  that stream alone. The block is decoded all the same, since every block must be processed
  to keep the HPACK state in step (§4.3). Only past ``HARD_LIMIT_FACTOR`` times the limit is
  decoding the attack (an HPACK bomb): hpack stops mid-block (``max_header_list_size``, the
  decoder's public attribute) and h2 answers GOAWAY(ENHANCE_YOUR_CALM).
- **Header-block floods**: at most ``blocks`` blocks per read (counted from the last block the
  owner processed, ``processed``); past it ``HeaderBlockFlood`` is GOAWAY(ENHANCE_YOUR_CALM)
  at once.
  h2 processes a whole read before the adapter sees its events, and each stream it opens makes
  the next one dearer (it counts its open streams anew for every HEADERS), so streams past
  MAX_CONCURRENT_STREAMS have to be stopped inside the read, not after it.
- **Content-Length** (RFC 9113 §8.1.1): a wrong Content-Length makes a request malformed, a
  stream error; h2 checks it itself and raises a connection error (a malformed value when it
  takes the block, a DATA length that disagrees inside ``receive_data``). So h2 never sees the
  field: it is renamed ``HIDDEN_CONTENT_LENGTH`` here and named back by ``restore`` before the
  adapter validates the request (``intake``) and counts the body against it itself.

The markers begin with NUL, which no valid field name holds (RFC 9113 §8.2.1); a client name
that begins with NUL becomes ``b"\\x00"``, so a marker is only ever one this decoder set, and
the name is still refused as malformed.
"""

from __future__ import annotations

import h2.errors
import h2.exceptions
import hpack

from muxproxy.core.messages import Headers

HIDDEN_CONTENT_LENGTH = b"\x00content-length"
OVERSIZED = b"\x00oversized"
"""The one field of a block over the limit; its value is the decoded size, in decimal."""

HARD_LIMIT_FACTOR = 4
"""How far past the configured header list limit a block is still decoded and refused alone
(431). The cost of a block is at most this many times what the configuration allows; past it,
a block that small on the wire is an HPACK bomb (RFC 9113 §10.5.1, §10.5)."""

# RFC 9113 §4.3: what hpack raises for a block it cannot decode; its subclass
# OversizedHeaderListError is the bomb, which h2 maps to ENHANCE_YOUR_CALM itself.
_DECODING_ERRORS = (hpack.HPACKError, IndexError, TypeError, UnicodeDecodeError)


class CompressionError(h2.exceptions.ProtocolError):
    """An HPACK block that cannot be decoded: connection error COMPRESSION_ERROR."""

    error_code = h2.errors.ErrorCodes.COMPRESSION_ERROR


class HeaderBlockFlood(h2.exceptions.ProtocolError):
    """More header blocks in one read than the connection may open streams for."""

    error_code = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class HeaderDecoder(hpack.Decoder):
    """``hpack.Decoder`` with the limits above; see the module comment."""

    def __init__(self, *, limit: int, blocks: int) -> None:
        super().__init__(max_header_list_size=HARD_LIMIT_FACTOR * limit)
        self.limit = limit
        self.blocks = blocks
        self.blocks_left = blocks
        """Header blocks that may come before the owner processes one (``processed``)."""
        self.hidden = 0
        """Content-Length fields hidden and not yet named back."""

    def processed(self) -> None:
        """The owner took a request or trailers: every block h2 decoded so far was part of a
        read it is done with, so the next read may carry ``blocks`` again."""
        self.blocks_left = self.blocks

    def decode(self, data: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:  # type: ignore[override]  # hpack declares Iterable[HeaderTuple]; h2 passes raw=True and reads bytes pairs
        self.blocks_left -= 1
        if self.blocks_left < 0:
            raise HeaderBlockFlood("HEADERS flood: more header blocks in one read than streams")
        try:
            decoded = super().decode(data, raw=raw)
        except hpack.OversizedHeaderListError:
            raise
        except _DECODING_ERRORS as exc:
            raise CompressionError("header block cannot be decoded") from exc
        headers: list[tuple[bytes, bytes]] = []
        size = 0
        for name, value in decoded:
            # RFC 9113 §10.5.1 / RFC 7541 §4.1: a field costs its name, its value and 32.
            size += len(name) + len(value) + 32
            if name == b"content-length":
                name = HIDDEN_CONTENT_LENGTH
                self.hidden += 1
            elif name[:1] == b"\x00":
                name = b"\x00"
            headers.append((name, value))
        if size > self.limit:
            return [(OVERSIZED, str(size).encode())]
        return headers

    def restore(self, headers: Headers) -> Headers:
        """``headers`` with their Content-Length fields named back."""
        if not self.hidden:
            return headers
        out: Headers = []
        for name, value in headers:
            if name == HIDDEN_CONTENT_LENGTH:
                name = b"content-length"
                self.hidden -= 1
            out.append((name, value))
        return out
