"""The ``muxproxy`` command line: ``check``, ``serve``, ``admin``, ``fakellm`` and ``demo``.

``muxproxy check --config FILE`` validates a configuration file and prints a summary, or every
problem found (exit status 2); it warns of servers whose host names do not resolve.
``muxproxy check --explain KEY`` prints a key's entry of the configuration reference.
``muxproxy serve`` runs the proxy from a file or from flags
(``--listen HOST:PORT --upstream HOST:PORT ...``). ``admin``, ``fakellm`` and ``demo`` delegate
to :mod:`muxproxy.process.admin_cli`, :mod:`muxproxy.testing.fakellm` and :mod:`muxproxy.demo`.

Everything past configuration is imported lazily, inside the command that needs it: ``check``
loads neither Trio nor the proxy, and a subcommand's module is imported only when that
subcommand runs (or its ``--help`` is asked for).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from types import ModuleType
from typing import Any

import attrs

from muxproxy import __version__
from muxproxy.config import (
    LOG_LEVELS,
    Config,
    ConfigError,
    load_config,
    parse_quick_config,
)
from muxproxy.process.check import describe_config, seconds
from muxproxy.process.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    freeze_startup_heap,
    host_port,
    listening_line,
    listening_lines,
    reopen_access_log,
)
from muxproxy.process.signals import HANDLED_SIGNALS, obey
from muxproxy.trio.excgroups import leaves

log = logging.getLogger("muxproxy")

_DELEGATED = {
    "admin": (
        "muxproxy.process.admin_cli",
        "show and change a running proxy through its admin API (status, weight, drain, reload)",
    ),
    "fakellm": (
        "muxproxy.testing.fakellm",
        "run a fake OpenAI-compatible LLM server (token streaming, for tests and demos)",
    ),
    "demo": ("muxproxy.demo", "run a demo: fake LLM servers behind the proxy"),
}
"""Subcommands whose arguments and behaviour live in another module: module, help."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _build_parser()
    command = _command_of(args_list)
    if command in _DELEGATED:
        try:
            module = _delegate(command, subparsers[command])
        except ImportError as exc:
            print(f"muxproxy: {command} is not available: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        subparsers[command].set_defaults(handler=lambda args: int(module.run(args)))
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return handler(args)


class _Version(argparse.Action):
    """``--version``: the version, and whether the compiled build runs (``compiled.py``)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from muxproxy.compiled import build

        print(f"muxproxy {__version__} ({build()})")
        parser.exit()


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="muxproxy",
        description="An HTTP/1.1 + HTTP/2 edge proxy for LLM inference servers.",
    )
    parser.add_argument("--version", action=_Version, help="the version and the build, and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers: dict[str, argparse.ArgumentParser] = {}

    check = commands.add_parser(
        "check",
        help="validate a configuration file, or explain a key",
        description="Validate a configuration file: print a summary, or every problem found."
        " Or explain a configuration key: its type, default, meaning and an example.",
    )
    check.add_argument("--config", metavar="FILE", help="TOML configuration")
    check.add_argument(
        "--explain",
        metavar="KEY",
        help="a key (first_token, upstreams.gpus.timeouts.first_token) or a table"
        " (upstreams.NAME.sticky): print its reference entry",
    )
    check.set_defaults(handler=_check)
    subparsers["check"] = check

    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy, configured by a TOML file or by flags (one upstream group).",
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE", help="TOML configuration")
    source.add_argument("--listen", metavar="HOST:PORT", help="address to listen on")
    serve.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a backend server (repeat for several); with --listen",
    )
    serve.add_argument("--tls-cert", metavar="FILE", help="TLS certificate chain (PEM)")
    serve.add_argument("--tls-key", metavar="FILE", help="TLS private key (PEM)")
    serve.add_argument(
        "--admin",
        metavar="HOST:PORT",
        help="admin API address, with --listen (token: MUXPROXY_ADMIN_TOKEN)",
    )
    serve.add_argument(
        "--workers",
        type=_worker_count,
        default=1,
        metavar="N",
        help="worker processes sharing the listeners (SO_REUSEPORT; default 1, Linux for more)",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"error log level, overriding [log] level ({', '.join(LOG_LEVELS)})",
    )
    serve.set_defaults(handler=_serve)
    subparsers["serve"] = serve

    for name, (_, help_text) in _DELEGATED.items():
        subparsers[name] = commands.add_parser(name, help=help_text, description=help_text)
    return parser, subparsers


def _worker_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return count


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _delegate(command: str, subparser: argparse.ArgumentParser) -> ModuleType:
    """Import the module of a delegated subcommand and let it add its arguments."""
    module = importlib.import_module(_DELEGATED[command][0])
    module.add_arguments(subparser)
    return module


def _check(args: argparse.Namespace) -> int:
    if args.explain is not None:
        status = _explain(args.explain)
        if args.config is None or status != EXIT_OK:
            return status
        print()
    elif args.config is None:
        print("muxproxy check: expected --config FILE or --explain KEY", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        _print_problems(exc, args.config)
        return EXIT_USAGE
    print(f"muxproxy: {args.config}: configuration is valid")
    for line in describe_config(config):
        print(f"  {line}")
    from muxproxy.config.resolve import unresolved_servers

    for warning in unresolved_servers(config):
        print(f"muxproxy: warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _explain(key: str) -> int:
    from muxproxy.config import reference

    text = reference.explain(key)
    if text is not None:
        print(text)
        return EXIT_OK
    close = reference.suggestions(key)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    print(
        f"muxproxy check: no configuration key or table {key!r}{hint}"
        " (the reference of every key: docs/configuration.md)",
        file=sys.stderr,
    )
    return EXIT_USAGE


def _print_problems(error: ConfigError, source: str | None) -> None:
    where = f"{source}: " if source is not None else ""
    print(f"muxproxy: {where}invalid configuration", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    if args.config is not None:
        extra = [
            flag
            for flag, value in (
                ("--upstream", args.upstream),
                ("--tls-cert", args.tls_cert),
                ("--tls-key", args.tls_key),
                ("--admin", args.admin),
            )
            if value
        ]
        if extra:
            print(
                f"muxproxy serve: {', '.join(extra)} cannot be used with --config"
                " (the configuration file sets upstreams and TLS)",
                file=sys.stderr,
            )
            return EXIT_USAGE
    try:
        if args.config is not None:
            config = load_config(args.config)
        else:
            config = parse_quick_config(
                args.listen,
                args.upstream,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                admin=args.admin,
            )
    except ConfigError as exc:
        _print_problems(exc, args.config)
        return EXIT_USAGE
    if args.log_level is not None:
        config = attrs.evolve(config, log=attrs.evolve(config.log, level=args.log_level))
    if args.workers > 1:
        from muxproxy.process.workers import supervise

        return supervise(config, args.workers, args.config, args.log_level)
    return run_server(config, config_path=args.config, log_level=args.log_level)


def run_server(
    config: Config, *, config_path: str | None = None, log_level: str | None = None
) -> int:
    """Run the proxy in this process until a signal stops it; returns the exit status.

    Prints ``muxproxy listening on http://H:P`` for each bound listener once they are bound,
    then ``muxproxy admin on http://H:P`` when ``config.admin`` is set: the admin API, whose
    reload reads ``config_path`` too; the state file is applied before the first accept.
    Signals, as nginx's: SIGTERM, SIGINT (Ctrl-C) and SIGQUIT stop gracefully (no new
    connection or request; running streams get ``timeouts.shutdown_grace`` to finish); a
    second SIGTERM or SIGINT cuts them at once. Either way the exit status is 0. SIGHUP
    reloads ``config_path`` (``None``: configured by flags, nothing to reload); an invalid
    file or a listener that cannot be bound leaves the running configuration as it is.
    SIGUSR1 reopens the access log file (log rotation, as nginx's); SIGUSR2, the rolling
    restart of ``--workers``, has no workers to restart here and is ignored, said in the
    log (unhandled, either would end the process and cut every stream);
    ``log_level`` (``--log-level``) overrides ``[log] level`` of every file read. Each stop,
    reload and refused reload is logged (logger ``muxproxy``, stderr). Failing to listen at
    the start prints why (status 1).
    """
    import trio

    try:
        server_module = importlib.import_module("muxproxy.trio.server")
    except ImportError as exc:
        print(f"muxproxy: serve is not available: {exc}", file=sys.stderr)
        return EXIT_FAILURE

    async def serve_until_stopped() -> None:
        with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
            server = server_module.ProxyServer(config)
            control, state = None, None
            if config.admin is not None or config.fleet is not None:
                control = importlib.import_module("muxproxy.trio.control")
                local = importlib.import_module("muxproxy.trio.local")
                state = control.apply_saved_state(server)  # before the first accept
            async with trio.open_nursery() as nursery:

                async def run(task_status: trio.TaskStatus[Any]) -> None:
                    await server.run(task_status=task_status)
                    nursery.cancel_scope.cancel()  # stopped: no more signals to handle

                bound = await nursery.start(run)
                admin = None
                if control is not None:
                    admin = await nursery.start(
                        partial(local.serve_control, server, config_path=config_path, state=state)
                    )
                freeze_startup_heap()
                for line in listening_lines(config, bound):
                    print(line, flush=True)
                if admin is not None:
                    print(f"muxproxy admin on http://{host_port(*admin)}", flush=True)
                await obey(signals, OneProcess(server, config_path, log_level))
            _log_stopped(server)

    try:
        trio.run(serve_until_stopped)
    except (KeyboardInterrupt, OSError, BaseExceptionGroup) as exc:
        errors = leaves(exc)
        if all(isinstance(leaf, KeyboardInterrupt) for leaf in errors):
            return EXIT_OK
        if all(isinstance(leaf, KeyboardInterrupt | OSError) for leaf in errors):
            for leaf in errors:
                if isinstance(leaf, OSError):
                    print(f"muxproxy: cannot serve: {leaf}", file=sys.stderr)
            return EXIT_FAILURE
        raise
    return EXIT_OK


class OneProcess:
    """The signals of one serving process (``process/signals.py``), acted on its
    ``ProxyServer``."""

    def __init__(self, server: Any, config_path: str | None, log_level: str | None) -> None:
        self.server = server
        self.config_path = config_path
        self.log_level = log_level

    def stopping(self) -> bool:
        return bool(self.server.phase.value != "serving")

    async def on_stop(self, signum: signal.Signals, *, cut: bool) -> None:
        server = self.server
        if cut and server.phase.value != "draining":
            return  # already cutting
        count = server.streams_in_flight()
        server.request_shutdown()  # first: the line below means new connections are refused
        if cut:
            log.info(
                "muxproxy: %s again: cutting %d stream%s now (exit status stays 0)",
                signum.name,
                count,
                "" if count == 1 else "s",
            )
            return
        grace = seconds(server.config.timeouts.shutdown_grace)
        log.info(
            "muxproxy: stopping: %d stream%s in flight, grace %s (%s)",
            count,
            "" if count == 1 else "s",
            grace,
            signum.name,
        )

    async def on_keep_stopping(self, signum: signal.Signals) -> None:
        log.info(
            "muxproxy: %s: already stopping gracefully (SIGTERM or SIGINT cuts now)", signum.name
        )

    async def on_reload(self) -> None:
        reload_server(self.server, self.config_path, log_level=self.log_level)

    async def on_reopen_logs(self) -> None:
        reopen_access_log(self.server, log)

    async def on_restart(self) -> None:
        log.warning(
            "muxproxy: SIGUSR2 ignored: a rolling restart needs workers (muxproxy serve"
            " --workers N, N >= 2); this process keeps serving"
        )

    async def on_refused(self, signum: signal.Signals) -> None:
        log.info("muxproxy: %s ignored: the server is %s", signum.name, self.server.phase.value)


def reload_server(server: Any, config_path: str | None, *, log_level: str | None = None) -> bool:
    """Re-read ``config_path`` and apply it to ``server`` (a running ``ProxyServer``);
    ``log_level`` overrides the file's ``[log] level`` (``--log-level``).

    Logs ``muxproxy: reloaded FILE (generation N)``, or one line per problem, each naming
    the file, and keeps the running configuration; returns whether it was applied.
    """
    if config_path is None:
        log.info("muxproxy: SIGHUP: nothing to reload (configured by --listen, not --config)")
        return False
    if server.phase.value != "serving":
        log.info(
            "muxproxy: reload of %s ignored: the server is %s", config_path, server.phase.value
        )
        return False
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        for problem in exc.problems:
            log.error("muxproxy: reload refused: %s", _naming_file(problem, config_path))
        _log_kept(server, config_path)
        return False
    if log_level is not None:
        config = attrs.evolve(config, log=attrs.evolve(config.log, level=log_level))
    try:
        added = server.reload(config)
    except OSError as exc:
        log.error("muxproxy: reload refused: %s: %s", config_path, exc)
        _log_kept(server, config_path)
        return False
    for listener, (host, port) in added:
        print(listening_line(listener.tls, host, port), flush=True)
    log.info("muxproxy: reloaded %s (generation %d)", config_path, server.generation)
    return True


def _naming_file(problem: str, path: str) -> str:
    """``problem`` with the file it is in: a TOML syntax error names it already."""
    return problem if problem.startswith(path) else f"{path}: {problem}"


def _log_kept(server: Any, path: str) -> None:
    log.error("muxproxy: %s not applied; still running generation %d", path, server.generation)


def _log_stopped(server: Any) -> None:
    summary = server.stop_summary
    if summary is None:
        return
    if summary.cut:
        why = "on a second signal" if summary.forced else "at the end of the shutdown grace"
        outcome = f"{summary.cut} of {summary.in_flight} streams cut {why}"
    else:
        outcome = f"all {summary.in_flight} streams finished, none cut"
    log.info("muxproxy: stopped after %.1fs: %s", summary.seconds, outcome)
