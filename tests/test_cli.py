"""Tests of the ``muxproxy`` command line (:mod:`muxproxy.process.cli`, ``python -m muxproxy``)."""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trustme

import muxproxy
import muxproxy.compiled
from muxproxy.config import parse_config, quick_config
from muxproxy.process.cli import describe_config, main
from muxproxy.process.common import listening_lines

REPO = Path(muxproxy.__file__).resolve().parent.parent

GOOD = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = ["127.0.0.1:9001", { address = "127.0.0.1:9002" }]

[upstreams.cpus]
servers = ["127.0.0.1:9003"]

[[routes]]
prefix = "/v1/"
upstream = "gpus"

[[routes]]
prefix = "/"
upstream = "cpus"
"""

BAD = """\
[[listeners]]
address = "127.0.0.1:8080"

[timeouts]
raed = 30
read = -3

[upstreams.gpus]
servers = ["127.0.0.1:9001", "localhost"]

[[routes]]
prefix = "/v1/"
upstream = "gpu"
"""

ROUTING = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [
  "127.0.0.1:9001",
  { address = "127.0.0.1:9002", weight = 5, max_fails = 3, fail_timeout = 30 },
  { address = "127.0.0.1:9003", weight = 0 },
  { address = "127.0.0.1:9004", backup = true },
]
balance = "least_streams"
set_headers = { "X-Chat-ID" = "$session_key", Authorization = "Bearer sk-live-123" }

[upstreams.gpus.sticky]
sources = ["cookie:chat_session", "header:X-Chat-ID", "body:metadata.session_id"]

[upstreams.gpus.sticky.cookie]
name = "mux_srv"
expires = 3600
secret = "s3cret"

[upstreams.gpus.next_upstream]
on = ["error", "timeout", "http_502", "http_503"]
tries = 2
tries_timeout = 5
replay_buffer = 0

[upstreams.gpus.health_check]
path = "/healthz"
interval = 10

[upstreams.gpus.timeouts]
first_token = 120
idle = 300

[[routes]]
prefix = "/v1/"
upstream = "gpus"
retry_until_first_event = true
continue_on_failure = true
resume = { window = "128 KiB", linger = 20, store = "redis://:s3cret@cache:6379/0" }

[timeouts]
shutdown_grace = 600
"""

BAD_ROUTING = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [{ address = "127.0.0.1:9001", backup = true }]

[upstreams.gpus.sticky]
sources = ["cookies:chat"]

[upstreams.gpus.sticky.cookie]
same_site = "lax"

[upstreams.gpus.next_upstream]
on = ["eror"]
retries = 2

[upstreams.gpus.health_check]
interval = 5
timeout = 5

[[routes]]
prefix = "/v1/"
upstream = "gpus"
retry_until_first_event = "true"
"""


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m muxproxy ARGS`` in a real subprocess."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "muxproxy", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_tls_pair(directory: Path) -> tuple[Path, Path]:
    """A real certificate and its key, PEM: ``directory/cert.pem``, ``directory/key.pem``."""
    issued = trustme.CA().issue_cert("localhost")
    cert, key = directory / "cert.pem", directory / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


# --- check, as a subprocess -------------------------------------------------------------------


def refused_by_check(directory: Path, name: str, text: str) -> list[str]:
    """``muxproxy check --config NAME`` of a file ``name`` holding ``text`` in ``directory``,
    which it must refuse (exit status 2, nothing on stdout): the lines it printed on stderr."""
    (directory / name).write_text(text)
    result = run_cli("check", "--config", name, cwd=directory)
    assert result.returncode == 2
    assert result.stdout == ""
    return result.stderr.splitlines()


def test_check_bad_file_exits_2_with_every_problem(tmp_path: Path) -> None:
    assert refused_by_check(tmp_path, "bad.toml", BAD) == [
        "muxproxy: bad.toml: invalid configuration",
        '  timeouts.raed: unknown key; did you mean "read"?',
        "  timeouts.read: expected a positive, finite number of seconds, got -3",
        '  upstreams.gpus.servers[1]: expected "host:port", got "localhost"',
        '  routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu] or use one of: gpus',
    ]


def test_check_good_file_exits_0_with_a_summary(tmp_path: Path) -> None:
    (tmp_path / "good.toml").write_text(GOOD)
    result = run_cli("check", "--config", "good.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "muxproxy: good.toml: configuration is valid",
        "  listener http://127.0.0.1:8080",
        "  upstream gpus: 2 servers (127.0.0.1:9001, 127.0.0.1:9002)",
        "    balance round_robin; retry on error, timeout: 3 tries within 10s, bodies up to 1 MiB",
        "  upstream cpus: 1 server (127.0.0.1:9003)",
        "    balance round_robin; retry on error, timeout: 3 tries within 10s, bodies up to 1 MiB",
        "  route /v1/ -> gpus",
        "  route / -> cpus",
        "  log: access stderr (text), error log level info",
        "  graceful stop: streams get 30s to finish (timeouts.shutdown_grace)",
    ]


def test_check_summarizes_routing_settings(tmp_path: Path) -> None:
    (tmp_path / "routing.toml").write_text(ROUTING)
    result = run_cli("check", "--config", "routing.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "muxproxy: routing.toml: configuration is valid",
        "  listener http://127.0.0.1:8080",
        "  upstream gpus: 4 servers (127.0.0.1:9001, 127.0.0.1:9002 weight=5 max_fails=3"
        " fail_timeout=30s, 127.0.0.1:9003 weight=0 (draining), 127.0.0.1:9004 backup)",
        "    balance least_streams; retry on error, timeout, http_502, http_503: 2 tries within"
        " 5s, bodies not replayed",
        "    sticky by cookie:chat_session, header:x-chat-id, body:metadata.session_id;"
        " cookie mux_srv (3600s)",
        "    health check GET /healthz every 10s (timeout 2s, expect 200, up after 2,"
        " down after 2)",
        "    set headers x-chat-id, authorization",
        "    timeouts first_token 120s, idle 300s",
        "  route /v1/ -> gpus (retry until first event; resume: 128 KiB of events for 20s,"
        " in redis://cache:6379/0; continue on failure)",
        "  log: access stderr (text), error log level info",
        "  graceful stop: streams get 600s to finish (timeouts.shutdown_grace)",
    ]
    assert "sk-live" not in result.stdout  # header values are not shown
    assert "s3cret" not in result.stdout


def test_check_names_the_proxies_a_listener_trusts() -> None:
    config = parse_config(
        {
            "listeners": [
                {"address": "127.0.0.1:8080", "trusted_proxies": ["10.0.0.0/8", "::1"]},
                {"address": "127.0.0.1:8081"},
            ],
            "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
        }
    )
    assert describe_config(config)[:2] == [
        "listener http://127.0.0.1:8080 (forwarded fields trusted from 10.0.0.0/8, ::1/128)",
        "listener http://127.0.0.1:8081",
    ]


def test_check_says_where_a_group_discovers_its_servers_and_what_the_fleet_shares() -> None:
    config = parse_config(
        {
            "listeners": [{"address": "127.0.0.1:8080"}],
            "upstreams": {
                "gpus": {"discover": {"dns": "vllm.llm.svc", "port": 8000}, "slow_start": 30},
                "lora": {"discover": {"srv": "_http._tcp.lora.llm.svc", "interval": 10}},
            },
            "routes": [
                {"prefix": "/v1/", "upstream": "gpus"},
                {"prefix": "/lora/", "upstream": "lora"},
            ],
            "resolver": {"nameservers": ["10.96.0.10"], "attempts": 1},
            "fleet": {"store": "rediss://:s3cret@redis:6380/1", "on_store_error": "closed"},
        },
        environ={},
    )
    lines = describe_config(config)
    assert lines[1] == (
        "upstream gpus: servers from DNS: A/AAAA records of vllm.llm.svc, port 8000, looked up"
        " every 5s (or the TTL, if shorter); new servers ramp in over 30s"
    )
    assert (
        "upstream lora: servers from DNS: SRV records of _http._tcp.lora.llm.svc, looked up"
        " every 10s (or the TTL, if shorter)"
    ) in lines
    assert "resolver: 10.96.0.10:53 (timeout 2s, 1 attempt)" in lines
    assert (
        "fleet: runtime state, session memory and budgets shared through rediss://redis:6380/1"
        " (reconciled every 5s; budgets while it is down: closed)"
    ) in lines
    assert not any("s3cret" in line for line in lines)


LLM_FLEET = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [{ address = "127.0.0.1:9001", max_streams = 64, max_waiting = 4 }, "127.0.0.1:9002"]
balance = "least_load"
affinity = "prefix"
prefix = { balance_gap = 16 }
load_report = { interval = 1 }
tenant = "header:Authorization"
priority = "header:X-Priority"
rate_limit = { tokens_per_minute = 100000 }
queue = { max_wait = { 9 = "2s", 0 = 60 } }
"""


def test_check_summarizes_balancing_and_admission(tmp_path: Path) -> None:
    (tmp_path / "llm.toml").write_text(LLM_FLEET)
    result = run_cli("check", "--config", "llm.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2:9] == [
        "  upstream gpus: 2 servers (127.0.0.1:9001 max_streams=64 max_waiting=4, 127.0.0.1:9002)",
        "    balance least_load; retry on error, timeout: 3 tries within 10s, bodies up to 1 MiB",
        "    prefix affinity on the first 1 KiB of auto prompts, bounded at 1.25 x the mean load"
        " and 16 streams over the least loaded server",
        "    load reports GET /metrics every 1s (stale after 3s; no new sessions above 95% KV"
        " cache)",
        "    admission queue of 1000, 30s at most, class 0: 60s, class 9: 2s, then 429"
        " (Retry-After 1s)",
        "    budget per tenant: 100000 tokens a minute",
        "    tenant by header:authorization; priority by header:x-priority",
    ]


def test_check_summarizes_placement_by_kv_events(tmp_path: Path) -> None:
    (tmp_path / "kv.toml").write_text(
        '[[listeners]]\naddress = "127.0.0.1:8080"\n[upstreams.gpus]\naffinity = "prefix"\n'
        'servers = ["127.0.0.1:9001", { address = "127.0.0.1:9002", kv_events ='
        ' "tcp://127.0.0.1:6000" }]\nkv_events = { stale_after = "500ms" }\n'
    )
    result = run_cli("check", "--config", "kv.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "    placed by the engines' KV-cache events on port 5557 (1 at their own endpoint),"
        ' topic "kv-events", untrusted after 0.5s silent while busy'
    ) in result.stdout.splitlines()


def test_check_bad_routing_file(tmp_path: Path) -> None:
    assert refused_by_check(tmp_path, "bad.toml", BAD_ROUTING) == [
        "muxproxy: bad.toml: invalid configuration",
        "  upstreams.gpus.servers: every server is a backup; expected at least one primary"
        " server to take the traffic: set backup = false on one of them, or add one",
        '  upstreams.gpus.sticky.sources[0]: unknown kind "cookies"; expected "kind:name" with'
        ' kind cookie, header, query or body, e.g. "header:X-Chat-ID", got "cookies:chat";'
        ' did you mean "cookie:chat"?',
        '  upstreams.gpus.sticky.cookie.same_site: expected "Strict", "Lax" or "None",'
        ' got "lax"; did you mean "Lax"?',
        '  upstreams.gpus.next_upstream.retries: unknown key; did you mean "tries"?',
        '  upstreams.gpus.next_upstream.on[0]: expected "error", "timeout", "http_429",'
        ' "http_502", "http_503" or "http_504", got "eror"; did you mean "error"?',
        "  upstreams.gpus.health_check.timeout: expected timeout (5s) to be less than interval"
        " (5s), so that a check ends before the next one starts; lower timeout or raise"
        " interval",
        '  routes[0].retry_until_first_event: expected true or false (a TOML boolean), got "true"',
    ]


def test_check_missing_file(tmp_path: Path) -> None:
    result = run_cli("check", "--config", "nope.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "muxproxy: nope.toml: invalid configuration",
        "  nope.toml: no such file",
    ]


def test_check_toml_syntax_error(tmp_path: Path) -> None:
    (tmp_path / "broken.toml").write_text('[[listeners]]\naddress = "127.0.0.1:8080"\n[upstreams\n')
    result = run_cli("check", "--config", "broken.toml", cwd=tmp_path)
    assert result.returncode == 2
    head, problem = result.stderr.splitlines()
    assert head == "muxproxy: broken.toml: invalid configuration"
    assert problem.startswith("  broken.toml, line 3, column ")
    assert "invalid TOML" in problem


LIMITS = """\
[[listeners]]
address = "127.0.0.1:8080"

[limits]
max_concurrent_streams = {streams}
max_request_head = {head}

[timeouts]
read = {read}

[upstreams.gpus]
servers = ["127.0.0.1:9001"]
"""


def test_check_refuses_http2_settings_out_of_range_and_infinite_timeouts(tmp_path: Path) -> None:
    big = LIMITS.format(streams=2**32, head=2**40, read="inf")
    assert refused_by_check(tmp_path, "big.toml", big) == [
        "muxproxy: big.toml: invalid configuration",
        "  timeouts.read: expected a positive, finite number of seconds, got inf",
        f"  limits.max_concurrent_streams: expected 1 to 1000000, got {2**32}; lower it to"
        " 1000000 or less",
        "  limits.max_request_head: expected 1 to 8388608 bytes (8 MiB, Envoy's largest), got"
        f" {2**40}; lower it to 8388608 or less",
    ]


def test_check_accepts_the_top_of_each_range(tmp_path: Path) -> None:
    (tmp_path / "top.toml").write_text(LIMITS.format(streams=10**6, head=8 * 2**20, read=86400))
    result = run_cli("check", "--config", "top.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "muxproxy: top.toml: configuration is valid"


HUGE = """\
[[listeners]]
address = "127.0.0.1:8080"

[limits]
stream_buffer = {big}

[timeouts]
read = 1e300

[upstreams.gpus]
servers = [{{ address = "127.0.0.1:9001", weight = {big}, max_streams = {big} }}]
queue = {{ max = {big} }}
rate_limit = {{ tokens_per_minute = {big} }}
tenant = "header:Authorization"

[[routes]]
prefix = "/"
upstream = "gpus"
resume = {{ window = {big} }}
"""


def test_check_refuses_numbers_past_their_range(tmp_path: Path) -> None:
    """The numbers an audit found accepted: 2**64 for a weight, max_streams, stream_buffer,
    queue.max, tokens_per_minute and resume.window, 1e300 seconds for a timeout."""
    big = 2**64
    assert refused_by_check(tmp_path, "huge.toml", HUGE.format(big=big)) == [
        "muxproxy: huge.toml: invalid configuration",
        "  timeouts.read: expected more than 0 and at most 86400 seconds (a day), got 1e+300;"
        " lower it to 86400 or less",
        "  limits.stream_buffer: expected 2048 to 1073741824 bytes (at least two socket reads;"
        f" at most 1 GiB held for one stream), got {big}; lower it to 1073741824 or less",
        "  upstreams.gpus.servers[0].weight: expected 0 to 1000000 (weights are relative"
        f" shares), got {big}; lower it to 1000000 or less",
        f"  upstreams.gpus.servers[0].max_streams: expected 1 to 1000000, got {big}; lower it"
        " to 1000000 or less",
        f"  upstreams.gpus.queue.max: expected 0 to 1000000, got {big}; lower it to 1000000"
        " or less",
        "  upstreams.gpus.rate_limit.tokens_per_minute: expected 1 to 1000000000 (a billion a"
        f" minute), got {big}; lower it to 1000000000 or less",
        "  routes[0].resume.window: expected 4096 to 1073741824 bytes (at least a few events;"
        f" at most 1 GiB held for one stream), got {big}; lower it to 1073741824 or less",
    ]


@pytest.mark.parametrize("value", ["1e400", "nan", "-inf"])
def test_check_refuses_non_finite_timeouts(tmp_path: Path, value: str) -> None:
    (tmp_path / "t.toml").write_text(LIMITS.format(streams=100, head=65536, read=value))
    result = run_cli("check", "--config", "t.toml", cwd=tmp_path)
    assert result.returncode == 2
    shown = {"1e400": "inf"}.get(value, value)
    assert result.stderr.splitlines()[1:] == [
        f"  timeouts.read: expected a positive, finite number of seconds, got {shown}"
    ]


def test_check_deeply_nested_toml_is_one_clean_line(tmp_path: Path) -> None:
    (tmp_path / "deep.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    result = run_cli("check", "--config", "deep.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "muxproxy: deep.toml: invalid configuration",
        "  deep.toml: invalid TOML: arrays or inline tables nested too deeply",
    ]


def test_serve_swapped_tls_flags_exit_2_naming_the_flag_and_files(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
    result = run_cli(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:9001",
        "--tls-cert",
        "key.pem",
        "--tls-key",
        "cert.pem",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "muxproxy: invalid configuration",
        '  --tls-cert: "key.pem" holds no certificate, but "cert.pem" does: the two files look'
        " swapped; give the certificate as --tls-cert and the key as --tls-key",
    ]


def test_serve_config_with_swapped_tls_files_exits_2(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
    (tmp_path / "tls.toml").write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\ntls_cert = "key.pem"\ntls_key = "cert.pem"\n'
        '[upstreams.a]\nservers = ["127.0.0.1:9001"]\n'
    )
    for command in ("serve", "check"):
        result = run_cli(command, "--config", "tls.toml", cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            "muxproxy: tls.toml: invalid configuration",
            '  listeners[0].tls_cert: "key.pem" holds no certificate, but "cert.pem" does:'
            " the two files look swapped; give the certificate as tls_cert and the key as"
            " tls_key",
        ]


def test_fakellm_on_a_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("fakellm", "--port", str(port), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"muxproxy fakellm: port {port} is in use (127.0.0.1:{port}); pick another --port,"
        " or 0 for any"
    ]


def test_check_imports_nothing_it_does_not_need(tmp_path: Path) -> None:
    """Lazy imports: ``check`` loads neither Trio nor the server, fakellm or demo modules."""
    (tmp_path / "good.toml").write_text(GOOD)
    code = (
        "import sys\n"
        "from muxproxy.process.cli import main\n"
        "assert main(['check', '--config', 'good.toml']) == 0\n"
        "loaded = [m for m in ('trio', 'muxproxy.trio.server', 'muxproxy.testing.fakellm',"
        " 'muxproxy.demo') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


SERVE_NEEDS_NOT = (
    "prometheus_client",  # load reports only: its import brings an HTTP server, email...
    "http.server",
    "email",
    "difflib",  # did-you-mean in configuration errors only
    "muxproxy.trio.metrics",
    "muxproxy.trio.admin",
    "muxproxy.trio.resumestore",
    "muxproxy.testing.fakellm",
    "muxproxy.demo",
)
"""Modules a plain ``serve`` (flags, no admin API, no load report, no resume store) must not
hold: each costs every serving process memory for a feature it does not use
(docs/performance.md, "Stalled HTTP/2 readers")."""


def test_serve_imports_nothing_it_does_not_need(tmp_path: Path) -> None:
    """Lazy imports: a plain ``serve``, once it listens, holds none of ``SERVE_NEEDS_NOT``.

    The real command runs in a fresh interpreter; the moment it prints its listening line,
    the modules it holds are read and it is stopped as an operator would (SIGTERM)."""
    code = (
        "import io, signal, sys\n"
        "from muxproxy.process.cli import main\n"
        "held = []\n"
        "class Out(io.StringIO):\n"
        "    def write(self, text):\n"
        "        if text.startswith('muxproxy listening') and not held:\n"
        "            held.extend(sys.modules)\n"
        "            signal.raise_signal(signal.SIGTERM)\n"
        "        return super().write(text)\n"
        "sys.stdout = Out()\n"
        "assert main(['serve', '--listen', '127.0.0.1:0', '--upstream', '127.0.0.1:9']) == 0\n"
        "assert held, 'never listened'\n"
        f"loaded = [m for m in {SERVE_NEEDS_NOT!r} if m in held]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- in process --------------------------------------------------------------------------------


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: muxproxy" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    build = muxproxy.compiled.build()
    assert capsys.readouterr().out.strip() == f"muxproxy {muxproxy.__version__} ({build})"


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check"]) == 2
    assert "--config" in capsys.readouterr().err


def test_check_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    assert main(["check", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"muxproxy: {path}: invalid configuration"


def test_serve_flags_are_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["serve", "--listen", "localhost", "--upstream", "127.0.0.1:9001", "--upstream", "x:99999"]
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "muxproxy: invalid configuration",
        '  --listen: expected "host:port", got "localhost"',
        '  --upstream: expected "host:port" with a port in 1..65535, got "x:99999"',
    ]


def test_serve_listen_needs_an_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--listen", "127.0.0.1:8080"]) == 2
    assert '--upstream: missing; expected at least one "host:port"' in capsys.readouterr().err


def test_serve_needs_config_or_listen(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "one of the arguments --config --listen is required" in capsys.readouterr().err


def test_serve_config_and_listen_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "a.toml", "--listen", "127.0.0.1:1"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_serve_config_rejects_quick_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "a.toml", "--upstream", "127.0.0.1:1"]) == 2
    assert "--upstream cannot be used with --config" in capsys.readouterr().err


def test_serve_bad_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    assert main(["serve", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"muxproxy: {path}: invalid configuration"


# --- serve, with a stand-in for muxproxy.trio.server -------------------------------------------


def fake_server(monkeypatch: pytest.MonkeyPatch, behaviour: str) -> list[Any]:
    """Install a stand-in ``muxproxy.trio.server``; returns the configs it was run with."""
    seen: list[Any] = []

    class ProxyServer:
        def __init__(self, config: Any) -> None:
            seen.append(config)
            self.config = config
            self.stop_summary = None

        async def run(
            self, *, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
        ) -> None:
            config = self.config
            if behaviour == "oserror":
                raise OSError(98, "Address already in use")
            task_status.started(
                [(listener.host, listener.port or 40000) for listener in config.listeners]
            )
            if behaviour == "interrupt":
                raise KeyboardInterrupt
            if behaviour == "crash":
                raise RuntimeError("boom")

    install_server(monkeypatch, ProxyServer)
    return seen


def install_server(monkeypatch: pytest.MonkeyPatch, server: type) -> None:
    module = types.ModuleType("muxproxy.trio.server")
    module.ProxyServer = server  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "muxproxy.trio.server", module)


def test_serve_quick_prints_listening_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = fake_server(monkeypatch, "return")
    assert main(["serve", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9001"]) == 0
    assert seen == [quick_config("127.0.0.1:0", ["127.0.0.1:9001"])]
    assert capsys.readouterr().out == "muxproxy listening on http://127.0.0.1:40000\n"


def test_serve_freezes_the_startup_heap_once_it_listens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What start-up allocated leaves the collector's view (``gc.freeze``) once the server
    listens, not before: a full collection would walk it all, a pause of every stream."""
    frozen: list[int] = []

    class ProxyServer:
        def __init__(self, config: Any) -> None:
            self.config = config
            self.stop_summary = None

        async def run(
            self, *, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
        ) -> None:
            frozen.append(gc.get_freeze_count())
            task_status.started([(self.config.listeners[0].host, 40000)])
            await trio.testing.wait_all_tasks_blocked()  # the caller has gone on
            frozen.append(gc.get_freeze_count())

    install_server(monkeypatch, ProxyServer)
    gc.unfreeze()
    try:
        assert main(["serve", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9001"]) == 0
    finally:
        gc.unfreeze()
    assert frozen[0] == 0
    assert frozen[1] > 1000, frozen
    assert "listening" in capsys.readouterr().out


def test_serve_config_file_with_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tls_pair(tmp_path)
    path = tmp_path / "tls.toml"
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:8080"\n'
        '[[listeners]]\naddress = "[::1]:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"\n'
        '[upstreams.a]\nservers = ["127.0.0.1:9001"]\n'
    )
    fake_server(monkeypatch, "return")
    assert main(["serve", "--config", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "muxproxy listening on http://127.0.0.1:8080",
        "muxproxy listening on https://[::1]:8443",
    ]


def test_serve_ctrl_c_is_quiet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server(monkeypatch, "interrupt")
    assert main(["serve", "--listen", "127.0.0.1:8080", "--upstream", "127.0.0.1:9001"]) == 0
    assert capsys.readouterr().err == ""


def test_serve_cannot_listen(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server(monkeypatch, "oserror")
    assert main(["serve", "--listen", "127.0.0.1:8080", "--upstream", "127.0.0.1:9001"]) == 1
    assert "muxproxy: cannot serve: [Errno 98] Address already in use" in capsys.readouterr().err


def test_serve_other_errors_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_server(monkeypatch, "crash")
    with pytest.raises((RuntimeError, BaseExceptionGroup)) as info:
        main(["serve", "--listen", "127.0.0.1:8080", "--upstream", "127.0.0.1:9001"])
    error = info.value
    found = error.split(RuntimeError)[0] if isinstance(error, BaseExceptionGroup) else error
    assert "boom" in repr(found)


def test_listening_lines_match_by_port_when_counts_differ() -> None:
    config = quick_config("0.0.0.0:8443", ["127.0.0.1:9001"], tls_cert="c", tls_key="k")
    assert listening_lines(config, [("0.0.0.0", 8443), ("::", 8443)]) == [
        "muxproxy listening on https://0.0.0.0:8443",
        "muxproxy listening on https://[::]:8443",
    ]


# --- delegated subcommands --------------------------------------------------------------------


def fake_delegate(monkeypatch: pytest.MonkeyPatch, name: str) -> list[argparse.Namespace]:
    runs: list[argparse.Namespace] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--port", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        runs.append(args)
        return 7

    module = types.ModuleType(name)
    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return runs


@pytest.mark.parametrize(
    ("command", "module"), [("fakellm", "muxproxy.testing.fakellm"), ("demo", "muxproxy.demo")]
)
def test_delegated_subcommand(monkeypatch: pytest.MonkeyPatch, command: str, module: str) -> None:
    runs = fake_delegate(monkeypatch, module)
    assert main([command, "--port", "5"]) == 7
    (args,) = runs
    assert args.port == 5


@pytest.mark.parametrize(
    ("command", "module"), [("fakellm", "muxproxy.testing.fakellm"), ("demo", "muxproxy.demo")]
)
def test_delegated_subcommand_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    assert main([command]) == 1
    assert capsys.readouterr().err.startswith(f"muxproxy: {command} is not available: ")


def test_delegated_subcommand_arguments_are_not_loaded_for_other_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "muxproxy.testing.fakellm", None)
    monkeypatch.setitem(sys.modules, "muxproxy.demo", None)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "fakellm" in out
    assert "demo" in out
