"""What a backend connection's current request has come to, and an HTTP/2 backend stream's
life, as data: ``pool.PROGRESS`` and ``h2pool.STREAM``, and the parts that obey them.

The tables are total; a real conversation (an HTTP/1.1 client, HTTP/1.1 and HTTP/2 backends)
walks each machine through its states, and every move it makes must be a pair of its table.
The retries that read the progress (stale connection, written or not) are tested in
``test_stale_pool.py``.
"""

from __future__ import annotations

import h11
import pytest
from machines import spy
from playbook import BACKEND, H1ClientPeer, H2BackendPeer, Playbook, default_config
from test_stale_pool import pooled

from muxproxy.config import Server, Upstream
from muxproxy.core.states import IllegalTransition, Verdict, missing
from muxproxy.core.upstream.h2pool import STREAM, H2Upstream, StreamInput, StreamState
from muxproxy.core.upstream.pool import PROGRESS, Progress, ProgressInput, UpstreamConn


def test_tables_list_every_pair_once() -> None:
    assert missing(PROGRESS, Progress, ProgressInput) == []
    assert len(PROGRESS) == len(Progress) * len(ProgressInput)
    # Every input moves the progress somewhere: it is never ignored nor refused.
    assert not [t for t in PROGRESS.values() if isinstance(t, Verdict)]
    assert missing(STREAM, StreamState, StreamInput) == []
    assert len(STREAM) == len(StreamState) * len(StreamInput)


def test_a_reused_connection_is_stale_until_its_answer_begins() -> None:
    pb = Playbook()
    _, conn, backend = pooled(pb)
    up = pb.core.upstreams[conn]
    assert isinstance(up, UpstreamConn)
    assert (up.requests, up.progress, up.stale) == (1, Progress.ANSWERED, False)
    moves = spy(up, ProgressInput)
    client = H1ClientPeer()
    pb.accept(2)
    pb.receive(2, client.request())
    assert up.requests == 2 and up.progress is Progress.UNWRITTEN and up.stale
    assert not up.written  # the head is handed to the driver, not written yet
    request = pb.take(conn)
    backend.conn.start_next_cycle()
    backend.events(request)
    pb.sent(conn, len(request))
    assert up.progress is Progress.WRITTEN and up.stale and up.written
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    pb.receive(conn, head or b"")
    assert up.progress is Progress.ANSWERED and not up.stale
    assert [(before, input) for before, input, _ in moves] == [
        (Progress.ANSWERED, ProgressInput.ASSIGNED),
        (Progress.WRITTEN, ProgressInput.HEAD_SENT),
        (Progress.UNWRITTEN, ProgressInput.SENT),
        (Progress.WRITTEN, ProgressInput.RECEIVED),
    ]
    for before, input, after in moves:
        assert PROGRESS[(before, input)] is after


def h2_stream_open() -> tuple[Playbook, H2Upstream]:
    server = Server(address=BACKEND, protocol="h2")
    pb = Playbook(
        default_config(upstreams={"default": Upstream(name="default", servers=(server,))})
    )
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request())
    pb.opened(-1)
    backend = H2BackendPeer(pb, -1)
    backend.read()
    pb.receive(-1, backend.output())
    up = pb.core.upstreams[-1]
    assert isinstance(up, H2Upstream)
    return pb, up


def test_an_h2_stream_opens_with_its_head_and_ends_once() -> None:
    pb, up = h2_stream_open()
    (stream,) = up.streams.values()
    assert stream.state is StreamState.OPEN and stream.sid == 1
    pb.closed(1)  # the client goes away: RST_STREAM(CANCEL), the slot freed
    assert stream.state is StreamState.DONE
    stream.close()  # a second end changes nothing (IGNORED)
    assert stream.state is StreamState.DONE
    with pytest.raises(IllegalTransition, match="H2Stream: START is illegal in state DONE"):
        stream.send_head(1, b"GET", b"/", [])
