"""The chunked transfer coding of a body (RFC 9112 §7.1), decoded per read.

h11 parses every response head and owns every other framing; a backend's chunked response
body is decoded here instead. h11 turns each chunk into its own event (an LLM server's token
is one chunk), so a read that carries a hundred tokens cost a hundred trips through its state
machine and ours. ``ChunkedDecoder.feed`` returns the payload of everything one read
completed as one piece: one ``Body`` for the proxy to forward, however many chunks it held.
A client's chunked request body stays h11's; ``H1Server`` feeds it through a decoder as well,
for the stricter checks below.

Grammar (RFC 9112 §7.1, with §7.1.1 extensions and §7.1.2 trailers)::

    chunked-body   = *chunk last-chunk trailer-section CRLF
    chunk          = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
    last-chunk     = 1*("0") [ chunk-ext ] CRLF

As strict as h11 where it matters for framing, and stricter on sizes: a size is hex digits
only, at most ``MAX_SIZE_DIGITS`` of them past leading zeros (16 in all), every line ends in
CRLF, chunk data is followed by CRLF. A line that ends in a bare LF is refused as soon as the
LF arrives: waiting for a CRLF that a client sending bare LFs never sends would hang the
exchange until a timer, and a server that takes bare LF frames the body differently (RFC 9112
§7.1 requires CRLF; §2.2's leniency is for the start line and fields, not chunk framing).
Extensions are ignored (§7.1.1 allows it) but must be printable; trailer fields must be well
formed, and are passed on lowercased, as h11 would. Anything else raises ``ChunkedError``: the
response is truncated, visibly.
"""

from __future__ import annotations

import re

# The largest chunk size taken: 10 hex digits, under 1 TiB. A chunk is a buffer its sender
# wrote at once; a size past that is garbage, or aims at a parser whose arithmetic gives up
# (2**53 in a float, 2**63 and 2**64 in a machine integer: "10000000000000005" is a 5-byte
# chunk to one that wraps and a huge one to us, so the two frame what follows differently).
# Leading zeros are allowed, up to 16 digits in all. The size regex checks it: no added work
# per chunk.
MAX_SIZE_DIGITS = 10
# Like h11: no whitespace before ";", optional whitespace before the CRLF.
_SIZE_LINE = re.compile(
    rb"0{0,%d}([0-9A-Fa-f]{1,%d})(?:;[\t\x20-\x7e\x80-\xff]*)?[ \t]*"
    % (16 - MAX_SIZE_DIGITS, MAX_SIZE_DIGITS)
)
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*")

_SIZE, _DATA, _DATA_END, _TRAILERS, _DONE = range(5)


class ChunkedError(Exception):
    """The chunked body is malformed. The text is fixed: it quotes none of the peer's bytes."""


class ChunkedDecoder:
    """Incremental decoder of one chunked body; ``feed`` until ``done``."""

    __slots__ = ("_buffer", "_max_line", "_remaining", "_state", "_trailer_bytes", "trailers")

    def __init__(self, *, max_line: int = 64 * 1024) -> None:
        self._state = _SIZE
        self._buffer = b""
        """Bytes of a line (size, CRLF or trailer) not complete yet."""
        self._remaining = 0
        """Payload bytes of the current chunk still to come."""
        self._max_line = max_line
        self._trailer_bytes = 0
        self.trailers: list[tuple[bytes, bytes]] = []

    @property
    def done(self) -> bool:
        """The last chunk and the trailer section have been read."""
        return self._state == _DONE

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """Decode ``data``; return (payload it completed, bytes after the end of the body).

        The second part is empty unless this read finished the body and the backend sent
        more behind it (which makes the connection unusable: RFC 9112 §9.3).
        """
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        payload: list[bytes] = []
        pos = 0
        end = len(data)
        state = self._state
        while pos < end:
            if state == _DATA:
                take = min(self._remaining, end - pos)
                payload.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    state = _DATA_END
            elif state == _DATA_END:
                if end - pos < 2:
                    if data[pos] != 13:  # not CR: no CRLF can follow (a bare LF, or junk)
                        raise ChunkedError("chunk data not followed by CRLF")
                    self._keep_partial_line(data, pos)
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ChunkedError("chunk data not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state in (_SIZE, _TRAILERS):
                line_end = data.find(b"\n", pos) - 1
                if line_end < -1:
                    self._keep_partial_line(data, pos)
                    break
                if line_end < pos or data[line_end] != 13:
                    raise ChunkedError("chunk line ends in a bare LF, not CRLF")
                start, pos = pos, line_end + 2
                if state == _SIZE:
                    match = _SIZE_LINE.fullmatch(data, start, line_end)
                    if match is None:
                        raise ChunkedError("bad chunk size line (not hex, or too large)")
                    size = int(match.group(1), 16)
                    data_end = pos + size
                    if size and data_end + 2 <= end:
                        # The whole chunk and its CRLF are in this read (a token, usually):
                        # taken in one step, the state stays _SIZE.
                        if data[data_end : data_end + 2] != b"\r\n":
                            raise ChunkedError("chunk data not followed by CRLF")
                        payload.append(data[pos:data_end])
                        pos = data_end + 2
                        continue
                    self._remaining = size
                    state = _DATA if size else _TRAILERS
                elif start < line_end:
                    self._trailer_line(data, start, line_end)
                else:  # the empty line ends the trailer section
                    self._state = _DONE
                    return b"".join(payload), data[pos:]
            else:  # _DONE: the caller stops feeding
                break
        self._state = state
        return b"".join(payload), b""

    def _keep_partial_line(self, data: bytes, pos: int) -> None:
        rest = data[pos:]
        if len(rest) > self._max_line:
            raise ChunkedError(f"chunk line longer than {self._max_line} bytes")
        self._buffer = rest

    def _trailer_line(self, data: bytes, start: int, end: int) -> None:
        self._trailer_bytes += end - start + 2
        if self._trailer_bytes > self._max_line:
            raise ChunkedError(f"trailer section longer than {self._max_line} bytes")
        match = _FIELD.fullmatch(data, start, end)
        if match is None:
            raise ChunkedError("bad trailer field")
        self.trailers.append((match.group(1).lower(), match.group(2)))
