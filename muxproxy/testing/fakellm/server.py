"""Serving the fake LLM backend with Hypercorn's Trio worker, and its command line.

:func:`serve_fakellm` serves :attr:`FakeLLM.app <muxproxy.testing.fakellm.FakeLLM.app>`
through Hypercorn's public API (``hypercorn.config.Config``, ``hypercorn.trio.serve``): on one
plain-TCP port it speaks HTTP/1.1 and h2c with prior knowledge (Hypercorn detects the HTTP/2
preface itself). :func:`run` / :func:`main` are ``muxproxy fakellm`` and ``python -m
muxproxy.testing.fakellm``.

Hypercorn quirks worked around (Hypercorn 0.18):

* An ASGI app that raises after ``http.response.start`` makes Hypercorn close an HTTP/1.1
  connection without the terminating chunk, but on HTTP/2 it leaves the stream open for
  ever (neither END_STREAM nor RST_STREAM). ASGI has no message that resets a stream and
  Hypercorn no public call that does, so a die-after (:class:`FakeBackendDied`) resets the h2
  stream here, reaching Hypercorn's ``H2Protocol`` through the ``send`` callable
  (:func:`_reset_h2_stream`: the one use of Hypercorn's internals; best effort, and the app
  itself, on any other server, aborts by the exception alone).
* A lifespan-less app (one that returns from the ``lifespan`` scope) crashes Hypercorn's
  Trio worker at startup, so the app implements lifespan.
* ``keep_alive_max_requests`` (default 1000) would make Hypercorn GOAWAY an h2 connection
  after 1000 streams; it is set very high here so long benchmarks keep their connections.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import sys
from functools import partial
from typing import Any

import h2.connection
import h2.errors
import h2.exceptions
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from muxproxy.testing.fakellm.app import App, FakeBackendDied, FakeLLM, Receive, Scope, Send
from muxproxy.testing.fakellm.knobs import add_arguments
from muxproxy.testing.fakellm.kvevents import KvFakeLLM, publish_kv_events
from muxproxy.testing.fakellm.lora import LoraSlots

_ABORT_DRAIN_TIMEOUT = 1.0
"""Longest wait for queued h2 DATA to leave before the RST_STREAM of a die-after."""


class _DropDeliberateAborts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], FakeBackendDied))


_server_log = logging.getLogger("muxproxy.testing.fakellm.server")
_server_log.setLevel(logging.WARNING)
_server_log.addFilter(_DropDeliberateAborts())


def hypercorn_config(host: str = "127.0.0.1", port: int = 0) -> HypercornConfig:
    """The Hypercorn configuration :func:`serve_fakellm` uses (quiet, h2-friendly)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _server_log
    config.keep_alive_timeout = 75.0
    config.keep_alive_max_requests = 2**62
    config.h2_max_concurrent_streams = 1000
    config.graceful_timeout = 1.0
    return config


async def serve_fakellm(
    fake: FakeLLM,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``fake`` with Hypercorn's Trio worker until cancelled.

    ``task_status.started(port)`` reports the port really bound (useful with ``port=0``)::

        port = await nursery.start(serve_fakellm, fake)
    """
    app: Any = _resetting_h2_on_abort(fake.app)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, hypercorn_config(host, port))
        )
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


def _resetting_h2_on_abort(app: App) -> App:
    """``app``, whose die-after also resets the stream when Hypercorn serves it over h2."""

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        except FakeBackendDied:
            await _reset_h2_stream(send)
            raise

    return served


async def _reset_h2_stream(send: Send) -> None:
    """Reset the HTTP/2 stream behind ``send`` if Hypercorn serves it over h2, else no-op.

    Hypercorn, when an app raises mid-response, closes an HTTP/1.1 connection but leaves an
    h2 stream open. Here ``send`` is Hypercorn's ``HTTPStream.app_send``; its stream's
    ``send`` is ``H2Protocol.stream_send``. Queued DATA is let out first (so the client
    gets exactly the tokens sent), then RST_STREAM(INTERNAL_ERROR) is written, and the
    stream's buffer is marked complete so Hypercorn's sender drops it.
    """
    stream: Any = getattr(send, "__self__", None)
    protocol: Any = getattr(getattr(stream, "send", None), "__self__", None)
    connection = getattr(protocol, "connection", None)
    if not isinstance(connection, h2.connection.H2Connection):
        return
    stream_id: int = stream.stream_id
    buffer: Any = getattr(protocol, "stream_buffers", {}).get(stream_id)
    if buffer is not None and len(buffer.buffer) > 0:
        with trio.move_on_after(_ABORT_DRAIN_TIMEOUT):
            await buffer.drain()
    try:
        connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR)
    except h2.exceptions.ProtocolError:
        return  # the stream or connection is already closed
    await protocol._flush()
    if buffer is not None:
        buffer.set_complete()
        protocol.priority.unblock(stream_id)
        await protocol.has_data.set()


# ---- command line ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run a fake backend from parsed :func:`add_arguments` options until interrupted."""
    try:
        lora = LoraSlots.of(args.lora_adapters, args.max_lora)
    except ValueError as exc:
        print(f"muxproxy fakellm: {exc}", file=sys.stderr)
        return 2
    if args.kv_events is not None and args.kv_blocks is None:
        print(
            "muxproxy fakellm: --kv-events needs the engine's cache: add --kv-blocks B",
            file=sys.stderr,
        )
        return 2
    fake = (FakeLLM if args.kv_events is None else KvFakeLLM)(
        backend_id=args.backend_id,
        tokens=args.tokens,
        delay=args.delay,
        first_delay=args.first_delay,
        die_after=args.die_after,
        status=args.status,
        model_version=args.model_version,
        role_chunk=args.role_chunk,
        max_running=args.max_running,
        kv_blocks=args.kv_blocks,
        block_tokens=args.block_tokens,
        ttft_base=args.ttft_base,
        prefill_per_token=args.prefill_per_token,
        prefill_chunk=args.prefill_chunk,
        lora=lora,
    )

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            if args.kv_events is not None:
                publish = partial(publish_kv_events, fake, host=args.host, port=args.kv_events)
                events, _ = await nursery.start(publish)
                print(f"fakellm {fake.backend_id} kv events on {args.host}:{events}", flush=True)
            port = await nursery.start(partial(serve_fakellm, fake, host=args.host, port=args.port))
            print(f"fakellm {fake.backend_id} listening on {args.host}:{port}", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(serve)
    except (OSError, BaseExceptionGroup) as exc:
        # Hypercorn binds inside nested nurseries: a busy port arrives as an OSError wrapped
        # in exception groups. Anything else is a bug and keeps its traceback.
        error = _listen_error(exc)
        if error is None:
            raise
        where = f"{args.host}:{args.port}"
        if error.errno == errno.EADDRINUSE:
            message = f"port {args.port} is in use ({where}); pick another --port, or 0 for any"
        else:
            message = f"cannot listen on {where}: {error.strerror or error}"
        print(f"muxproxy fakellm: {message}", file=sys.stderr)
        return 1
    return 0


def _listen_error(exc: BaseException) -> OSError | None:
    """The one ``OSError`` inside ``exc`` (nested exception groups), if that is all it is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m muxproxy.testing.fakellm`` (the same options as ``muxproxy fakellm``)."""
    parser = argparse.ArgumentParser(
        prog="muxproxy fakellm", description="A fake OpenAI-compatible LLM backend."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
