"""Write the seed corpus (``fuzz/corpus/<target>/``) from real h11 and h2 peer conversations.

    python fuzz/make_corpus.py

Each file is an atheris input (``harness.encode``: the split points, then the bytes). Client
seeds are what h11 / h2 clients write for typical LLM API calls; backend seeds are what h11 /
h2 servers write in answer to the proxy's request.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import h2.config
import h2.connection
import h11
from hyperframe.frame import GoAwayFrame

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz.fleetcases import HASH_FIELDS, SRV_NAMES, STORE_PARSERS
from fuzz.harness import BAD_REPLY, FLEET_BIT, LATE, LLM_BIT, REFUSED, RESERVED, STOP_BIT, encode
from muxproxy.config.runtime import RuntimeState
from muxproxy.fleet.sessions import SessionEntry, entries_to_wire
from muxproxy.fleet.state import FleetDocument
from muxproxy.routing.kvindex import AllBlocksCleared, BlockRemoved, BlockStored
from muxproxy.routing.kvwire import encode_batch, pack
from muxproxy.trio.zmtp import _ready as ready
from muxproxy.trio.zmtp import frame, greeting

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
SYSTEM_CHAT = (
    b'{"model":"m","max_tokens":64,"stream":true,"messages":[{"role":"system","content":'
    b'"You are helpful."},{"role":"user","content":[{"type":"text","text":"hi"}]}]}'
)
SSE = [b'data: {"tok":"a"}\n\n', b'data: {"tok":"b"}\n\n', b"data: [DONE]\n\n"]
CHUNK_ROLE = (
    b'data: {"id":"c1","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""}}]}\n\n'
)
CHUNK_TEXT = (
    b'data: {"id":"c1","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"tok0 "},"finish_reason":null}]}\n\n'
)
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


def h1_request(
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    chunked: bool = False,
) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    hdrs = [("Host", "proxy.example"), *headers]
    if body is not None and not chunked:
        hdrs.append(("Content-Length", str(len(body))))
    if chunked:
        hdrs.append(("Transfer-Encoding", "chunked"))
    out = conn.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
    if body:
        out += conn.send(h11.Data(data=body)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    return out


def client_h1() -> list[bytes]:
    get = h1_request("GET", "/v1/models", [], None)
    post = h1_request("POST", "/v1/chat/completions", [("Content-Type", "application/json")], CHAT)
    return [
        encode(get),
        encode(post, [5, 40]),
        encode(h1_request("POST", "/v1/completions", [], CHAT, chunked=True)),
        encode(get + post),  # pipelined
        # A chunked chat body read before routing (the LLM group), and a tenant.
        encode(
            h1_request(
                "POST", "/v1/chat/completions", [("Authorization", "k")], SYSTEM_CHAT, chunked=True
            ),
            [60, 120],
            llm=True,
        ),
        encode(h1_request("POST", "/v1/chat/completions", [("Expect", "100-continue")], CHAT)),
        encode(
            h1_request(
                "GET",
                "/ws",
                [
                    ("Upgrade", "websocket"),
                    ("Connection", "upgrade"),
                    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                    ("Sec-WebSocket-Version", "13"),
                ],
                None,
            )
        ),
        # Resumes (``harness.RESUME_TOKENS``): the case's own first token, and an unknown
        # one from a client that does not take SSE (410).
        encode(
            post
            + h1_request(
                "GET",
                "/v1/chat/completions",
                [("Accept", "text/event-stream"), ("Last-Event-ID", "A" * 22 + ".1")],
                None,
            )
        ),
        encode(h1_request("POST", "/v1/chat", [("Last-Event-ID", "Q" * 22 + ".9")], CHAT)),
        encode(
            h1_request(
                "GET",
                "/",
                [
                    ("Upgrade", "h2c"),
                    ("Connection", "Upgrade, HTTP2-Settings"),
                    ("HTTP2-Settings", "AAMAAABkAAQAAP__"),
                ],
                None,
            )
        ),
    ]


def h2_client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    conn.initiate_connection()
    return conn


def h2_headers(
    method: bytes, path: bytes, *extra: tuple[bytes, bytes]
) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", method),
        (b":scheme", b"http"),
        (b":authority", b"proxy.example"),
        (b":path", path),
        *extra,
    ]


def client_h2() -> list[bytes]:
    seeds = []
    conn = h2_client()
    conn.send_headers(1, h2_headers(b"GET", b"/v1/models"), end_stream=True)
    seeds.append(encode(conn.data_to_send(), [3, 24]))
    conn = h2_client()
    conn.send_headers(
        1, h2_headers(b"POST", b"/v1/chat/completions", (b"content-type", b"application/json"))
    )
    conn.send_data(1, CHAT, end_stream=True)
    conn.send_headers(3, h2_headers(b"GET", b"/v1/models"), end_stream=True)
    conn.reset_stream(3)
    seeds.append(encode(conn.data_to_send()))
    conn = h2_client()
    conn.send_headers(
        1,
        h2_headers(
            b"POST",
            b"/grpc.Svc/Call",
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"grpc-timeout", b"1S"),
        ),
    )
    conn.send_data(1, b"\x00\x00\x00\x00\x02hi")
    conn.send_headers(1, [(b"x-trailer", b"1")], end_stream=True)
    conn.ping(b"12345678")
    seeds.append(encode(conn.data_to_send()))
    # Three tenants' chat requests at once: with the LLM group, two of them wait in the queue.
    conn = h2_client()
    for sid, tenant in ((1, b"Bearer a"), (3, b"Bearer a"), (5, b"Bearer b")):
        json_type = (b"content-type", b"application/json")
        conn.send_headers(
            sid, h2_headers(b"POST", b"/v1/chat/completions", json_type, (b"authorization", tenant))
        )
        conn.send_data(sid, SYSTEM_CHAT, end_stream=True)
    seeds.append(encode(conn.data_to_send(), llm=True))
    # A resume of the case's first stream (``harness.RESUME_TOKENS``) beside a new chat.
    conn = h2_client()
    conn.send_headers(
        1, h2_headers(b"POST", b"/v1/chat/completions", (b"content-type", b"application/json"))
    )
    conn.send_data(1, CHAT, end_stream=True)
    resume = (b"last-event-id", b"A" * 22 + b".0")
    accept = (b"accept", b"text/event-stream")
    conn.send_headers(3, h2_headers(b"GET", b"/v1/chat", accept, resume), end_stream=True)
    seeds.append(encode(conn.data_to_send()))
    return seeds


def h1_response(
    status: int, headers: list[tuple[str, str]], chunks: list[bytes], end: bool = True
) -> bytes:
    client = h11.Connection(h11.CLIENT)
    client.send(
        h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")])
    )
    client.send(h11.EndOfMessage())
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    server.next_event()
    server.next_event()
    out = server.send(h11.Response(status_code=status, headers=headers)) or b""
    for chunk in chunks:
        out += server.send(h11.Data(data=chunk)) or b""
    if end:
        out += server.send(h11.EndOfMessage()) or b""
    return out


def backend_h1() -> list[bytes]:
    sse = [("Content-Type", "text/event-stream")]
    return [
        encode(h1_response(200, [("Content-Length", "2")], [b"ok"])),
        encode(h1_response(200, sse, SSE), [20, 60]),
        encode(h1_response(200, [*sse, ("Connection", "close")], SSE)),  # read until close
        # Resumable streams: CRLF line ends and a comment, the backend's own ids, one event
        # over the 4 KiB window of the fuzz route.
        encode(h1_response(200, sse, [b": hi\r\n\r\ndata: a\r\n", b"\r\ndata: b\r\n\r\n"])),
        encode(h1_response(200, sse, [b"id: 1\ndata: a\n\n", b"data: b\n\n"])),
        encode(h1_response(200, sse, [b"data: " + b"x" * 5000 + b"\n\n", SSE[0]]), [100]),
        # A chat answer that breaks mid-stream: continued on a second connection.
        encode(h1_response(200, sse, [CHUNK_ROLE, CHUNK_TEXT], end=False), [40]),
        encode(h1_response(503, [("Content-Length", "4")], [b"busy"])),
        encode(b"HTTP/1.1 100 Continue\r\n\r\n" + h1_response(204, [], [])),
        encode(h1_response(200, sse, SSE[:1], end=False)),  # truncated
        encode(h1_response(200, sse, [SSE[0], USAGE, SSE[2]]), [30], llm=True),  # the usage
    ]


def backend_h2() -> list[bytes]:
    seeds = []
    for variant in range(5):
        client = h2_client()
        client.send_headers(1, h2_headers(b"POST", b"/v1/chat/completions"), end_stream=True)
        server = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        server.initiate_connection()
        server.receive_data(client.data_to_send())
        if variant == 0:
            server.send_headers(1, [(b":status", b"200"), (b"content-type", b"text/event-stream")])
            for event in SSE:
                server.send_data(1, event)
            server.end_stream(1)
        elif variant == 1:
            server.send_headers(1, [(b":status", b"200"), (b"content-length", b"2")])
            server.send_data(1, b"ok", end_stream=True)
            server.close_connection()
        elif variant == 2:
            server.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
            server.send_data(1, b"\x00\x00\x00\x00\x02hi")
            server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
        elif variant == 3:
            server.send_headers(1, [(b":status", b"200")])
            server.reset_stream(1)
        else:
            # A graceful GOAWAY between two DATA frames of the stream it lets finish (h2 sends
            # nothing after its own GOAWAY, so hyperframe builds it).
            server.send_headers(1, [(b":status", b"200"), (b"content-type", b"text/event-stream")])
            server.send_data(1, SSE[0])
            before = server.data_to_send()
            server.send_data(1, SSE[1], end_stream=True)
            goaway = GoAwayFrame(0)
            goaway.last_stream_id = 1
            seeds.append(encode(before + goaway.serialize() + server.data_to_send()))
            continue
        seeds.append(encode(server.data_to_send()))
    return seeds


def with_stops(seeds: list[bytes]) -> list[bytes]:
    """``seeds``, and the first two again with a graceful stop after their first read: one cut
    at once (grace 0), one with 2 seconds of grace (``harness.stop_of``); and the first two
    with the LLM fleet's group (``harness.llm_of``)."""
    stopped = [
        bytes([seed[0] | STOP_BIT | grace << 4]) + seed[1:]
        for seed, grace in zip(seeds, (0, 2), strict=False)
    ]
    llm = [bytes([seed[0] | LLM_BIT]) + seed[1:] for seed in seeds[:2]]
    return seeds + stopped + llm


FLEET_BYTES = (
    RESERVED << 2 | REFUSED << 4 | LATE << 6,  # and on_store_error = "local"
    BAD_REPLY << 2 | BAD_REPLY << 4 | BAD_REPLY << 6 | 2,  # a store that fails: "closed"
)
"""``harness.fleet_of``: the store's answers to three reservations, and ``on_store_error``."""


def with_fleet(seeds: list[bytes]) -> list[bytes]:
    """Each of ``seeds`` with the fleet store (``harness.fleet_of``), once per fleet byte."""
    out = []
    for seed in seeds:
        at = 1 + 2 * (seed[0] % 8)
        for fleet in FLEET_BYTES:
            out.append(bytes([seed[0] | FLEET_BIT]) + seed[1:at] + bytes([fleet]) + seed[at:])
    return out


# -- the fleet's targets (``fleetcases.Reader``'s layout) ----------------------------------


def reply(value: object) -> bytes:
    """``value`` as ``Reader.value`` reads it back."""
    if isinstance(value, bool) or value is None:
        return bytes([6]) if value is None else bytes([7, int(value)])
    if isinstance(value, int):
        return bytes([0]) + (value + 2**15).to_bytes(2, "big")
    if isinstance(value, bytes):
        return bytes([2, len(value)]) + value
    if isinstance(value, str):
        return bytes([3, len(value)]) + value.encode("latin-1")
    assert isinstance(value, list)
    return bytes([5, len(value)]) + b"".join(reply(item) for item in value)


def store_seed(parser: str, body: bytes) -> bytes:
    return bytes([STORE_PARSERS.index(parser)]) + body


def fleet_store() -> list[bytes]:
    lineage = "0123456789abcdef"
    document = FleetDocument(
        version=7,
        lineage=lineage,
        state=RuntimeState.empty()
        .changed("gpus", "10.0.0.1:8000", weight=3)
        .changed("gpus", "10.0.0.2:8000", drain=True, down=True),
    )
    fields = [(b"version", b"7"), (b"lineage", lineage.encode()), (b"seeded", b"0"),
              (b"state", document.state_json().encode())]  # fmt: skip
    hashed = bytes([len(fields)]) + b"".join(
        bytes([HASH_FIELDS.index(name)]) + len(value).to_bytes(2, "big") + value
        for name, value in fields
    )
    state_json = document.state_json()
    message = f'{{"version":7,"lineage":"{lineage}","seeded":true,"state":{state_json}}}'.encode()
    entries = [
        SessionEntry(group="gpus", key=2**64 - 1, address="10.0.0.1:8000", at=1.7e9),
        SessionEntry(group="gpus", key=5, address="[2001:db8::1]:8000", at=1.7e9 + 0.25),
    ]
    batch = json.dumps({"origin": "r1", "entries": entries_to_wire(entries)}).encode()
    stored = [(b"%016x" % 5, b"1700000000.25 10.0.0.1:8000"), (b"ffffffffffffffff", b"1.5 a:1")]
    return [
        store_seed("hash", hashed),
        store_seed("state_message", message),
        store_seed("sessions_message", batch),
        store_seed(
            "sessions_hash", b"".join(bytes([len(f)]) + f + bytes([len(v)]) + v for f, v in stored)
        ),
        store_seed("reserve", reply([0, b"0", b"9000", b"99", 1])),
        store_seed("reserve", reply([5, b"1.5", b"-3", b"0", 4])),
        store_seed("reserve", reply([8, b"0", b"10000", b"100", 0])),
        store_seed("announce", reply(3)),
        store_seed("cas", reply([-1, 9])),
    ]


def host(address: str) -> bytes:
    """A ``fleetcases._host`` of ``10.0.c.d`` or ``2001:db8::N``."""
    if ":" in address:
        return bytes([1]) + int(address.rsplit(":", 1)[1], 16).to_bytes(2, "big")
    c, d = address.split(".")[2:]
    return bytes([0, int(c), int(d)])


def lookup(dt: int, kind: int, ttl: int, body: bytes = b"", request: bool = True) -> bytes:
    return bytes([dt, kind]) + ttl.to_bytes(4, "big") + body + bytes([int(request)])


def a_answer(*hosts: str) -> bytes:
    return bytes([len(hosts)]) + b"".join(host(h) for h in hosts)


def srv_answer(records: list[tuple[int, int, int, str]], hosts: dict[str, list[str]]) -> bytes:
    out = bytes([len(records)])
    for priority, weight, port, name in records:
        out += b"".join(n.to_bytes(2, "big") for n in (priority, weight, port))
        out += bytes([SRV_NAMES.index(name)])
    for name in SRV_NAMES:
        out += a_answer(*hosts.get(name, []))
    return out


def discovery() -> list[bytes]:
    three = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    six = [*three, "10.0.1.1", "10.0.1.2", "2001:db8::1"]
    failure = bytes([2])  # the third of ``LookupResult``'s failures
    return [
        # 3 addresses, 6, a failure, an empty answer, 2: over a 5 s interval, TTL 30.
        bytes([4])
        + lookup(4, 2, 30, a_answer(*three))
        + lookup(20, 2, 30, a_answer(*six))
        + lookup(20, 0, 0, failure)
        + lookup(8, 1, 30)
        + lookup(20, 2, 1, a_answer("10.0.0.2", "10.0.1.1")),
        # SRV: a primary and a backup priority, a weight of 0, a duplicate target, TTL 0.
        bytes([9])
        + lookup(
            0,
            3,
            0,
            srv_answer(
                [
                    (10, 0, 8000, "a.svc."),
                    (10, 60, 8001, "b.svc."),
                    (20, 5, 8000, "c.svc."),
                    (10, 9, 8002, "a.svc."),
                ],
                {
                    "a.svc.": ["10.0.0.1", "2001:db8::a"],
                    "b.svc.": ["10.0.0.2"],
                    "c.svc.": ["10.0.2.1"],
                },
            ),
        )
        + lookup(40, 4, 7, srv_answer([(0, 1, 9000, "c.svc.")], {"c.svc.": ["10.0.2.1"]})),
        # Failures in a row back off up to the interval, then an answer.
        bytes([59])
        + lookup(1, 0, 0, failure) * 6
        + lookup(200, 2, 2**32 - 1, a_answer("10.0.3.7")),
    ]


def kv_events() -> list[bytes]:
    """An engine's KV-event stream (ZMTP from the greeting), batches of both of vLLM's forms,
    and tokenize answers (``kvcases.py``: the first byte picks the case)."""
    tokens = tuple(range(1, 33))
    stored = BlockStored(
        block_hashes=(b"h1", 2), parent_block_hash=None, token_ids=tokens, block_size=16
    )
    child = BlockStored(
        block_hashes=(3,), parent_block_hash=2, token_ids=tuple(range(40, 56)), block_size=16
    )
    batches = [
        encode_batch(1.0, [stored, child]),
        encode_batch(2.0, [stored, BlockRemoved(block_hashes=(b"h1",)), AllBlocksCleared()]),
        pack([1.0, [["BlockStored", [7], None, list(tokens[:16]), 16, None]], None]),
    ]
    stream = greeting() + ready(b"PUB")
    for sequence, batch in enumerate(batches):
        parts = [b"kv-events", sequence.to_bytes(8, "big"), batch]
        stream += b"".join(frame(part, more=at < 2) for at, part in enumerate(parts))
    answers = [b'{"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]}', b'{"tokens": []}']
    return [b"\x00" + stream, *(b"\x01" + batch for batch in batches)] + [
        b"\x02" + answer for answer in answers
    ]


def main() -> None:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    for name, seeds, fleet in [
        # The fleet store with a request that has a tenant (and a session): the fifth.
        ("client_h1", client_h1(), [4]),
        ("client_h2", client_h2(), [3]),
        ("backend_h1", backend_h1(), [1]),
        ("backend_h2", backend_h2(), [0]),
    ]:
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        for seed in with_stops(seeds) + with_fleet([seeds[i] for i in fleet]):
            path = os.path.join(folder, "seed-" + hashlib.sha1(seed).hexdigest()[:12])
            with open(path, "wb") as f:
                f.write(seed)
    for name, seeds in [
        ("fleet_store", fleet_store()),
        ("discovery", discovery()),
        ("kv_events", kv_events()),
    ]:
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        for seed in seeds:
            path = os.path.join(folder, "seed-" + hashlib.sha1(seed).hexdigest()[:12])
            with open(path, "wb") as f:
                f.write(seed)


if __name__ == "__main__":
    main()
