"""The bench's backend and clients in the shape the LLM routers (sglang-router, vllm-router) need.

The routers are not general proxies: they route only the endpoints of an inference server
(``POST /v1/chat/completions``, ``/generate``, ...; sglang-router answers anything else 404),
drop the query string, and sglang-router forwards a body it re-serializes from its own request
type: fields it does not know (``bench_ttft_ms``) are gone, ``max_tokens`` arrives as
``max_completion_tokens``. Before a worker gets traffic sglang-router asks it ``GET /health``,
``/server_info`` and ``/model_info`` (after probing it with an h2c preface); both routers
health-check ``/health``. ``sse_backend.py`` answers every other target with an endless event
stream, so this wraps the backend and the clients (same processes, same code, patched)::

    python bench/router_compat.py backend ARGS...     # sse_backend.py ARGS, plus the answers
    python bench/router_compat.py sse_client ARGS...  # sse_client.py ARGS, requests rewritten
    python bench/router_compat.py llm_load ARGS...    # llm_load.py ARGS, TTFT in the message

* backend: ``/health`` (and ``/health_generate``) is 200 with an empty body; ``/server_info``,
  ``/get_server_info``, ``/model_info``, ``/get_model_info``, ``/v1/models`` and ``/get_load``
  a small JSON object; the h2c preface probe (``PRI *``) a 400 and close. A chat completion
  whose last message is a bench target (``/sse?n=1``) is served as ``GET`` of that target
  would be: the same head and the same event bytes. Other chat completions take
  ``max_completion_tokens`` for ``max_tokens`` and a ``bench_ttft_ms=X`` at the start of the
  last message for a missing ``bench_ttft_ms``.
* sse_client: every ``GET /sse...`` (load, idle, probe and burst streams, HTTP/1.1 and h2c)
  goes out as ``POST /v1/chat/completions`` with ``{"model", "stream", "messages": [the
  target]}``: the routers route it, and the backend streams exactly what the ``GET`` gets.
* llm_load: the request's TTFT is also written at the start of its user message (22 bytes),
  so that it reaches the backend through sglang-router.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys

CHAT = b"/v1/chat/completions"
TTFT_PREFIX = "bench_ttft_ms="
INFO = {
    # No model_path: sglang-router would try to fetch that model's tokenizer.
    b"/server_info": {},
    b"/get_server_info": {},
    b"/model_info": {},
    b"/get_model_info": {},
    b"/v1/models": {"object": "list", "data": [{"id": "bench", "object": "model"}]},
    b"/get_load": {"load": 0},
}
HEALTH = (b"/health", b"/health_generate")


def chat_body(target: bytes) -> bytes:
    """The chat completion that stands for ``GET target`` (a bench target, ``/sse?...``)."""
    body = {
        "model": "bench",
        "stream": True,
        "messages": [{"role": "user", "content": target.decode()}],
    }
    return json.dumps(body, separators=(",", ":")).encode()


# --- backend --------------------------------------------------------------------------------


def patch_backend() -> None:
    import sse_backend

    conn_class = sse_backend.SSEConnection
    served = conn_class._request

    def ok_json(obj: object) -> bytes:
        body = json.dumps(obj).encode()
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )

    answers = {path: ok_json(obj) for path, obj in INFO.items()}
    answers.update(dict.fromkeys(HEALTH, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))

    def _request(self: sse_backend.SSEConnection, target: bytes, body: bytes) -> None:
        path = target.partition(b"?")[0]
        answer = answers.get(path)
        if answer is not None:
            self.write(answer)
            return
        if target == b"*":  # "PRI * HTTP/2.0": sglang-router probing for h2c
            self.write(sse_backend.BAD_REQUEST)
            if self.transport is not None:
                self.transport.close()
            return
        if path == CHAT and body:
            body = chat_target_or_body(body)
            if body.startswith(b"/"):
                served(self, body, b"")
                return
        served(self, target, body)

    conn_class._request = _request  # type: ignore[method-assign]


def chat_target_or_body(body: bytes) -> bytes:
    """A chat request's bench target (``b"/sse?n=1"``), or its body with what sglang-router
    renamed or dropped put back (``max_tokens``, ``bench_ttft_ms``)."""
    try:
        req = json.loads(body)
        content = req["messages"][-1]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return body
    if not isinstance(content, str):
        return body
    if content.startswith("/sse"):
        return content.encode()
    changed = False
    if req.get("max_tokens") is None and req.get("max_completion_tokens") is not None:
        req["max_tokens"] = req["max_completion_tokens"]
        changed = True
    if req.get("bench_ttft_ms") is None and content.startswith(TTFT_PREFIX):
        value = content[len(TTFT_PREFIX) :].partition(" ")[0]
        try:
            req["bench_ttft_ms"] = float(value)
            changed = True
        except ValueError:
            pass
    return json.dumps(req).encode() if changed else body


def run_backend(argv: list[str]) -> None:
    import sse_backend

    patch_backend()
    sse_backend.raise_nofile()
    gc.freeze()
    try:
        asyncio.run(sse_backend.main(sse_backend.parse_args(argv)))
    except KeyboardInterrupt:
        pass


# --- clients --------------------------------------------------------------------------------


def patch_client() -> None:
    import sse_client

    def rewrite(path: bytes, body: bytes | None) -> tuple[bytes, bytes | None]:
        if body is None and path.startswith(b"/sse"):
            return CHAT, chat_body(path)
        return path, body

    send_request = sse_client.send_request

    def h2_send_request(conn, sid, authority, path, body):  # type: ignore[no-untyped-def]
        send_request(conn, sid, authority, *rewrite(path, body))

    sse_client.send_request = h2_send_request  # H2Conn.request and SatH2Conn use it

    h1_request = sse_client.H1Conn.request

    def request(self, path, kind, body=None, stream=None):  # type: ignore[no-untyped-def]
        path, body = rewrite(path, body)
        return h1_request(self, path, kind, body, stream)

    sse_client.H1Conn.request = request  # type: ignore[method-assign]

    sat_init = sse_client.SatH1Conn.__init__

    def sat_h1_init(self, authority, path, *rest):  # type: ignore[no-untyped-def]
        sat_init(self, authority, path, *rest)
        if type(self) is sse_client.SatH1Conn:
            target, body = rewrite(path, None)
            assert body is not None
            self.request = (
                b"POST %s HTTP/1.1\r\nhost: %s\r\naccept: text/event-stream\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (target, authority, len(body), body)
            )

    sse_client.SatH1Conn.__init__ = sat_h1_init  # type: ignore[method-assign]


def patch_llm_load() -> None:
    import llm_load

    chat_request = llm_load.chat_request

    def with_ttft(at: float, tokens: int, ttft_ms: float, prompt: str) -> llm_load.Request:
        return chat_request(at, tokens, ttft_ms, f"{TTFT_PREFIX}{ttft_ms:.3f} {prompt}")

    llm_load.chat_request = with_ttft


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("backend", "sse_client", "llm_load"):
        sys.exit(f"usage: {sys.argv[0]} backend|sse_client|llm_load ARGS...")
    what, argv = sys.argv[1], sys.argv[2:]
    sys.argv = [f"{what}.py", *argv]
    if what == "backend":
        run_backend(argv)
        return
    patch_client()
    if what == "sse_client":
        import sse_client

        sse_client.main()
    else:
        patch_llm_load()
        import llm_load

        llm_load.main()


if __name__ == "__main__":
    main()
