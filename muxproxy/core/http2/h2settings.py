"""The client-facing HTTP/2 connection as ``h2.H2Server`` opens it: our SETTINGS (RFC 9113
§6.5), the receive windows (§6.9) and the limits python-h2 is left to enforce.

Two of our limits are not h2's. MAX_CONCURRENT_STREAMS is advertised to the client, but the
value h2 enforces (as a connection error) is raised past anything one read can open once our
SETTINGS are on their way, so that ``H2Server`` refuses the extra streams itself, one by one
(§5.1.2: REFUSED_STREAM, a stream error). And the header list size is enforced by our own
HPACK decoder (``h2decode.HeaderDecoder``), which h2 calls for every header block.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.settings

from muxproxy.core.http2.h2decode import HeaderDecoder
from muxproxy.core.http2.h2encode import HeaderEncoder
from muxproxy.core.http2.h2preface import SettingsFirstBuffer
from muxproxy.core.http2.h2slimsettings import SlimSettings

CONNECTION_WINDOW = 16 * 1024 * 1024
"""The connection-level receive window we open at start (RFC 9113 §6.9.2: only the stream
level has a SETTINGS parameter). Large enough that one stalled stream, holding its own 64 KiB
window unacknowledged, never starves the others; bounded so a client cannot make us buffer
more than streams x stream window."""

H2_ENFORCED_STREAMS = 2**31 - 1
"""The stream limit python-h2 itself enforces (see ``server_connection``): far above what one
read of at most 64 KiB can open (a HEADERS frame is at least 9 bytes plus its block)."""

BLOCKS_PER_READ_FACTOR = 2
"""Header blocks one read may carry, in multiples of MAX_CONCURRENT_STREAMS: the streams there
is room for, as many again refused (a client that had not seen our SETTINGS yet) and the
trailers of open streams. Past it, GOAWAY(ENHANCE_YOUR_CALM) inside the read
(``h2decode.HeaderBlockFlood``)."""


def server_connection(
    *,
    max_concurrent_streams: int,
    initial_window: int,
    max_header_list_size: int,
    connection_window: int,
    upgrade_settings: bytes | None,
) -> tuple[h2.connection.H2Connection, HeaderDecoder]:
    """A server-side ``H2Connection`` with our SETTINGS queued, and the HPACK decoder it uses.
    ``upgrade_settings``: the client's HTTP2-Settings value when the connection was upgraded
    from HTTP/1.1 (h2c.py); raises h2's ``ProtocolError`` if they are invalid."""
    config = h2.config.H2Configuration(
        client_side=False,
        header_encoding=None,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        # RFC 9113 §8.2: what these two checked of a response's fields, ``ResponseSender``
        # checks once per distinct field instead (``h2outbound``).
        normalize_outbound_headers=False,
        validate_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config=config)
    # h2 keeps hpack's 64 KiB default list size unless a SETTINGS change is acknowledged,
    # and an initial value is not a change: the decoder is ours, with our limit
    # (``h2decode``; ``decoder`` is h2's public attribute, read at every header block).
    decoder = HeaderDecoder(
        limit=max_header_list_size, blocks=BLOCKS_PER_READ_FACTOR * max_concurrent_streams
    )
    conn.decoder = decoder
    # The encoder is ours too (``h2encode``: a lookup per field where hpack's scans its table;
    # ``encoder`` is h2's public attribute, used for every header block sent).
    conn.encoder = HeaderEncoder()
    # RFC 9113 §3.4: the preface is followed by SETTINGS (``h2preface``; ``incoming_buffer``
    # is h2's public attribute, read at every ``receive_data``).
    conn.incoming_buffer = SettingsFirstBuffer()
    settings = {
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
        h2.settings.SettingCodes.ENABLE_PUSH: 0,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list_size,
        # RFC 8441 §3: we accept extended CONNECT (WebSockets over HTTP/2, tunnel.py).
        h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 1,
    }
    # Settings in a few hundred bytes rather than h2's 10 KiB per connection (h2slimsettings).
    conn.local_settings = SlimSettings(client=False, initial_values=settings)
    conn.remote_settings = SlimSettings(client=True)
    if upgrade_settings is None:
        conn.initiate_connection()
    else:
        # RFC 7540 §3.2: the settings count as the client's first SETTINGS (no ACK), and
        # the upgraded request is stream 1, half-closed (remote).
        conn.initiate_upgrade_connection(upgrade_settings)
    # RFC 9113 §5.1.2: a stream past the advertised MAX_CONCURRENT_STREAMS is a stream
    # error (REFUSED_STREAM), the others go on. python-h2 enforces its local value as a
    # connection error, so once the SETTINGS above are on their way the value h2 enforces
    # is raised past anything one read can open, and ``H2Server._request`` refuses the
    # extra streams itself.
    settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = H2_ENFORCED_STREAMS
    conn.local_settings = SlimSettings(client=False, initial_values=settings)
    if initial_window != 65535:
        # Sent as a change rather than an initial value: h2 applies it only once the
        # client acknowledged it, so a client that sends a default 65,535-byte window
        # before it saw our SETTINGS is within its rights (RFC 9113 §6.5.3, §6.9.2).
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window})
    if connection_window > 65535:
        conn.increment_flow_control_window(connection_window - 65535)
    return conn, decoder
