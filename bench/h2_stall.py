"""Stalled HTTP/2 readers: what clients that never open their window cost the proxy.

``--clients`` h2c clients (one connection each, one stream each) ask for an endless SSE stream
with SETTINGS_INITIAL_WINDOW_SIZE ``--window`` (default 0) and never send a WINDOW_UPDATE,
while the backend (``sse_backend.py``: an OpenAI-sized chunk per ``--interval-ms`` per stream,
forever) keeps producing. Once every stream has its response head and ``--warmup`` seconds went
by, the proxy's CPU seconds over ``--duration`` seconds and its RSS at the end are measured
(``/proc/PID``; also its RSS before the clients came, and the growth per stream), for muxproxy
and for HAProxy (``proto h2`` front end, one thread, the configuration of ``sse_bench.py``),
``--repeat`` times each, alternating; medians are printed. A stalled stream should cost
nothing while it is stalled::

    python bench/h2_stall.py --clients 200 --duration 20 --repeat 3

muxproxy runs from bytecode, as an installed package does (``pip install`` writes the
``.pyc`` files; the image's ``PYTHONDONTWRITEBYTECODE`` only stops new ones): the package is
compiled once before the runs, so that a checkout never written to (``PYTHONDONTWRITEBYTECODE``
set, as on the benchmark VM) does not compile every module at each start, which leaves some
2 MiB of the compiler's garbage in the proxy's heap that an installed proxy never has.

The clients run in a process of their own (``python bench/h2_stall.py client ...``), which
prints ``ready`` once every stream has its response head. Every process started is stopped
at the end (by PID), also on errors. See docs/performance.md ("Stalled HTTP/2 readers").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import trio
from sse_bench import HAPROXY_CONF, Proc, free_port, start_backend, wait_listening
from sse_client import proc_cpu, proc_rss_kib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# -- the clients (a process of their own) ----------------------------------------------------


async def stalled_client(port: int, window: int, ready: trio.Semaphore, heads: list[int]) -> None:
    """One connection, one stream, a window of ``window`` bytes never opened further."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    conn = h2.connection.H2Connection(config=config)
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window}
    )
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    request = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/sse")]
    conn.send_headers(sid, [*request, (b":authority", b"bench")], end_stream=True)
    await stream.send_all(conn.data_to_send())
    counted = False
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and not counted:
                counted = True
                heads.append(sid)
                ready.release()
            # DATA is never acknowledged: no WINDOW_UPDATE ever leaves (h2 sends SETTINGS
            # and PING acknowledgements by itself).
        out = conn.data_to_send()
        if out:
            await stream.send_all(out)


async def run_clients(port: int, clients: int, window: int) -> None:
    ready = trio.Semaphore(0, max_value=clients)
    heads: list[int] = []
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(stalled_client, port, window, ready, heads)
        for _ in range(clients):
            await ready.acquire()
        print("ready", flush=True)


# -- the runs --------------------------------------------------------------------------------


def start_muxproxy(tmp: Path, backend: str) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "muxproxy", "serve", "--listen", f"127.0.0.1:{port}"]
    argv += ["--upstream", backend]
    proc = Proc("muxproxy", argv, tmp / "muxproxy.log", port, cwd=ROOT)
    wait_listening(port, proc.proc)
    return proc


def start_haproxy(tmp: Path, backend: str) -> Proc:
    port = free_port()
    conf = tmp / "haproxy.cfg"
    listen = f"127.0.0.1:{port}"
    conf.write_text(HAPROXY_CONF.format(tmp=tmp, backend=backend, listen=listen, proto=" proto h2"))
    argv = [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(conf)]
    proc = Proc("haproxy", argv, tmp / "haproxy.log", port)
    wait_listening(port, proc.proc)
    return proc


def one_run(variant: str, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    backend = start_backend(tmp, args.interval_ms, 10)
    proxy: Proc | None = None
    client: subprocess.Popen[bytes] | None = None
    try:
        address = f"127.0.0.1:{backend.port}"
        start = start_muxproxy if variant == "muxproxy" else start_haproxy
        proxy = start(tmp, address)
        time.sleep(1)  # settled before its idle size is taken
        idle = proc_rss_kib(proxy.measured_pids())
        argv = [sys.executable, __file__, "client", "--port", str(proxy.port)]
        argv += ["--clients", str(args.clients), "--window", str(args.window)]
        client = subprocess.Popen(argv, stdout=subprocess.PIPE)
        assert client.stdout is not None
        line = client.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"clients did not start: {line!r}\n{proxy.log_tail()}")
        time.sleep(args.warmup)
        pids = proxy.measured_pids()
        cpu0 = proc_cpu(pids)
        time.sleep(args.duration)
        cpu = proc_cpu(pids) - cpu0
        rss = proc_rss_kib(pids)
        if not proxy.alive():
            raise RuntimeError(f"{variant} exited:\n{proxy.log_tail()}")
        return {
            "cpu_s": cpu,
            "rss_mib": rss / 1024,
            "idle_rss_mib": idle / 1024,
            "kib_per_stream": (rss - idle) / args.clients,
        }
    finally:
        if client is not None:
            client.kill()
            client.wait()
        if proxy is not None:
            proxy.stop()
        backend.stop()


def main(args: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    # As installed (see the module's docstring); compileall writes even where
    # PYTHONDONTWRITEBYTECODE is set, into the ignored __pycache__ folders.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "muxproxy")], check=True)
    with tempfile.TemporaryDirectory(prefix="h2stall-") as tmpdir:
        for i in range(args.repeat):
            for variant in args.variants:
                tmp = Path(tmpdir) / f"{variant}-{i}"
                tmp.mkdir()
                result = one_run(variant, tmp, args)
                results[variant].append(result)
                print(f"{variant} run {i + 1}: {json.dumps(result)}", flush=True)
    print(
        f"\n{args.clients} clients, window {args.window}, one chunk per {args.interval_ms:g} ms "
        f"per stream, {args.duration:g} s measured after {args.warmup:g} s; medians of "
        f"{args.repeat}\n"
    )
    print("| proxy | CPU s | RSS MiB | RSS before the clients, MiB | KiB per stalled stream |")
    print("|---|---:|---:|---:|---:|")
    for variant, runs in results.items():
        cpu, rss, idle, per_stream = (
            statistics.median(r[key] for r in runs)
            for key in ("cpu_s", "rss_mib", "idle_rss_mib", "kib_per_stream")
        )
        print(f"| {variant} | {cpu:.2f} | {rss:.1f} | {idle:.1f} | {per_stream:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if sys.argv[1:2] == ["client"]:
        parser.add_argument("mode")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--clients", type=int, required=True)
        parser.add_argument("--window", type=int, required=True)
        cargs = parser.parse_args()
        trio.run(run_clients, cargs.port, cargs.clients, cargs.window)
        sys.exit(0)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--window", type=int, default=0, help="the clients' stream window")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="per-stream chunk period")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["muxproxy", "haproxy"])
    main(parser.parse_args())
