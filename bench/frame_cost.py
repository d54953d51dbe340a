"""Instructions to put one token on the wire to a client: an HTTP/2 DATA frame or an HTTP/1.1
chunk (callgrind), without the rest of the proxy.

The floor of the HTTP/2 client path: what h2's public API costs per DATA frame, against what
the HTTP/1.1 path spends framing a chunk by hand. Each case sends ``N`` tokens of 188 bytes (a
chat-completion chunk's size) on one open stream whose windows were opened to 2**31-1 first,
under ``valgrind --tool=callgrind``, twice with different ``N``; the difference over the
difference in ``N`` is one token's cost, start-up excluded.

- ``h2``: ``H2Connection.send_data`` then ``data_to_send()``, h2 alone;
- ``adapter``: the same through muxproxy's ``H2Server.send_body`` (its send queue, flood
  guard and bookkeeping around ``send_data``);
- ``h1``: the chunk framing of ``H1Server.send_body`` (``%x\\r\\n<data>\\r\\n``).

    python bench/frame_cost.py            # a markdown table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CASES = ("h2", "adapter", "h1")
TOKEN = b"data: " + b"x" * 180 + b"\n\n"
SMALL, LARGE = 2_000, 12_000


def run(case: str, n: int) -> None:
    import h2.config
    import h2.connection
    import h2.settings

    from muxproxy.core.http1.h1 import H1Server
    from muxproxy.core.http2.h2 import H2Server
    from muxproxy.core.messages import ResponseHead

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.increment_flow_control_window(2**31 - 1 - 65535)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    server = H2Server(scheme=b"http")
    server.receive(client.data_to_send())
    client.receive_data(server.data_to_send())
    request = [(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"), (b":authority", b"x")]
    client.send_headers(1, request, end_stream=True)
    server.receive(client.data_to_send())
    server.send_head(ResponseHead(stream=1, status=200, headers=[]))
    server.data_to_send()
    conn = server.conn
    if case == "h2":
        for _ in range(n):
            conn.send_data(1, TOKEN)
            conn.data_to_send()
    elif case == "adapter":
        for _ in range(n):
            server.send_body(1, TOKEN)
            server.data_to_send()
    else:
        h1 = H1Server(scheme=b"http")
        h1.receive(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        h1.send_head(ResponseHead(stream=1, status=200, headers=[]))
        assert h1.chunking
        for _ in range(n):
            h1.send_body(TOKEN)


def instructions(valgrind: str, case: str, n: int) -> int:
    from icount import callgrind_total  # bench/icount.py, beside this file

    return callgrind_total(
        valgrind, [sys.executable, str(Path(__file__).resolve()), "--run", case, str(n)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=2, metavar=("CASE", "N"), help="one run, no valgrind")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.run:
        run(args.run[0], int(args.run[1]))
        return
    from icount import valgrind_or_exit  # bench/icount.py, beside this file

    valgrind = valgrind_or_exit(parser)
    print("| case | instructions per token |\n|---|---:|")
    for case in CASES:
        cost = (instructions(valgrind, case, LARGE) - instructions(valgrind, case, SMALL)) / (
            LARGE - SMALL
        )
        print(f"| {case} | {cost:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
