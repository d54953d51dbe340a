"""``muxproxy demo``: what the proxy is for, in half a minute, on one machine.

Four fake GPU backends (gpu0..gpu2 serving model v1, gpu3 serving v2 at weight 0), the
proxy in front of them with its admin API, configured from a real configuration table
(sticky sessions by ``X-Chat-ID``, retries, health checks, ``retry_until_first_event``,
``continue_on_failure``), and a dozen conversations streaming chat completions turn after
turn, half over HTTP/1.1, half multiplexed on one HTTP/2 connection. Then, on a timetable
that scales with ``--duration``:

1. **steady**: every conversation sticks to its v1 backend;
2. **a backend is killed** mid-stream, as a crashed GPU server: a stream that had not begun
   is retried on another server, one cut mid-answer is finished by another server as one
   stream (the client sees every token once, in order), later turns move; no request fails;
3. **a gray release**: v2's weight goes up step by step through the admin API, then v1 is
   drained: new conversations go to v2 by weight, existing ones stay on their v1 backend.

The live view (rich) shows per backend its streams, requests, time to first token and
tokens/s, the stickiness, the phase and an event log; ``--plain`` (and any stdout that is
not a terminal) prints the events as lines instead. Both end with a summary. Exit status 0
when every request completed with every token, 1 otherwise.

Modules: ``clients.py`` (the h11/h2 clients and the admin API client), ``fleet.py`` (the
backends, the configuration, the proxy), ``board.py`` (what was seen, and the figures),
``script.py`` (the traffic and the timetable), ``view.py`` (the live view and the summary),
``show.py`` (running it all).
"""

from __future__ import annotations

import argparse
import sys

from muxproxy.trio.excgroups import leaves

EXIT_INTERRUPTED = 130
"""The exit status after Ctrl-C during the scripted run (as a shell reports SIGINT)."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``muxproxy demo`` options to ``parser``."""
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=25.0,
        metavar="SECONDS",
        help="the whole scripted run; its phases scale with it (default 25)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="no live view: the events as lines, then the summary (the default when stdout"
        " is not a terminal)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the run, keep the fleet and the proxy up (URLs, token and curl"
        " examples printed) until Ctrl-C",
    )
    parser.add_argument(
        "--tokens", type=_positive_int, default=24, help="tokens per answer, about (default 24)"
    )
    parser.add_argument(
        "--delay",
        type=_positive_float,
        default=0.04,
        help="seconds between two tokens of a backend (default 0.04)",
    )
    parser.add_argument(
        "--conversations",
        type=_positive_int,
        default=12,
        help="conversations at a time, half over HTTP/1.1, half on one HTTP/2 connection"
        " (default 12)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed :func:`add_arguments` options; returns the exit status."""
    import trio

    from muxproxy.demo.show import make_console, run_demo
    from muxproxy.demo.stage import Settings

    settings = Settings(
        duration=args.duration,
        tokens=args.tokens,
        delay=args.delay,
        conversations=args.conversations,
    )
    live = not args.plain and sys.stdout.isatty()
    console = make_console(live)
    try:
        return trio.run(lambda: run_demo(settings, live=live, keep=args.keep, console=console))
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not all(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(exc)):
            raise
        print("muxproxy demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    """``python -m muxproxy.demo`` (the same options as ``muxproxy demo``)."""
    parser = argparse.ArgumentParser(prog="muxproxy demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
