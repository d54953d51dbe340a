"""Short-request benchmark: requests/s and proxy CPU per request, muxproxy beside nginx and HAProxy.

One command measures what a short request costs each proxy, with the same C backend and the
same C client for all, and the floors in the same run::

    python bench/short_requests.py --repeat 2 --warmup 2 --duration 6

* The backend: nginx (one worker by default, ``--backend-workers``) answering ``POST
  /v1/chat/completions`` and ``GET /`` with one SSE event and ``data: [DONE]`` (61 bytes,
  ``content-type: text/event-stream``, with a Content-Length), the same for every variant.
* The client: h2load (nghttp2), back to back, over HTTP/1.1 (``--h1-clients`` connections,
  ``--h1-streams`` requests in flight on each: 16 x 1) and over h2c with prior knowledge
  (``--h2-clients`` x ``--h2-streams``: 4 x 16); each request a ``POST`` of a 72-byte chat
  body (``--method GET``: ``GET /``).
* Every proxy runs on ``--proxy-cpus`` (default CPU 0); the backend, h2load and this script on
  the others. A load run warms up for ``--warmup`` s, then h2load measures ``--duration`` s
  while this script reads the CPU time of the proxy (all its processes), of the backend and of
  h2load from /proc. CPU µs per request = proxy CPU s / requests; requests/s per core = its
  inverse; ⚠ where the proxy used under 90 % of its cores (then the client or the backend
  was the limit). See ``short_stats.py`` for the arithmetic.
* Latency: a second run per variant with no other load: one connection, one request at a
  time (``--latency-requests``, after 200 not counted), the median and p99 of h2load's
  per-request time; the table shows each proxy's added median over ``direct`` (its time to
  first byte overhead: the answer is one read) and that over nginx's on the same protocol.
* ``--repeat N``: every variant N times, round robin (the order rotated each repeat); the
  table shows medians. The raw figures go to ``bench/results/short-requests-*.json``.

Variants (``--variants``, comma-separated; default all but the worker variants, the compiled
ones only with ``--compiled-src``):

* ``direct``: h2load -> backend (HTTP/1.1; the backend speaks no h2c).
* ``muxproxy-h1``, ``muxproxy-h2``: ``muxproxy serve --listen ... --upstream BACKEND`` from
  ``--muxproxy-src`` (default: this checkout), HTTP/1.1 / h2c client, HTTP/1.1 pooled to the
  backend, the access log on (to stderr, into a file: the shipped default).
* ``compiled-h1``, ``compiled-h2``: the same from ``--compiled-src DIR``, a copy of the tree
  with the compiled build (the run checks that its modules import compiled)::

      git archive HEAD | tar -x -C /tmp/mux-compiled   # after mkdir /tmp/mux-compiled
      ln -s "$PWD/.venv" /tmp/mux-compiled/.venv && (cd /tmp/mux-compiled && scripts/compile)

* ``nginx``, ``nginx-h2``, ``haproxy``, ``haproxy-h2``: configured as ``sse_bench.py`` does
  (one worker / one thread, keep-alive to the backend; nginx with its access log on, HAProxy
  with none), nginx also with ``keepalive_requests`` raised (below).
* ``h11-relay``, ``h2-relay``: the floors (``h11_relay.py``): Trio + h11 (+ h2 to the
  client) relaying each request and its answer with no proxy logic.
* ``muxproxy-h1-wN``, ``muxproxy-h2-wN``: ``muxproxy serve --workers N`` (N >= 2; one worker is
  the one process of ``muxproxy-h1``) on N CPUs (the
  ``--proxy-cpus`` first, then the others: with N above the proxy CPUs, the workers share
  CPUs with the backend and h2load, and the table says so).

Every process this script starts is stopped at the end by its PID, also on errors, Ctrl-C and
SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sse_bench  # beside this script: the process handling and the proxy configurations
from short_stats import (
    H2loadOutputError,
    cpu_busy_pct,
    latency_figures,
    load_figures,
    parse_h2load,
    parse_request_log,
    rows,
    table,
)
from sse_bench import Proc, StartError, cpu_seconds, descendants, free_port, wait_listening

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RELAY = HERE / "h11_relay.py"

VARIANTS = {
    # name: (proxy kind for sse_bench.start_proxy or a relay, client protocol)
    "direct": (None, "h1"),
    "muxproxy-h1": ("muxproxy", "h1"),
    "muxproxy-h2": ("muxproxy", "h2"),
    "compiled-h1": ("muxproxy-base", "h1"),
    "compiled-h2": ("muxproxy-base", "h2"),
    "nginx": ("nginx", "h1"),
    "nginx-h2": ("nginx-h2", "h2"),
    "haproxy": ("haproxy", "h1"),
    "haproxy-h2": ("haproxy-h2", "h2"),
    "h11-relay": ("relay-h1", "h1"),
    "h2-relay": ("relay-h2", "h2"),
}
WORKERS_VARIANT = re.compile(r"muxproxy-(h1|h2)-w([2-9]|[1-9][0-9]+)")
"""``muxproxy serve --workers N``, N from 2: with one worker muxproxy runs as one process (the
``muxproxy-h1`` / ``muxproxy-h2`` rows)."""

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}\n'
"""The request body of ``--method POST``: a short streamed chat completion (72 bytes)."""
ANSWER = 'data: {"choices":[{"delta":{"content":"x"}}]}\\n\\ndata: [DONE]\\n\\n'
"""The backend's answer as an nginx string (``\\n`` is nginx's escape): 61 bytes."""
LATENCY_WARMUP = 200
"""Requests of a latency run not counted: the connection's and the proxy's first requests."""
SAMPLE_MARGIN = 0.25
"""Seconds inside each end of h2load's window where the CPU samples are taken, so that they
fall inside it (h2load's own CPU is read before it exits)."""

BACKEND_CONF = """\
worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{
    worker_connections 16384;
}}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    tcp_nodelay on;
    keepalive_timeout 300s;
    keepalive_requests 100000000;
    server {{
        listen {listen} backlog=4096;
        location / {{
            default_type text/event-stream;
            return 200 '{answer}';
        }}
    }}
}}
"""

KEEPALIVE_REQUESTS = "keepalive_requests 100000000;"
"""nginx closes a keep-alive connection after 1,000 requests (``keepalive_requests``, client and
upstream side alike); muxproxy and HAProxy do not, and h2load would spend the run reconnecting
to nginx alone. sse_bench.py's configuration gets it on both sides for this benchmark."""


def nginx_proxy_conf() -> str:
    conf = sse_bench.NGINX_CONF.replace(
        "    tcp_nodelay on;\n", f"    tcp_nodelay on;\n    {KEEPALIVE_REQUESTS}\n", 1
    )
    conf = conf.replace(
        "        keepalive 64;\n", f"        keepalive 64;\n        {KEEPALIVE_REQUESTS}\n", 1
    )
    if conf.count(KEEPALIVE_REQUESTS) != 2:
        raise RuntimeError("sse_bench.NGINX_CONF changed shape: update nginx_proxy_conf()")
    return conf


def variant(name: str) -> tuple[str | None, str, int]:
    """(proxy kind, client protocol, muxproxy worker processes) of a variant."""
    m = WORKERS_VARIANT.fullmatch(name)
    if m:
        return "muxproxy", m.group(1), int(m.group(2))
    kind, proto = VARIANTS[name]
    return kind, proto, 0


# --- processes ------------------------------------------------------------------------------


def family(proc: Proc) -> list[int]:
    """The process and everything below it now (nginx's workers, muxproxy's workers)."""
    return [proc.pid, *descendants(proc.pid)]


def start_backend(tmp: Path, nginx: str, workers: int) -> Proc:
    ntmp = tmp / "backend"
    ntmp.mkdir(parents=True)
    for parent in (tmp, ntmp):
        parent.chmod(0o755)
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (ntmp / sub).mkdir()
        # Workers run as nobody when started by root: let them use the temp paths.
        (ntmp / sub).chmod(0o777)
    port = free_port()
    conf = ntmp / "nginx.conf"
    conf.write_text(
        BACKEND_CONF.format(workers=workers, tmp=ntmp, listen=f"127.0.0.1:{port}", answer=ANSWER)
    )
    argv = [nginx, "-p", str(ntmp), "-c", str(conf), "-e", str(ntmp / "error.log")]
    proc = Proc("backend", [*argv, "-g", "daemon off;"], tmp / "backend.log", port)
    try:
        wait_listening(port, proc.proc)
    except RuntimeError as exc:
        proc.stop()
        raise StartError(f"the nginx backend did not start: {exc}", proc.log_tail()) from exc
    return proc


def start_relay(kind: str, tmp: Path, backend: str, cpus: set[int] | None) -> Proc:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proto = kind.removeprefix("relay-")
    argv = [sys.executable, str(RELAY), "--proto", proto, "--listen", f"127.0.0.1:{port}"]
    proc = Proc(kind, [*argv, "--upstream", backend], tmp / f"{kind}.log", port, cpus=cpus)
    try:
        wait_listening(port, proc.proc)
    except RuntimeError as exc:
        proc.stop()
        raise StartError(str(exc), proc.log_tail()) from exc
    return proc


def start_variant(name: str, tmp: Path, backend: str, args: argparse.Namespace) -> Proc | None:
    """The proxy of variant ``name`` on its CPUs, listening; None for ``direct``."""
    kind, _, workers = variant(name)
    cpus = variant_cpus(name, args)
    if kind is None:
        return None
    if kind.startswith("relay-"):
        return start_relay(kind, tmp / name, backend, cpus)
    # sse_bench.start_proxy reads its module's settings when called: the CPUs of this
    # variant, and which checkout each muxproxy kind runs.
    sse_bench.PROXY_CPUS = cpus
    sse_bench.NGINX_CONF = args.nginx_conf
    return sse_bench.start_proxy(kind, tmp / name, backend, args.nginx, workers)


def variant_cpus(name: str, args: argparse.Namespace) -> set[int]:
    """The proxy CPUs; for ``--workers N``, N CPUs: the proxy CPUs first, then the others."""
    workers = variant(name)[2]
    if workers <= len(args.proxy_cpu_set):
        return set(sorted(args.proxy_cpu_set)[:workers]) if workers else args.proxy_cpu_set
    order = sorted(args.proxy_cpu_set) + sorted(args.load_cpu_set)
    return set(order[:workers])


def build_of(src: Path) -> str:
    """``compiled``, ``partly compiled`` or ``pure Python``: how ``python -m muxproxy`` run in
    ``src`` imports the modules of ``muxproxy/compiled.py`` (the same ``sys.path``: ``src``
    first)."""
    code = "from muxproxy.compiled import build; print(build())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, timeout=60, check=False
    )
    if done.returncode:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        return f"does not import ({last})"
    return done.stdout.decode().strip()


def compiled_loaded(proxy: Proc, src: Path) -> tuple[int, int]:
    """(compiled modules the proxy's processes have mapped, compiled modules ``src`` has):
    what the running proxy imported, read from /proc/PID/maps, not what a fresh import
    would."""
    package = src / "muxproxy"
    built = {p for p in package.rglob("*.so") if "__mypyc" not in p.name}
    mapped: set[Path] = set()
    for pid in family(proxy):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = Path(line.rstrip("\n").split(maxsplit=5)[-1])
                if path in built:
                    mapped.add(path)
    return len(mapped), len(built)


# --- the runs -------------------------------------------------------------------------------


def target(args: argparse.Namespace, port: int) -> tuple[list[str], str]:
    """h2load's request options and URL."""
    if args.method == "GET":
        return [], f"http://127.0.0.1:{port}/"
    opts = ["-d", str(args.body_file), "-H", "content-type: application/json"]
    return opts, f"http://127.0.0.1:{port}/v1/chat/completions"


def milliseconds(seconds: float) -> str:
    """A duration as h2load takes it (no fractions: ``1500ms``)."""
    return f"{round(seconds * 1000)}ms"


def proto_opts(proto: str) -> list[str]:
    # Without --h1, h2load speaks h2c with prior knowledge to an http:// URL.
    return ["--h1"] if proto == "h1" else []


def load_run(
    args: argparse.Namespace, name: str, port: int, proxy: Proc | None, backend: Proc, log: Path
) -> dict[str, Any]:
    """h2load back to back for ``--warmup`` + ``--duration`` s; CPU sampled inside its window."""
    _, proto, workers = variant(name)
    clients, streams = (
        (args.h1_clients, args.h1_streams) if proto == "h1" else (args.h2_clients, args.h2_streams)
    )
    request, url = target(args, port)
    argv = [args.h2load, *proto_opts(proto), "-c", str(clients), "-m", str(streams)]
    argv += ["-D", milliseconds(args.duration), "--warm-up-time", milliseconds(args.warmup)]
    argv += [*request, url]
    with open(log, "wb") as out:
        client = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        time.sleep(args.warmup + SAMPLE_MARGIN)
        pids = {"backend": family(backend), "client": [client.pid]}
        if proxy is not None:
            pids["proxy"] = family(proxy)
        stat0 = Path("/proc/stat").read_text()
        t0, before = time.monotonic(), {who: cpu_seconds(p) for who, p in pids.items()}
        time.sleep(args.duration - 2 * SAMPLE_MARGIN)
        t1, after = time.monotonic(), {who: cpu_seconds(p) for who, p in pids.items()}
        stat1 = Path("/proc/stat").read_text()
        client.wait(timeout=args.duration + 30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    text = log.read_text(errors="replace")
    try:
        summary = parse_h2load(text)
    except H2loadOutputError as exc:
        return {"error": f"h2load exit {client.returncode}: {exc}"}
    cpu = {who: after[who] - before[who] for who in pids}
    busy = cpu_busy_pct(stat0, stat1, variant_cpus(name, args))
    run = load_figures(summary, t1 - t0, cpu, max(1, workers), proxy_cpus_busy_pct=busy)
    run.update(clients=clients, streams=streams, h2load=argv)
    return run


def latency_run(args: argparse.Namespace, name: str, port: int, log: Path) -> dict[str, Any]:
    """One connection, one request at a time: the per-request times h2load logs."""
    proto = variant(name)[1]
    request, url = target(args, port)
    log.unlink(missing_ok=True)  # h2load appends to a log file that is there
    count = LATENCY_WARMUP + args.latency_requests
    argv = [args.h2load, *proto_opts(proto), "-c", "1", "-m", "1", "-n", str(count)]
    argv += ["--log-file", str(log), *request, url]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "h2load (latency) timed out after 120 s"}
    try:
        summary = parse_h2load(done.stdout.decode(errors="replace"))
        times, bad = parse_request_log(log.read_text(), skip=LATENCY_WARMUP)
    except (H2loadOutputError, OSError, ValueError) as exc:
        return {"error": f"h2load (latency) exit {done.returncode}: {exc}"}
    out = latency_figures(times, bad)
    out["failed"] = summary["failed"] + summary["errored"] + summary["timeout"]
    return out


def smoke(args: argparse.Namespace, name: str, port: int) -> str:
    """ "" when the variant answers 20 requests with 2xx, else what went wrong."""
    request, url = target(args, port)
    argv = [args.h2load, *proto_opts(variant(name)[1]), "-c", "1", "-n", "20", *request, url]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        summary = parse_h2load(done.stdout.decode(errors="replace"))
    except (subprocess.TimeoutExpired, H2loadOutputError) as exc:
        return str(exc)
    if summary["2xx"] != 20:
        return f"{summary['2xx']:.0f} of 20 requests answered 2xx"
    return ""


def bench(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    started: list[Proc] = []
    try:
        backend = start_backend(tmp, args.nginx, args.backend_workers)
        started.append(backend)
        baddr = f"127.0.0.1:{backend.port}"
        ports: dict[str, int] = {}
        proxies: dict[str, Proc | None] = {}
        for name in args.variants:
            _, proto, _ = variant(name)
            base = {"variant": name, "label": name, "proto": proto}
            try:
                proxy = start_variant(name, tmp, baddr, args)
            except StartError as exc:
                print(f"# ERROR {name} did not start: {exc}\n{exc.log}", file=sys.stderr)
                runs.append({**base, "kind": "load", "error": f"did not start: {exc}"})
                continue
            if proxy is not None:
                started.append(proxy)
            port = proxy.port if proxy is not None else backend.port
            problem = smoke(args, name, port)
            if problem:
                print(f"# ERROR {name}: {problem}", file=sys.stderr)
                runs.append({**base, "kind": "load", "error": problem})
                continue
            if proxy is not None and proxy.name == "muxproxy":
                src = args.compiled_src if name.startswith("compiled-") else args.muxproxy_src
                loaded, built = compiled_loaded(proxy, src)
                if built:
                    args.compiled_loaded[name] = f"{loaded} of {built}"
                if name.startswith("compiled-") and (not built or loaded < built):
                    problem = f"runs {loaded} of the {built} compiled modules of {src}"
                    print(f"# ERROR {name}: {problem}", file=sys.stderr)
                    runs.append({**base, "kind": "load", "error": problem})
                    continue
            ports[name], proxies[name] = port, proxy
        names = list(ports)
        for rep in range(args.repeat):
            k = rep % max(1, len(names))
            for name in names[k:] + names[:k]:
                proxy = proxies[name]
                base = {"variant": name, "label": name, "proto": variant(name)[1], "repeat": rep}
                if proxy is not None and not proxy.alive():
                    error = f"proxy exited ({proxy.proc.returncode})"
                    runs.append({**base, "kind": "load", "error": error, "log": proxy.log_tail()})
                    continue
                print(f"# [{rep + 1}/{args.repeat}] {name}: load", file=sys.stderr)
                log = tmp / f"h2load-{name}-{rep}.txt"
                run = load_run(args, name, ports[name], proxy, backend, log)
                runs.append({**base, "kind": "load", **run})
                report(name, run)
                sse_bench.quiesce(started)
                print(f"# [{rep + 1}/{args.repeat}] {name}: latency", file=sys.stderr)
                run = latency_run(args, name, ports[name], tmp / f"latency-{name}-{rep}.tsv")
                runs.append({**base, "kind": "latency", **run})
                report(name, run)
    finally:
        for proc in reversed(started):
            proc.stop()
    return runs


def report(name: str, run: dict[str, Any]) -> None:
    if "error" in run:
        print(f"#   ERROR {name}: {run['error']}", file=sys.stderr)
    elif "rps" in run:
        us = run.get("us_per_request")
        cpu = f", {us:.1f} µs CPU/request" if us is not None else ""
        print(f"#   {run['rps']:,.0f} req/s{cpu}", file=sys.stderr)
    else:
        print(f"#   p50 {run['p50_us']} µs, p99 {run['p99_us']} µs", file=sys.stderr)


def version(argv: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False)
        return (done.stdout or done.stderr).decode(errors="replace").strip().splitlines()[0]
    return ""


def meta(args: argparse.Namespace, builds: dict[str, str]) -> dict[str, Any]:
    return {
        **sse_bench.host_meta(),
        "muxproxy_src": str(args.muxproxy_src),
        "compiled_src": str(args.compiled_src) if args.compiled_src else None,
        "builds": builds,
        "compiled_modules_mapped": args.compiled_loaded,
        "h2load": version([args.h2load, "--version"]),
        "nginx": version([args.nginx, "-v"]),
        "haproxy": version([shutil.which("haproxy") or "/usr/sbin/haproxy", "-v"]),
        "proxy_cpus": sorted(args.proxy_cpu_set),
        "load_cpus": sorted(args.load_cpu_set),
        "backend_workers": args.backend_workers,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "repeat": args.repeat,
        "h1": {"clients": args.h1_clients, "streams": args.h1_streams},
        "h2": {"clients": args.h2_clients, "streams": args.h2_streams},
        "method": args.method,
        "latency_requests": args.latency_requests,
        "variants": args.variants,
    }


def header(args: argparse.Namespace, builds: dict[str, str]) -> str:
    lines = [
        f"Short requests: {args.method} with a one-event SSE answer (61 bytes), nginx backend; "
        f"HTTP/1.1 {args.h1_clients} x {args.h1_streams}, h2c {args.h2_clients} x "
        f"{args.h2_streams} (connections x in flight); proxy on CPU "
        f"{','.join(map(str, sorted(args.proxy_cpu_set)))}, backend and h2load on "
        f"{','.join(map(str, sorted(args.load_cpu_set)))}; {args.warmup:g} s warm-up, "
        f"{args.duration:g} s window; medians of {args.repeat}; latency: "
        f"{args.latency_requests} requests one at a time on one connection.",
    ]
    for src, build in builds.items():
        lines.append(f"muxproxy from {src}: {build}.")
    for name, loaded in args.compiled_loaded.items():
        lines.append(f"{name}: {loaded} compiled modules mapped in its processes.")
    for name in args.variants:
        workers = variant(name)[2]
        if workers > len(args.proxy_cpu_set):
            lines.append(
                f"{name}: {workers} workers on CPUs {sorted(variant_cpus(name, args))}, "
                "shared with the backend and h2load."
            )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--variants", help="comma-separated (default: every variant above)")
    parser.add_argument("--repeat", type=int, default=1, help="round-robin repeats (medians)")
    parser.add_argument("--warmup", type=float, default=2.0, help="s of load before the window")
    parser.add_argument("--duration", type=float, default=6.0, help="s of the measured window")
    parser.add_argument("--h1-clients", type=int, default=16, help="HTTP/1.1 connections")
    parser.add_argument("--h1-streams", type=int, default=1, help="pipelined requests (POST: 1)")
    parser.add_argument("--h2-clients", type=int, default=4, help="h2c connections")
    parser.add_argument("--h2-streams", type=int, default=16, help="streams per h2c connection")
    parser.add_argument("--latency-requests", type=int, default=2000, help="per latency run")
    parser.add_argument("--method", choices=("POST", "GET"), default="POST")
    parser.add_argument("--proxy-cpus", default="0", help="comma-separated CPUs of the proxies")
    parser.add_argument("--backend-workers", type=int, default=1, help="nginx backend workers")
    parser.add_argument("--muxproxy-src", type=Path, default=ROOT, help="checkout to run")
    parser.add_argument(
        "--compiled-src", type=Path, help="a copy of the tree after scripts/compile (above)"
    )
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--h2load", default=shutil.which("h2load") or "/usr/bin/h2load")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep-tmp", action="store_true", help="keep logs and configurations")
    args = parser.parse_args()
    if args.duration <= 2 * SAMPLE_MARGIN + 0.5 or args.warmup < 0 or args.repeat < 1:
        parser.error("--duration must be over 1 s, --warmup at least 0, --repeat at least 1")
    for path, what in ((args.nginx, "nginx-light"), (args.h2load, "nghttp2-client")):
        if not Path(path).exists():
            parser.error(f"{path} not found (apt-get install {what})")
    default = [v for v in VARIANTS if args.compiled_src or not v.startswith("compiled-")]
    args.variants = [v.strip() for v in (args.variants or ",".join(default)).split(",")]
    unknown = [v for v in args.variants if v not in VARIANTS and not WORKERS_VARIANT.fullmatch(v)]
    if unknown:
        parser.error(
            f"unknown variants {unknown}; choose from {list(VARIANTS)} or muxproxy-h1-wN / "
            "muxproxy-h2-wN (N >= 2 worker processes)"
        )
    if any(variant(v)[0] == "muxproxy-base" for v in args.variants) and not args.compiled_src:
        parser.error("the compiled-* variants need --compiled-src DIR (see --help)")
    args.muxproxy_src = args.muxproxy_src.resolve()
    if args.compiled_src:
        args.compiled_src = args.compiled_src.resolve()
    proxy_cpus = sse_bench.split_cpus(parser, args.proxy_cpus)
    assert proxy_cpus is not None
    args.proxy_cpu_set = proxy_cpus
    args.load_cpu_set = os.sched_getaffinity(0)
    args.nginx_conf = nginx_proxy_conf()
    args.compiled_loaded = {}
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM ends the run like Ctrl-C: through the finally that stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sse_bench.MUXPROXY_SRC = args.muxproxy_src
    builds = {str(args.muxproxy_src): build_of(args.muxproxy_src)}
    if args.compiled_src:
        sse_bench.BASELINE_SRC = args.compiled_src
        builds[str(args.compiled_src)] = build_of(args.compiled_src)
        if builds[str(args.compiled_src)] != "compiled":
            sys.exit(
                f"--compiled-src {args.compiled_src}: {builds[str(args.compiled_src)]}, not "
                "compiled; build it with scripts/compile there (see --help)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="muxbench-short-"))
    args.body_file = tmp / "body.json"
    args.body_file.write_bytes(BODY)
    try:
        runs = bench(args, tmp)
    finally:
        if args.keep_tmp:
            print(f"# logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"meta": meta(args, builds), "runs": runs}
    path = args.out / dt.datetime.now().strftime("short-requests-%Y%m%d-%H%M%S.json")
    path.write_text(json.dumps(result, indent=1))
    print(header(args, builds))
    print(table(rows(runs, args.variants)))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
