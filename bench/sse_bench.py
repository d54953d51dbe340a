"""SSE relay benchmark: direct vs muxproxy (HTTP/1.1 and h2c clients) vs nginx vs a Trio relay.

One command runs every variant against the same SSE backend, with the same load, and prints a
markdown table (and writes everything measured to ``bench/results/*.json``). Three modes:

``--mode stream`` (the default): paced streams, one event per ``--interval`` each::

    python bench/sse_bench.py --streams 100,300,1000 --interval 0.02 --warmup 3 --duration 10

  latency (arrival - send time), proxy CPU per event, TTFB, RSS per idle stream.

``--mode saturation``: ``--streams`` streams of back-to-back events (``--burst`` per backend
write): how many events per second one proxy process relays, and per core of proxy CPU::

    python bench/sse_bench.py --mode saturation --streams 16 --warmup 3 --duration 10

``--mode llm``: the load LLM routers are benchmarked with (``llm_load.py``: Poisson arrivals of
streamed ``POST /v1/chat/completions``, a TTFT, then one token per ``--interval``): TTFT, ITL,
E2E latency, completed and failed requests, proxy CPU per token::

    python bench/sse_bench.py --mode llm --rate 20 --requests 800

Variants (``--variants``, comma-separated, default the first five):

* ``direct``       client -> backend
* ``muxproxy-h1``  HTTP/1.1 client -> muxproxy -> HTTP/1.1 backend
* ``muxproxy-h2``  h2c client (``--h2-per-conn`` streams per connection) -> muxproxy -> backend
* ``nginx``        HTTP/1.1 client -> nginx (Debian package, 1 worker, SSE-guide config)
* ``nginx-h2``     h2c client (prior knowledge) -> the same nginx, ``listen ... http2``
* ``base-h1``, ``base-h2``: muxproxy from ``--baseline-src`` (another checkout, e.g. a git
  worktree of the commit before a change), so that before and after run in one session,
  round robin with ``--repeat``
* ``haproxy``, ``haproxy-h2``: HTTP/1.1 / h2c client -> HAProxy (Debian package, one thread,
  ``http-reuse always``, ``option http-no-delay``); not in the default list
* ``trio-relay``   HTTP/1.1 client -> bench/trio_relay.py (bare byte relay) -> backend
* ``epoll-relay``  the same relay with ``--epoll``: the floor of muxproxy's reactor design
  (not in the default list)
* ``muxproxy-h1-wN``, ``muxproxy-h2-wN``: ``muxproxy serve --workers N`` (a supervisor and N
  worker processes); "the proxy" is then all of them: CPU and RSS are their sums.
* ``sglang-router``, ``sglang-router-h2``, ``vllm-router``, ``vllm-router-h2``: HTTP/1.1 / h2c
  client -> the Rust LLM router (``--routers-venv``: ``pip install sglang-router
  vllm-router``; ``--policy round_robin``, one worker: the backend; ``--router-threads`` tokio
  worker threads, default 1) -> backend. The routers route only inference endpoints and drop
  the query string, so for them the clients send every ``GET /sse?...`` as ``POST
  /v1/chat/completions`` naming that target, and the backend (``router_compat.py``, used for
  the whole session when a router variant is in it) streams the same bytes as for the ``GET``
  and answers the routers' ``/health``, ``/server_info``, ``/model_info``. Not in the default
  list.

For each variant a fresh proxy process is started. In ``stream`` mode first the idle-stream RSS
is measured (``--idle-streams`` streams that receive nothing), then one load run per
``--streams`` value; the other modes have one run per ``--streams`` (saturation) or ``--rate``
(llm) value. Every process this script starts is stopped at the end, also on errors (by PID).

The backend (``sse_backend.py``) and the load client (``sse_client.py``, ``llm_load.py``) are
separate processes; the client measures the window and reads the CPU time of the backend and of
the proxy from ``/proc/PID/stat``. See docs/performance.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BACKEND = HERE / "sse_backend.py"
CLIENT = HERE / "sse_client.py"
LLM_CLIENT = HERE / "llm_load.py"
RELAY = HERE / "trio_relay.py"
PYSPY_TOP = HERE / "pyspy_top.py"
TOKEN_TRACE = HERE / "token_trace.py"
ROUTER_COMPAT = HERE / "router_compat.py"

VARIANTS = {
    # name: (label, proxy kind or None, client protocol)
    "direct": ("(a) direct", None, "h1"),
    "muxproxy-h1": ("(b) muxproxy h1→h1", "muxproxy", "h1"),
    "muxproxy-h2": ("(c) muxproxy h2→h1", "muxproxy", "h2"),
    "base-h1": ("(b0) baseline muxproxy h1→h1", "muxproxy-base", "h1"),
    "base-h2": ("(c0) baseline muxproxy h2→h1", "muxproxy-base", "h2"),
    "nginx": ("(d) nginx h1→h1", "nginx", "h1"),
    "nginx-h2": ("(d2) nginx h2→h1", "nginx-h2", "h2"),
    "haproxy": ("(j) HAProxy h1→h1", "haproxy", "h1"),
    "haproxy-h2": ("(j2) HAProxy h2→h1", "haproxy-h2", "h2"),
    "trio-relay": ("(e) trio-relay", "relay", "h1"),
    "epoll-relay": ("(h) epoll relay", "relay-epoll", "h1"),
    "sglang-router": ("(k) sglang-router h1→h1", "sglang-router", "h1"),
    "sglang-router-h2": ("(k2) sglang-router h2→h1", "sglang-router", "h2"),
    "vllm-router": ("(l) vllm-router h1→h1", "vllm-router", "h1"),
    "vllm-router-h2": ("(l2) vllm-router h2→h1", "vllm-router", "h2"),
}
DEFAULT_VARIANTS = ["direct", "muxproxy-h1", "muxproxy-h2", "nginx", "trio-relay"]
WORKERS_VARIANT = re.compile(r"muxproxy-(h1|h2)-w([1-9][0-9]*)")
"""``muxproxy-h1-w2``: ``muxproxy serve --workers 2`` (supervisor + 2 workers), HTTP/1.1 client."""
WORK_VARIANT = re.compile(r"epoll-relay-([1-9][0-9]*)us")
"""``epoll-relay-40us``: the epoll relay spending 40 µs of CPU per read (``--work-us``): how the
tail of a relay with muxproxy's I/O grows with the work it does per token."""

NGINX_CONF = """\
worker_processes 1;
worker_rlimit_nofile 20000;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{
    worker_connections 16384;
}}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    tcp_nodelay on;
    keepalive_timeout 75s;
    upstream sse_backend {{
        server {backend};
        keepalive 64;
    }}
    server {{
        listen {listen} backlog=4096{http2};
        location / {{
            proxy_pass http://sse_backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


ROUTERS = {
    # proxy kind: (PyPI package, module to run with -m, the module its import needs, log level)
    "sglang-router": (
        "sglang-router",
        "sglang_router.launch_router",
        "sglang_router.sglang_router_rs",
        "warn",
    ),
    "vllm-router": ("vllm-router", "vllm_router.launch_router", "vllm_router_rs", "warning"),
}
"""The Rust LLM routers, from their own venv (``--routers-venv``), each with the same options:
``--worker-urls http://BACKEND --policy round_robin``, a Prometheus port of its own, warnings
only in the log (at ``info`` sglang-router writes two lines per request)."""
ROUTERS_VENV = Path(os.environ.get("MUXBENCH_ROUTERS_VENV", "/work/bench-routers"))
ROUTER_THREADS = 1
"""``--router-threads``: the routers' tokio worker threads (``TOKIO_WORKER_THREADS``); 0: tokio's
default, one per CPU the router may use."""
ROUTERS_INSTALL = "python3 -m venv {venv} && {venv}/bin/pip install sglang-router vllm-router"


def is_router(name: str) -> bool:
    return variant(name)[1] in ROUTERS


def router_python() -> Path:
    return ROUTERS_VENV / "bin" / "python"


HAPROXY_CONF = """\
global
    nbthread 1
    maxconn 9000
    pidfile {tmp}/haproxy.pid
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout tunnel 300s
    option http-no-delay
frontend sse
    bind {listen}{proto}
    default_backend sse_backend
backend sse_backend
    http-reuse always
    server s1 {backend}
"""


def variant(name: str) -> tuple[str, str | None, str, int]:
    """(label, proxy kind or None, client protocol, muxproxy worker processes) of a variant."""
    m = WORK_VARIANT.fullmatch(name)
    if m:
        return f"(i) epoll relay + {m.group(1)} µs/read", f"relay-epoll:{m.group(1)}", "h1", 0
    m = WORKERS_VARIANT.fullmatch(name)
    if m:
        proto, workers = m.group(1), int(m.group(2))
        letter = "f" if proto == "h1" else "g"
        return f"({letter}) muxproxy {proto}→h1, {workers} workers", "muxproxy", proto, workers
    label, kind, proto = VARIANTS[name]
    return label, kind, proto, 0


def variant_order(name: str) -> tuple[int, str]:
    order = list(VARIANTS)
    return (order.index(name) if name in order else len(order), name)


# --- processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def wait_routed(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until a router relays a bench stream: it listens before it has registered its worker
    (sglang-router answers 503 until then). Polls ``POST /v1/chat/completions`` for
    ``/sse?n=1`` (router_compat.py) until a 200 with an event comes back."""
    import router_compat  # beside this script

    body = router_compat.chat_body(b"/sse?n=1")
    request = (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (router_compat.CHAT, len(body), body)
    )
    deadline = time.monotonic() + timeout
    last = b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 2) as s:
            s.settimeout(2)
            s.sendall(request)
            last = b""
            while b"data: " not in last and len(last) < 65536:
                data = s.recv(65536)
                if not data:
                    break
                last += data
            if last.startswith(b"HTTP/1.1 200") and b"data: " in last:
                return
        time.sleep(0.1)
    status = last.split(b"\r\n", 1)[0].decode(errors="replace") or "no answer"
    raise RuntimeError(f"the router relayed no stream after {timeout} s (last: {status})")


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (children, their children, ...), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        ppid = int(raw[raw.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


class StartError(RuntimeError):
    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


class Proc:
    """A process we started: its log, the PIDs to measure, and a stop that always happens."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        port: int,
        cwd: Path | None = None,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.port = port
        self.logfile = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self.logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            # A shell without job control starts background jobs with SIGINT ignored; give the
            # child the default back so that stop() can end it gracefully with SIGINT.
            preexec_fn=lambda: start_child(cpus),
        )
        self.extra: list[int] = []
        """Descendants we found (nginx or muxproxy workers): measured and stopped with it."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def measured_pids(self) -> list[int]:
        return [self.pid, *self.extra]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if self.name == "muxproxy" else signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for pid in self.extra:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.logfile.close()

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


def start_child(cpus: set[int] | None) -> None:
    """In a child before ``exec``: the default SIGINT (a shell without job control starts
    background jobs with it ignored, and ``Proc.stop`` ends children with it), and the CPUs it
    may run on (``--proxy-cpus``; its own children inherit them)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if cpus:
        os.sched_setaffinity(0, cpus)


PROXY_CPUS: set[int] | None = None
"""``--proxy-cpus``: the CPUs every proxy runs on; the backend and the clients get the others."""


def split_cpus(parser: argparse.ArgumentParser, spec: str | None) -> set[int] | None:
    """``--proxy-cpus 1``: the proxy's CPUs; this process (and what it starts without
    ``cpus``) moves to the others. None without the option; a parser error for CPUs this
    process may not use, or for leaving none to the load."""
    if not spec:
        return None
    proxy = {int(c) for c in spec.split(",")}
    allowed = os.sched_getaffinity(0)
    if proxy - allowed:
        parser.error(
            f"--proxy-cpus {spec}: CPUs {sorted(proxy - allowed)} are not among those this "
            f"process may use ({sorted(allowed)})"
        )
    if not allowed - proxy:
        parser.error(f"--proxy-cpus {spec}: leave the load a CPU of its own")
    os.sched_setaffinity(0, allowed - proxy)
    return proxy


def start_backend(tmp: Path, interval_ms: float, slots: int, routers: bool = False) -> Proc:
    """``routers``: the backend with what the LLM routers ask of a worker (router_compat.py)."""
    port = free_port()
    argv = [
        sys.executable,
        *([str(ROUTER_COMPAT), "backend"] if routers else [str(BACKEND)]),
        "--port",
        str(port),
        "--interval-ms",
        str(interval_ms),
        "--slots",
        str(slots),
    ]
    proc = Proc("backend", argv, tmp / "backend.log", port)
    wait_listening(port, proc.proc)
    return proc


MUXPROXY_SRC = ROOT
BASELINE_SRC = ROOT
"""The checkout of the ``base-h1`` / ``base-h2`` variants (``--baseline-src``)."""
"""The checkout whose ``muxproxy`` package the muxproxy variants run (``--muxproxy-src``)."""
TRACE_DIR: Path | None = None
"""``--trace``: muxproxy runs under ``token_trace.py``, which writes its summary here at exit."""


def start_proxy(kind: str, tmp: Path, backend: str, nginx: str, workers: int = 0) -> Proc:
    """Start a proxy and wait until it listens (and its workers exist); StartError if not."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    listen = f"127.0.0.1:{port}"
    if kind in ("muxproxy", "muxproxy-base"):
        src = BASELINE_SRC if kind == "muxproxy-base" else MUXPROXY_SRC
        argv = [sys.executable, "-m", "muxproxy", "serve", "--listen", listen]
        if TRACE_DIR is not None and not workers:
            argv[1:3] = [str(TOKEN_TRACE), "--out", str(TRACE_DIR / f"{tmp.name}.json")]
        argv += ["--upstream", backend]
        if workers:
            argv += ["--workers", str(workers)]
        # ``-m`` puts the working directory first on sys.path: the package of MUXPROXY_SRC runs.
        proc = Proc("muxproxy", argv, tmp / "muxproxy.log", port, cwd=src, cpus=PROXY_CPUS)
    elif kind == "relay" or kind.startswith("relay-epoll"):
        argv = [sys.executable, str(RELAY), "--listen", listen, "--upstream", backend]
        if kind != "relay":
            argv.append("--epoll")
            _, _, work_us = kind.partition(":")
            if work_us:
                argv += ["--work-us", work_us]
        proc = Proc(kind, argv, tmp / f"{tmp.name}.log", port, cpus=PROXY_CPUS)
    elif kind in ("nginx", "nginx-h2"):
        ntmp = tmp / "nginx"
        ntmp.mkdir(exist_ok=True)
        for parent in (tmp, tmp.parent):
            parent.chmod(0o755)
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (ntmp / sub).mkdir(exist_ok=True)
        # Workers run as nobody when started by root: let them use the temp paths.
        for path in [ntmp, *ntmp.iterdir()]:
            path.chmod(0o777)
        conf = ntmp / "nginx.conf"
        http2 = " http2" if kind == "nginx-h2" else ""
        conf.write_text(NGINX_CONF.format(tmp=ntmp, backend=backend, listen=listen, http2=http2))
        argv = [
            nginx,
            "-p",
            str(ntmp),
            "-c",
            str(conf),
            "-e",
            str(ntmp / "error.log"),
            "-g",
            "daemon off;",
        ]
        proc = Proc("nginx", argv, tmp / "nginx.log", port, cpus=PROXY_CPUS)
    elif kind in ("haproxy", "haproxy-h2"):
        conf = tmp / "haproxy.cfg"
        proto = " proto h2" if kind == "haproxy-h2" else ""
        conf.write_text(HAPROXY_CONF.format(tmp=tmp, backend=backend, listen=listen, proto=proto))
        argv = [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(conf)]
        proc = Proc("haproxy", argv, tmp / "haproxy.log", port, cpus=PROXY_CPUS)
    elif kind in ROUTERS:
        _, module, _, log_level = ROUTERS[kind]
        argv = [str(router_python()), "-m", module, "--worker-urls", f"http://{backend}"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        argv += ["--log-level", log_level]
        env = dict(os.environ)
        env.pop("TOKIO_WORKER_THREADS", None)
        if ROUTER_THREADS:
            env["TOKIO_WORKER_THREADS"] = str(ROUTER_THREADS)
        proc = Proc(kind, argv, tmp / f"{kind}.log", port, cpus=PROXY_CPUS, env=env)
    else:
        raise ValueError(kind)
    try:
        wait_listening(port, proc.proc)
        if kind in ROUTERS:
            wait_routed(port, proc.proc)
        # nginx: the master and its worker; muxproxy --workers N: the supervisor, N workers and
        # whatever else they started. All of them are measured as "the proxy".
        want = 1 if kind in ("nginx", "nginx-h2") else workers
        deadline = time.monotonic() + 15
        while len(proc.extra) < want and time.monotonic() < deadline:
            time.sleep(0.1)
            proc.extra = descendants(proc.pid)
        if len(proc.extra) < want:
            raise RuntimeError(f"{len(proc.extra)} child processes after 15 s, expected {want}")
    except RuntimeError as exc:
        proc.stop()
        raise StartError(str(exc), proc.log_tail()) from exc
    except BaseException:
        proc.stop()
        raise
    return proc


def run_client(
    args: argparse.Namespace,
    argv: list[str],
    timeout: float,
    script: Path = CLIENT,
    name: str = "",
) -> dict[str, object]:
    """Run a client script for variant ``name``; for a router, through router_compat.py (the
    same script with its requests in the shape the routers route)."""
    if name and is_router(name):
        cmd = [sys.executable, str(ROUTER_COMPAT), script.stem, *argv]
    else:
        cmd = [sys.executable, str(script), *argv]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"client timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        return {"error": f"client exit {done.returncode}: " + " | ".join(err)}
    try:
        return json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": "client printed no JSON: " + done.stdout.decode(errors="replace")[-300:]}


# --- the run -------------------------------------------------------------------------------


def quiesce(procs: list[Proc], limit: float = 15.0) -> None:
    """Wait until the processes we started are (nearly) idle, at most ``limit`` s."""
    deadline = time.monotonic() + limit
    pids = [pid for proc in procs for pid in proc.measured_pids()]
    time.sleep(0.5)
    while time.monotonic() < deadline:
        before = cpu_seconds(pids)
        time.sleep(0.5)
        if cpu_seconds(pids) - before < 0.05:  # under 10 % of a core
            return


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the processes that are still there (/proc/PID/stat)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
            fields = raw[raw.rfind(b")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class Session:
    """The backend and one fresh proxy per variant, all started up front so that the load runs
    can go round robin; ``stop()`` ends every process started (by PID), also after errors."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="muxbench-"))
        self.started: list[Proc] = []
        self.proxies: dict[str, Proc] = {}
        self.variants: list[str] = []
        """The variants whose proxy started."""
        self.runs: list[dict[str, object]] = []

    def start(self) -> None:
        args = self.args
        routers = any(is_router(name) for name in args.variants)
        self.backend = start_backend(self.tmp, args.interval * 1000.0, args.slots, routers)
        self.started.append(self.backend)
        self.baddr = f"127.0.0.1:{self.backend.port}"
        for name in args.variants:
            label, kind, _, workers = variant(name)
            if kind is not None:
                try:
                    proxy = start_proxy(kind, self.tmp / name, self.baddr, args.nginx, workers)
                except StartError as exc:
                    print(f"#   ERROR {label}: did not start: {exc}\n{exc.log}", file=sys.stderr)
                    error = f"proxy did not start: {exc}"
                    self.runs.append({"variant": name, "label": label, "error": error})
                    self.runs[-1]["log"] = exc.log
                    continue
                self.proxies[name] = proxy
                self.started.append(proxy)
            self.variants.append(name)

    def common(self, name: str) -> list[str]:
        """The client options every mode needs: where to send, what to measure."""
        proxy = self.proxies.get(name)
        argv = [
            "--target",
            f"127.0.0.1:{proxy.port}" if proxy else self.baddr,
            "--backend",
            self.baddr,
            "--proto",
            variant(name)[2],
            "--pid",
            f"backend={self.backend.pid}",
        ]
        if proxy:
            argv += ["--pid", "proxy=" + ",".join(map(str, proxy.measured_pids()))]
        return argv

    def rounds(
        self,
        params: list[Any],
        key: str,
        describe: Callable[[Any], str],
        client: Callable[[str, Any], tuple[Path, list[str], float]],
    ) -> None:
        """One client run per (repeat, param, variant), each parameter round robin over the
        variants. ``client(name, param)`` gives the client script, its options beyond
        ``common()`` and a timeout."""
        args = self.args
        names = self.variants
        for rep in range(args.repeat):
            for param in params:
                # Rotate the order each repeat so no variant always runs first or last.
                k = rep % max(1, len(names))
                for name in names[k:] + names[:k]:
                    label = variant(name)[0]
                    proxy = self.proxies.get(name)
                    if proxy is not None and not proxy.alive():
                        self.runs.append(
                            {
                                "variant": name,
                                "label": label,
                                key: param,
                                "error": "proxy is not running",
                                "log": proxy.log_tail(),
                            }
                        )
                        continue
                    print(
                        f"# [{rep + 1}/{args.repeat}] {label}: {describe(param)}", file=sys.stderr
                    )
                    script, argv, timeout = client(name, param)
                    res = run_client(args, [*self.common(name), *argv], timeout, script, name)
                    self.runs.append({"variant": name, "label": label, "repeat": rep, **res})
                    if proxy is not None:
                        self.runs[-1]["proxy_pids"] = proxy.measured_pids()
                    report_problems(label, res, proxy)
                    quiesce(self.started)

    def check_alive(self) -> None:
        for name, proxy in self.proxies.items():
            if not proxy.alive():
                self.runs.append(
                    {
                        "variant": name,
                        "label": variant(name)[0],
                        "error": f"proxy exited ({proxy.proc.returncode})",
                        "log": proxy.log_tail(),
                    }
                )

    def stop(self) -> None:
        for proc in reversed(self.started):
            proc.stop()
        if self.args.keep_tmp:
            print(f"# logs kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def bench(args: argparse.Namespace) -> dict[str, object]:
    """``--mode stream``, ``saturation`` or ``llm``: every variant, every parameter."""
    session = Session(args)
    try:
        session.start()
        if args.mode == "stream":
            bench_streams(args, session)
        elif args.mode == "saturation":
            session.rounds(
                args.streams,
                "streams",
                lambda streams: f"{streams} streams, back to back",
                lambda name, streams: (
                    CLIENT,
                    [
                        "--mode",
                        "saturation",
                        "--streams",
                        str(streams),
                        "--burst",
                        str(args.burst),
                        "--h2-per-conn",
                        str(args.h2_per_conn),
                        *window_opts(args),
                    ],
                    args.warmup + args.duration + 60,
                ),
            )
        else:
            session.rounds(args.rate, "rate", lambda rate: f"{rate:g} requests/s", llm_client(args))
        session.check_alive()
    finally:
        session.stop()
    return {"meta": meta(args), "runs": session.runs}


def window_opts(args: argparse.Namespace) -> list[str]:
    return ["--warmup", str(args.warmup), "--duration", str(args.duration)]


def llm_client(args: argparse.Namespace) -> Callable[[str, float], tuple[Path, list[str], float]]:
    def client(name: str, rate: float) -> tuple[Path, list[str], float]:
        argv = [
            "--rate",
            str(rate),
            "--requests",
            str(args.requests),
            "--seed",
            str(args.seed),
            "--ttft-ms",
            args.ttft_ms,
            "--tokens",
            args.tokens,
            "--pool-limit",
            str(args.pool_limit),
            "--h2-per-conn",
            str(args.h2_per_conn),
            "--drain",
            "60",
        ]
        return LLM_CLIENT, argv, args.requests / rate + 120

    return client


def bench_streams(args: argparse.Namespace, session: Session) -> None:
    """``--mode stream``: idle-stream RSS per proxy, then paced load runs."""
    interval_ms = args.interval * 1000.0
    stream_opts = [
        "--interval-ms",
        str(interval_ms),
        "--h2-per-conn",
        str(args.h2_per_conn),
        "--ramp-limit",
        str(args.ramp_limit),
    ]
    if args.idle_streams and not args.profile:
        for name, proxy in session.proxies.items():
            label = variant(name)[0]
            print(f"# {label}: {args.idle_streams} idle streams (RSS)", file=sys.stderr)
            res = run_client(
                args,
                [
                    *session.common(name),
                    *stream_opts,
                    "--mode",
                    "idle",
                    "--streams",
                    str(args.idle_streams),
                ],
                timeout=120,
                name=name,
            )
            session.runs.append({"variant": name, "label": label, **res})
            report_problems(label, res, proxy)
            quiesce(session.started)

    def client(name: str, streams: int) -> tuple[Path, list[str], float]:
        extra = []
        if args.profile and variant(name)[1] in (
            "muxproxy",
            "muxproxy-base",
            "relay",
            "relay-epoll",
        ):
            out = Path(args.out) / f"pyspy-{name}-{streams}.txt"
            extra = ["--profile-out", str(out), "--py-spy", args.py_spy]
            args.profiles.append(out)
        argv = [
            *stream_opts,
            *extra,
            "--mode",
            "load",
            "--streams",
            str(streams),
            *window_opts(args),
            "--probe-interval",
            str(args.probe_interval),
        ]
        return CLIENT, argv, args.warmup + args.duration + 150

    session.rounds(args.streams, "streams", lambda streams: f"{streams} streams", client)


def trace_table(paths: list[Path]) -> str:
    """The summaries of ``token_trace.py``: where a read's time inside muxproxy went (ms)."""
    rows = [
        "",
        "Where a backend read's time inside muxproxy went (ms, token_trace.py; means):",
        "",
        "| variant | reads | p50 / p99 / p99.9 | mean: wait for the round, before its read, own "
        "| worst 1 %: the same | full collections (count, longest) "
        "| reads per round (mean, p90) | reads per client send |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        t = json.loads(path.read_text())
        q, mean, worst = t["total_ms"], t["mean_ms"], t["worst_1pct_mean_ms"]
        parts = ("wait for the round", "before its read", "own")
        full = t["gc"].get("gen2", {"count": 0, "max_ms": 0.0})
        per_round = t.get("reads_per_round", {})
        rows.append(
            f"| {path.stem} | {t['reads']:,} | {q['p50']:.2f} / {q['p99']:.2f} / {q['p99.9']:.2f} "
            f"| {', '.join(f'{mean.get(p, 0):.2f}' for p in parts)} "
            f"| {', '.join(f'{worst.get(p, 0):.2f}' for p in parts)} "
            f"| {full['count']}, {full['max_ms']:.1f} ms "
            f"| {per_round.get('mean', 0):.2f}, {per_round.get('p90', 0):g} "
            f"| {t.get('reads_per_client_send', 0):.2f} |"
        )
    return "\n".join(rows)


def report_problems(label: str, res: dict[str, object], proxy: Proc | None) -> None:
    if res.get("error"):
        print(f"#   ERROR {label}: {res['error']}", file=sys.stderr)
        if proxy is not None:
            print(proxy.log_tail(), file=sys.stderr)
    elif res.get("errors"):
        print(f"#   errors {label}: {res['errors']}", file=sys.stderr)


def run_text(argv: list[str]) -> str:
    """What a short command prints (stdout, else stderr), run in MUXPROXY_SRC; "" on failure."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False, cwd=MUXPROXY_SRC)
        return (done.stdout or done.stderr).decode(errors="replace").strip()
    except OSError:
        return ""


def router_missing(kind: str) -> str:
    """Why router ``kind`` cannot run from ROUTERS_VENV ("" when it can)."""
    python = router_python()
    if not python.exists():
        return f"no {python}"
    _, module, extension, _ = ROUTERS[kind]
    try:
        done = subprocess.run(
            [str(python), "-c", f"import {extension}, {module}"],
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} did not run: {exc}"
    if done.returncode:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import {module} ({last})"
    return ""


def router_versions(variants: list[str]) -> dict[str, str]:
    """The PyPI versions of the routers the run measures."""
    kinds = sorted({variant(v)[1] for v in variants} & ROUTERS.keys())
    if not kinds:
        return {}
    packages = [ROUTERS[k][0] for k in kinds]
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"
    )
    try:
        return json.loads(run_text([str(router_python()), "-c", code, *packages]))
    except ValueError:
        return {}


def host_meta() -> dict[str, object]:
    """What every results file says about where and on what code it was measured."""
    digest = hashlib.sha256()
    for path in sorted((MUXPROXY_SRC / "muxproxy").rglob("*.py")):
        relative = path.relative_to(MUXPROXY_SRC).as_posix()
        digest.update(relative.encode() + b"\0" + path.read_bytes())
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git_commit": run_text(["git", "rev-parse", "--short", "HEAD"]),
        "muxproxy_sources_sha256": digest.hexdigest()[:16],
        "git_dirty": bool(run_text(["git", "status", "--porcelain", "--untracked-files=no"])),
        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
    }


def meta(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {
        **host_meta(),
        "nginx": run_text([args.nginx, "-v"]),
        "interval_s": args.interval,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "slots": args.slots,
        "h2_per_conn": args.h2_per_conn,
        "idle_streams": args.idle_streams,
        "repeat": args.repeat,
        "proxy_cpus": args.proxy_cpus,
        "mode": args.mode,
    }
    routers = router_versions(args.variants)
    if routers:
        out.update(routers=routers, routers_venv=str(ROUTERS_VENV), router_threads=ROUTER_THREADS)
    if args.mode == "saturation":
        out["burst"] = args.burst
    elif args.mode == "llm":
        out.update(
            requests=args.requests,
            seed=args.seed,
            ttft_ms=args.ttft_ms,
            tokens=args.tokens,
            pool_limit=args.pool_limit,
        )
    return out


# --- the table -----------------------------------------------------------------------------


def fmt(value: object, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


SATURATED_PCT = 85.0
"""A process at this much of a core or more is (nearly) a bottleneck."""


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None and v == v)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def median_rows(
    runs: list[dict[str, Any]], mode: str, key: str, metrics: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per (variant, ``key``) over the runs of ``mode``: for each metric (name: dotted
    path into a run, e.g. ``cpu_pct.proxy``) the median over repeats, runs without it left out.
    ``row["group"]`` holds the runs."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("mode") == mode:
            groups.setdefault((r["variant"], r[key]), []).append(r)
    rows = []
    for (name, value), group in groups.items():
        row = {"variant": name, "label": group[0]["label"], key: value, "repeats": len(group)}
        for metric, path in metrics.items():
            values = []
            for r in group:
                with contextlib.suppress(KeyError, TypeError):
                    value: Any = r
                    for part in path.split("."):
                        value = value[part]
                    values.append(value)
            row[metric] = median(values)
        row["group"] = group
        rows.append(row)
    rows.sort(key=lambda r: (r[key], variant_order(r["variant"])))
    return rows


CPU_METRICS = {
    "proxy_cpu_pct": "cpu_pct.proxy",
    "us_per_event": "proxy_cpu_us_per_event",
    "backend_cpu_pct": "cpu_pct.backend",
    "client_cpu_pct": "client_cpu_pct",
    "others_cpu_pct": "other_processes_cpu_pct",
}


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, streams): the median over repeats of every metric."""
    metrics = {
        "events_per_s": "events_per_s",
        **CPU_METRICS,
        "backend_events_per_s": "backend_events_per_s",
        "ttfb_p50": "ttfb_ms.p50",
    }
    for q in ("min", "p50", "p90", "p99", "p999", "max"):
        metrics[f"lat_{q}"] = f"latency_ms.{q}"
    rows = median_rows(runs, "load", "streams", metrics)
    for row in rows:
        group = row["group"]
        row["expected"] = group[0]["expected_events_per_s"]
        row["min_events_per_s"] = min(r["events_per_s"] for r in group)
        row["behind"] = [
            r
            for r in group
            if r["events_per_s"] < 0.97 * r["expected_events_per_s"]
            or r.get("streams_without_events")
        ]
        row["errors"] = [r["errors"] for r in group if r.get("errors")]
    return rows


def markdown_header(cols: list[str]) -> list[str]:
    """The header row and the separator row of a markdown table."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def table(result: dict[str, object]) -> str:
    runs = result["runs"]
    assert isinstance(runs, list)
    rows = aggregate(runs)
    idle = {r["variant"]: r for r in runs if r.get("mode") == "idle"}
    direct = {r["streams"]: r for r in rows if r["variant"] == "direct"}
    cols = [
        "variant",
        "streams",
        "events/s (expected)",
        "proxy CPU %",
        "proxy CPU µs/event",
        "latency p50 / p99 (ms)",
        "added p50 / p99 vs direct (ms)",
        "TTFB median (ms)",
        "TTFB overhead vs direct (ms)",
        "proxy RSS per idle stream (KiB)",
        "backend CPU %",
        "client CPU %",
        "other procs CPU %",
    ]
    lines = markdown_header(cols)
    notes = []
    for r in rows:
        base = direct.get(r["streams"])
        flag = " ⚠" if r["behind"] else ""
        for b in r["behind"]:
            notes.append(
                f"⚠ {r['label']}, {r['streams']} streams: {b['events_per_s']:,.0f} events/s of "
                f"{b['expected_events_per_s']:,.0f} expected (backend wrote "
                f"{b['backend_events_per_s']:,.0f}/s, proxy CPU "
                f"{fmt(b['cpu_pct'].get('proxy'), '.0f')} %, backend CPU "
                f"{b['cpu_pct']['backend']:.0f} %, client CPU {b['client_cpu_pct']:.0f} %, "
                f"other processes {b['other_processes_cpu_pct']:.0f} %; slowest stream got "
                f"{b['per_stream_events_min']} events in the window, "
                f"{b['streams_without_events']} streams none; "
                f"{b.get('streams_not_started', 0)} streams without a first event after the "
                f"ramp ({b['ramp_s']:.1f} s); TTFB probes: {b['ttfb_ms'].get('count', 0)} ok, "
                f"{b['probe_failures']} timed out)"
            )
        for errors in r["errors"]:
            notes.append(f"errors in {r['label']}, {r['streams']} streams: {errors}")
        if base is not None and r is not base and r["lat_p50"] is not None:
            added = f"{r['lat_p50'] - base['lat_p50']:+.2f} / {r['lat_p99'] - base['lat_p99']:+.2f}"
            ttfb_over = (
                f"{r['ttfb_p50'] - base['ttfb_p50']:+.2f}"
                if r["ttfb_p50"] is not None and base["ttfb_p50"] is not None
                else "-"
            )
        else:
            added = ttfb_over = "-"
        rss = idle.get(r["variant"], {}).get("rss_per_stream_kib")
        cells = [
            r["label"],
            str(r["streams"]),
            f"{r['events_per_s']:,.0f} ({r['expected']:,.0f}){flag}",
            fmt(r["proxy_cpu_pct"], ".0f"),
            fmt(r["us_per_event"], ".0f"),
            f"{fmt(r['lat_p50'], '.2f')} / {fmt(r['lat_p99'], '.2f')}",
            added,
            fmt(r["ttfb_p50"], ".2f"),
            ttfb_over,
            fmt(rss),
            fmt(r["backend_cpu_pct"], ".0f"),
            fmt(r["client_cpu_pct"], ".0f"),
            fmt(r["others_cpu_pct"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    repeats = max((r["repeats"] for r in rows), default=1)
    lines.insert(0, f"Medians over {repeats} repeat(s) per row.\n")
    lines += [
        "",
        "Latency distribution (ms, arrival - backend send time; medians over repeats):",
        "",
        "| variant | streams | min | p50 | p90 | p99 | p99.9 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [r["label"], str(r["streams"])]
                + [fmt(r[f"lat_{q}"], ".2f") for q in ("min", "p50", "p90", "p99", "p999", "max")]
            )
            + " |"
        )
    for r in runs:
        if r.get("error"):
            notes.append(f"ERROR {r.get('label')} {r.get('mode', '')}: {r['error']}")
        elif r.get("mode") == "idle" and r.get("errors"):
            notes.append(f"errors in {r['label']} idle test: {r['errors']}")
    return "\n".join([*lines, "", *notes])


def saturation_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = median_rows(
        runs,
        "saturation",
        "streams",
        {
            "events_per_s": "events_per_s",
            "per_core": "events_per_s_per_proxy_core",
            "backend_events_per_s": "backend_events_per_s",
            **CPU_METRICS,
        },
    )
    cols = [
        "variant",
        "streams",
        "events/s",
        "proxy CPU %",
        "events/s per proxy core",
        "proxy CPU µs/event",
        "backend CPU %",
        "client CPU %",
        "other procs CPU %",
    ]
    lines = markdown_header(cols)
    notes = []
    for r in rows:
        where = f"{r['label']}, {r['streams']} streams"
        limits = [
            f"the {who} used {r[f'{who}_cpu_pct']:.0f} % of a core"
            for who in ("backend", "client")
            if (r[f"{who}_cpu_pct"] or 0) >= SATURATED_PCT
        ]
        if limits:
            notes.append(
                f"⚠ {where}: {' and '.join(limits)}: it, not the "
                + ("path" if r["variant"] == "direct" else "proxy")
                + " may be the limit; the events/s is a lower bound"
            )
        _, kind, _, workers = variant(r["variant"])
        cores = max(1, workers)
        if kind in ROUTERS:
            threads = result["meta"].get("router_threads")
            cores = threads or len(PROXY_CPUS or os.sched_getaffinity(0))
        others = f"other processes: {fmt(r['others_cpu_pct'], '.0f')} %"
        if limits:
            pass
        elif kind is None:
            notes.append(
                f"⚠ {where}: neither the backend nor the client used a whole core ({others}): "
                "the machine set the pace"
            )
        elif (r["proxy_cpu_pct"] or 0) < SATURATED_PCT * cores:
            notes.append(
                f"⚠ {where}: the proxy used {fmt(r['proxy_cpu_pct'], '.0f')} % CPU of the "
                f"{100 * cores} % it could use ({others}): the machine held it back; events/s "
                "per proxy core is still comparable"
            )
        for run in r["group"]:
            if run.get("errors") or run.get("streams_without_events"):
                notes.append(
                    f"errors in {where}: {run.get('errors')}, "
                    f"{run.get('streams_without_events')} streams got no event"
                )
        flag = " ⚠" if any(n.startswith(f"⚠ {where}:") for n in notes) else ""
        cells = [
            r["label"],
            str(r["streams"]),
            f"{fmt(r['events_per_s'], ',.0f')}{flag}",
            fmt(r["proxy_cpu_pct"], ".0f"),
            fmt(r["per_core"], ",.0f"),
            fmt(r["us_per_event"], ".1f"),
            fmt(r["backend_cpu_pct"], ".0f"),
            fmt(r["client_cpu_pct"], ".0f"),
            fmt(r["others_cpu_pct"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    repeats = max((r["repeats"] for r in rows), default=1)
    burst = result["meta"].get("burst")
    lines.insert(
        0,
        f"Saturation: back-to-back events, {burst} per backend write. "
        f"Medians over {repeats} repeat(s) per row.\n",
    )
    return "\n".join([*lines, "", *notes, *error_notes(runs)])


def llm_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    metrics = {
        "completed_per_s": "request_throughput",
        "failed": "failed",
        "tokens_per_s": "output_token_throughput",
        "e2e_p50": "e2e_ms.p50",
        **CPU_METRICS,
    }
    for what in ("ttft", "itl", "token_latency"):
        for q in ("p50", "p99"):
            metrics[f"{what}_{q}"] = f"{what}_ms.{q}"
    rows = median_rows(runs, "llm", "rate", metrics)
    direct = {r["rate"]: r for r in rows if r["variant"] == "direct"}
    cols = [
        "variant",
        "offered req/s",
        "completed req/s",
        "failed",
        "tokens/s",
        "TTFT p50 / p99 (ms)",
        "added TTFT p50 / p99 vs direct",
        "ITL p50 / p99 (ms)",
        "added ITL p50 / p99 vs direct",
        "E2E p50 (ms)",
        "token latency p50 / p99 (ms)",
        "proxy CPU %",
        "proxy CPU µs/event",
        "backend CPU %",
        "client CPU %",
        "other procs CPU %",
    ]
    lines = markdown_header(cols)
    notes = []

    def pair(r: dict[str, Any], what: str) -> str:
        return f"{fmt(r[f'{what}_p50'], '.2f')} / {fmt(r[f'{what}_p99'], '.2f')}"

    def added(r: dict[str, Any], what: str) -> str:
        base = direct.get(r["rate"])
        if base is None or base is r or r[f"{what}_p50"] is None or base[f"{what}_p50"] is None:
            return "-"
        p50 = r[f"{what}_p50"] - base[f"{what}_p50"]
        return f"{p50:+.2f} / {r[f'{what}_p99'] - base[f'{what}_p99']:+.2f}"

    for r in rows:
        where = f"{r['label']}, {r['rate']:g} req/s"
        for run in r["group"]:
            if run.get("failures"):
                notes.append(f"⚠ {where}: failed requests {run['failures']}")
            if run.get("pool_waits"):
                notes.append(
                    f"{where}: {run['pool_waits']} requests waited for one of the "
                    f"{run['connections']} pooled connections (their TTFT includes the wait)"
                )
            if run.get("dispatch_lag_max_ms", 0) > 50:
                notes.append(
                    f"⚠ {where}: the client sent a request up to "
                    f"{run['dispatch_lag_max_ms']:.0f} ms after its time (client CPU "
                    f"{run['client_cpu_pct']:.0f} %, other processes "
                    f"{run['other_processes_cpu_pct']:.0f} %): not quite open loop"
                )
            for who, pct in (
                ("backend", run["cpu_pct"]["backend"]),
                ("client", run["client_cpu_pct"]),
            ):
                if pct >= SATURATED_PCT:
                    notes.append(f"⚠ {where}: the {who} used {pct:.0f} % of a core")
        cells = [
            r["label"],
            f"{r['rate']:g}",
            fmt(r["completed_per_s"], ".2f"),
            fmt(r["failed"], ".0f"),
            fmt(r["tokens_per_s"], ",.0f"),
            pair(r, "ttft"),
            added(r, "ttft"),
            pair(r, "itl"),
            added(r, "itl"),
            fmt(r["e2e_p50"], ",.0f"),
            pair(r, "token_latency"),
            fmt(r["proxy_cpu_pct"], ".0f"),
            fmt(r["us_per_event"], ".0f"),
            fmt(r["backend_cpu_pct"], ".0f"),
            fmt(r["client_cpu_pct"], ".0f"),
            fmt(r["others_cpu_pct"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    meta = result["meta"]
    repeats = max((r["repeats"] for r in rows), default=1)
    lines.insert(
        0,
        f"LLM load: {meta.get('requests')} requests per row, Poisson arrivals, seed "
        f"{meta.get('seed')}, TTFT {meta.get('ttft_ms')} ms, {meta.get('tokens')} tokens, one "
        f"token per {meta['interval_s'] * 1000:g} ms. Medians over {repeats} repeat(s) per row.\n",
    )
    return "\n".join([*lines, "", *notes, *error_notes(runs)])


def error_notes(runs: list[dict[str, Any]]) -> list[str]:
    return [f"ERROR {r.get('label')}: {r['error']}" for r in runs if r.get("error")]


def main() -> None:
    global MUXPROXY_SRC, BASELINE_SRC, TRACE_DIR, PROXY_CPUS, ROUTERS_VENV, ROUTER_THREADS
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mode",
        choices=("stream", "saturation", "llm"),
        default="stream",
        help="stream: paced streams (the default); saturation: back-to-back events; "
        "llm: open-loop chat completions",
    )
    parser.add_argument(
        "--streams",
        help="comma-separated stream counts (stream: 100,1000; saturation: 16)",
    )
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between events")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=10.0, help="measurement window (s)")
    parser.add_argument("--idle-streams", type=int, default=1000, help="0: skip the RSS test")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every (variant, streams) this many times, round robin; the table shows medians",
    )
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--h2-per-conn", type=int, default=100)
    parser.add_argument(
        "--slots",
        type=int,
        default=10,
        help="backend phase slots per interval (1: all streams in one burst)",
    )
    parser.add_argument(
        "--ramp-limit",
        type=float,
        default=20.0,
        help="seconds to wait for the streams' first events while opening them",
    )
    parser.add_argument("--probe-interval", type=float, default=0.1, help="TTFB probe period")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument(
        "--muxproxy-src",
        type=Path,
        default=ROOT,
        help="run the muxproxy package of this checkout (e.g. a git worktree of an older commit)",
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="the checkout of the base-h1 / base-h2 variants (default: --muxproxy-src)",
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the muxproxy and trio-relay variants during each window (no RSS test)",
    )
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the logs and nginx conf")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="run muxproxy (one process) under token_trace.py; use one --streams value",
    )
    parser.add_argument(
        "--proxy-cpus",
        help="comma-separated CPU numbers: run every proxy on these and the backend, the "
        "clients and this script on the others (a proxy core of its own)",
    )
    parser.add_argument(
        "--routers-venv",
        type=Path,
        default=ROUTERS_VENV,
        help="the venv with sglang-router and vllm-router, for the *-router variants "
        f"(default: $MUXBENCH_ROUTERS_VENV or {ROUTERS_VENV}; "
        + ROUTERS_INSTALL.format(venv="DIR")
        + ")",
    )
    parser.add_argument(
        "--router-threads",
        type=int,
        default=1,
        help="tokio worker threads of the routers (TOKIO_WORKER_THREADS; default 1, like "
        "nginx's one worker and HAProxy's one thread; 0: one per CPU they may use)",
    )
    sat = parser.add_argument_group("--mode saturation")
    sat.add_argument("--burst", type=int, default=16, help="events per backend write")
    llm = parser.add_argument_group("--mode llm (see bench/llm_load.py)")
    llm.add_argument("--rate", default="20", help="comma-separated request rates (req/s)")
    llm.add_argument("--requests", type=int, default=800, help="requests per run")
    llm.add_argument("--seed", type=int, default=0)
    llm.add_argument("--ttft-ms", default="50,200", help="time to first token, MIN,MAX")
    llm.add_argument("--tokens", default="20,400", help="tokens per response, MIN,MAX")
    llm.add_argument("--pool-limit", type=int, default=100, help="HTTP/1.1 connections")
    args = parser.parse_args()
    MUXPROXY_SRC = args.muxproxy_src.resolve()
    BASELINE_SRC = args.baseline_src.resolve() if args.baseline_src else MUXPROXY_SRC
    PROXY_CPUS = split_cpus(parser, args.proxy_cpus)
    if args.trace:
        TRACE_DIR = Path(args.out) / dt.datetime.now().strftime("trace-%Y%m%d-%H%M%S")
        TRACE_DIR.mkdir(parents=True)
    default_streams = {"stream": "100,1000", "saturation": "16", "llm": ""}[args.mode]
    args.streams = [int(s) for s in (args.streams or default_streams).split(",") if s]
    args.rate = [float(r) for r in args.rate.split(",") if r]
    args.profiles = []
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [
        v
        for v in args.variants
        if v not in VARIANTS and not WORKERS_VARIANT.fullmatch(v) and not WORK_VARIANT.fullmatch(v)
    ]
    if unknown:
        parser.error(
            f"unknown variants {unknown}; choose from {list(VARIANTS)}, muxproxy-h1-wN, "
            "muxproxy-h2-wN (N worker processes) or epoll-relay-Nus (N µs of work per read)"
        )
    if (
        any(variant(v)[1] in ("nginx", "nginx-h2") for v in args.variants)
        and not Path(args.nginx).exists()
    ):
        parser.error("nginx not found (apt-get install nginx-light), or leave out --variants nginx")
    ROUTERS_VENV = args.routers_venv.absolute()
    ROUTER_THREADS = max(0, args.router_threads)
    for kind in sorted({variant(v)[1] for v in args.variants} & ROUTERS.keys()):
        problem = router_missing(kind)
        if problem:
            parser.error(
                f"{kind}: {problem}. Install the routers into their own venv: "
                f"{ROUTERS_INSTALL.format(venv=ROUTERS_VENV)} (or pass --routers-venv DIR, "
                f"or leave out the {kind} variants)"
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)

    result = bench(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = "sse-bench" if args.mode == "stream" else args.mode
    path = Path(args.out) / f"{name}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print({"stream": table, "saturation": saturation_table, "llm": llm_table}[args.mode](result))
    print(f"\nresults: {path}")
    if TRACE_DIR is not None:
        print(trace_table(sorted(TRACE_DIR.glob("*.json"))))
    if args.profile:
        for prof in args.profiles:
            print(f"\n# {prof.name}")
            subprocess.run([sys.executable, str(PYSPY_TOP), str(prof)], check=False)


if __name__ == "__main__":
    main()
