"""SSE relay benchmark: direct vs muxproxy (HTTP/1.1 and h2c clients) vs nginx vs a Trio relay.

One command runs every variant against the same paced SSE backend, with the same load, and
prints a markdown table (and writes everything measured to ``bench/results/*.json``)::

    python bench/sse_bench.py --streams 100,300,1000 --interval 0.02 --warmup 3 --duration 10

Variants (``--variants``, comma-separated, default all):

* ``direct``       client -> backend
* ``muxproxy-h1``  HTTP/1.1 client -> muxproxy -> HTTP/1.1 backend
* ``muxproxy-h2``  h2c client (``--h2-per-conn`` streams per connection) -> muxproxy -> backend
* ``nginx``        HTTP/1.1 client -> nginx (Debian package, 1 worker, SSE-guide config)
* ``trio-relay``   HTTP/1.1 client -> bench/trio_relay.py (bare byte relay) -> backend

For each variant a fresh proxy process is started; first the idle-stream RSS is measured
(``--idle-streams`` streams that receive nothing), then one load run per ``--streams`` value.
Every process this script starts is stopped at the end, also on errors (by PID).

The backend (``sse_backend.py``) and the load client (``sse_client.py``) are separate
processes; the client measures the window and reads the CPU time of the backend and of the
proxy from ``/proc/PID/stat``. See docs/performance.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BACKEND = HERE / "sse_backend.py"
CLIENT = HERE / "sse_client.py"
RELAY = HERE / "trio_relay.py"
PYSPY_TOP = HERE / "pyspy_top.py"

VARIANTS = {
    # name: (label, proxy kind or None, client protocol)
    "direct": ("(a) direct", None, "h1"),
    "muxproxy-h1": ("(b) muxproxy h1→h1", "muxproxy", "h1"),
    "muxproxy-h2": ("(c) muxproxy h2→h1", "muxproxy", "h2"),
    "nginx": ("(d) nginx h1→h1", "nginx", "h1"),
    "trio-relay": ("(e) trio-relay", "relay", "h1"),
}

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
        listen {listen} backlog=4096;
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


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        if int(raw[raw.rfind(b")") + 2 :].split()[1]) == pid:
            out.append(int(entry))
    return out


class Proc:
    """A process we started: its log, the PIDs to measure, and a stop that always happens."""

    def __init__(self, name: str, argv: list[str], log: Path, port: int) -> None:
        self.name = name
        self.log = log
        self.port = port
        self.logfile = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self.logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # A shell without job control starts background jobs with SIGINT ignored; give the
            # child the default back so that stop() can end it gracefully with SIGINT.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.extra: list[int] = []
        """Children we found (nginx workers), stopped with it."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def measured_pids(self) -> list[int]:
        return [self.pid, *self.extra]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if self.name != "nginx" else signal.SIGTERM)
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


def start_backend(tmp: Path, interval_ms: float, slots: int) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        str(BACKEND),
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


def start_proxy(kind: str, tmp: Path, backend: str, nginx: str) -> Proc:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    listen = f"127.0.0.1:{port}"
    if kind == "muxproxy":
        argv = [sys.executable, "-m", "muxproxy", "serve", "--listen", listen]
        argv += ["--upstream", backend]
        proc = Proc("muxproxy", argv, tmp / "muxproxy.log", port)
    elif kind == "relay":
        argv = [sys.executable, str(RELAY), "--listen", listen, "--upstream", backend]
        proc = Proc("trio-relay", argv, tmp / "trio-relay.log", port)
    elif kind == "nginx":
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
        conf.write_text(NGINX_CONF.format(tmp=ntmp, backend=backend, listen=listen))
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
        proc = Proc("nginx", argv, tmp / "nginx.log", port)
    else:
        raise ValueError(kind)
    try:
        wait_listening(port, proc.proc)
        if kind == "nginx":
            deadline = time.monotonic() + 5
            while not proc.extra and time.monotonic() < deadline:
                proc.extra = children_of(proc.pid)
                time.sleep(0.05)
    except BaseException:
        proc.stop()
        raise
    return proc


def run_client(args: argparse.Namespace, argv: list[str], timeout: float) -> dict[str, object]:
    cmd = [sys.executable, str(CLIENT), *argv]
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

    def cpu() -> float:
        total = 0.0
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
                fields = raw[raw.rfind(b")") + 2 :].split()
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    while time.monotonic() < deadline:
        before = cpu()
        time.sleep(0.5)
        if cpu() - before < 0.05:  # under 10 % of a core
            return


def bench(args: argparse.Namespace) -> dict[str, object]:
    interval_ms = args.interval * 1000.0
    tmp = Path(tempfile.mkdtemp(prefix="muxbench-"))
    started: list[Proc] = []
    runs: list[dict[str, object]] = []
    try:
        backend = start_backend(tmp, interval_ms, args.slots)
        started.append(backend)
        baddr = f"127.0.0.1:{backend.port}"
        # One fresh proxy per variant, all started up front so the load runs can go round robin.
        proxies: dict[str, Proc] = {}
        for name in args.variants:
            kind = VARIANTS[name][1]
            if kind is not None:
                proxies[name] = start_proxy(kind, tmp / name, baddr, args.nginx)
                started.append(proxies[name])

        def common(name: str) -> list[str]:
            proto = VARIANTS[name][2]
            proxy = proxies.get(name)
            argv = [
                "--target",
                f"127.0.0.1:{proxy.port}" if proxy else baddr,
                "--backend",
                baddr,
                "--proto",
                proto,
                "--interval-ms",
                str(interval_ms),
                "--h2-per-conn",
                str(args.h2_per_conn),
                "--pid",
                f"backend={backend.pid}",
                "--ramp-limit",
                str(args.ramp_limit),
            ]
            if proxy:
                argv += ["--pid", "proxy=" + ",".join(map(str, proxy.measured_pids()))]
            return argv

        if args.idle_streams and not args.profile:
            for name, proxy in proxies.items():
                label = VARIANTS[name][0]
                print(f"# {label}: {args.idle_streams} idle streams (RSS)", file=sys.stderr)
                res = run_client(
                    args,
                    [*common(name), "--mode", "idle", "--streams", str(args.idle_streams)],
                    timeout=120,
                )
                runs.append({"variant": name, "label": label, **res})
                report_problems(label, res, proxy)
                quiesce(started)

        for rep in range(args.repeat):
            for streams in args.streams:
                # Rotate the order each repeat so no variant always runs first or last.
                k = rep % len(args.variants)
                for name in args.variants[k:] + args.variants[:k]:
                    label, kind, _ = VARIANTS[name]
                    proxy = proxies.get(name)
                    if proxy is not None and not proxy.alive():
                        runs.append(
                            {
                                "variant": name,
                                "label": label,
                                "streams": streams,
                                "error": "proxy is not running",
                                "log": proxy.log_tail(),
                            }
                        )
                        continue
                    print(
                        f"# [{rep + 1}/{args.repeat}] {label}: {streams} streams", file=sys.stderr
                    )
                    extra = []
                    if args.profile and kind in ("muxproxy", "relay"):
                        out = Path(args.out) / f"pyspy-{name}-{streams}.txt"
                        extra = ["--profile-out", str(out), "--py-spy", args.py_spy]
                        args.profiles.append(out)
                    res = run_client(
                        args,
                        [
                            *common(name),
                            *extra,
                            "--mode",
                            "load",
                            "--streams",
                            str(streams),
                            "--warmup",
                            str(args.warmup),
                            "--duration",
                            str(args.duration),
                            "--probe-interval",
                            str(args.probe_interval),
                        ],
                        timeout=args.warmup + args.duration + 150,
                    )
                    runs.append({"variant": name, "label": label, "repeat": rep, **res})
                    report_problems(label, res, proxy)
                    quiesce(started)
        for name, proxy in proxies.items():
            if not proxy.alive():
                runs.append(
                    {
                        "variant": name,
                        "label": VARIANTS[name][0],
                        "error": f"proxy exited ({proxy.proc.returncode})",
                        "log": proxy.log_tail(),
                    }
                )
    finally:
        for proc in reversed(started):
            proc.stop()
        if args.keep_tmp:
            print(f"# logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"meta": meta(args), "runs": runs}


def report_problems(label: str, res: dict[str, object], proxy: Proc | None) -> None:
    if res.get("error"):
        print(f"#   ERROR {label}: {res['error']}", file=sys.stderr)
        if proxy is not None:
            print(proxy.log_tail(), file=sys.stderr)
    elif res.get("errors"):
        print(f"#   errors {label}: {res['errors']}", file=sys.stderr)


def meta(args: argparse.Namespace) -> dict[str, object]:
    def cmd(argv: list[str]) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, timeout=10, check=False, cwd=ROOT)
            return (done.stdout or done.stderr).decode(errors="replace").strip()
        except OSError:
            return ""

    digest = hashlib.sha256()
    for path in sorted((ROOT / "muxproxy").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
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
        "nginx": cmd([args.nginx, "-v"]),
        "git_commit": cmd(["git", "rev-parse", "--short", "HEAD"]),
        "muxproxy_sources_sha256": digest.hexdigest()[:16],
        "git_dirty": bool(cmd(["git", "status", "--porcelain", "--untracked-files=no"])),
        "interval_s": args.interval,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "slots": args.slots,
        "h2_per_conn": args.h2_per_conn,
        "idle_streams": args.idle_streams,
        "repeat": args.repeat,
        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
    }


# --- the table -----------------------------------------------------------------------------


def fmt(value: object, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None and v == v)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def aggregate(runs: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per (variant, streams): the median over repeats of every metric."""
    groups: dict[tuple[str, int], list[dict[str, object]]] = {}
    for r in runs:
        if r.get("mode") == "load":
            groups.setdefault((r["variant"], r["streams"]), []).append(r)
    rows = []
    for (variant, streams), group in groups.items():

        def med(get: object, group: list[dict[str, object]] = group) -> float | None:
            out = []
            for r in group:
                try:
                    out.append(get(r))  # type: ignore[operator]
                except (KeyError, TypeError):
                    pass
            return median(out)

        first = group[0]
        row = {
            "variant": variant,
            "label": first["label"],
            "streams": streams,
            "repeats": len(group),
            "events_per_s": med(lambda r: r["events_per_s"]),
            "expected": first["expected_events_per_s"],
            "min_events_per_s": min(r["events_per_s"] for r in group),
            "proxy_cpu_pct": med(lambda r: r["cpu_pct"]["proxy"]),
            "us_per_event": med(lambda r: r["proxy_cpu_us_per_event"]),
            "backend_cpu_pct": med(lambda r: r["cpu_pct"]["backend"]),
            "client_cpu_pct": med(lambda r: r["client_cpu_pct"]),
            "others_cpu_pct": med(lambda r: r["other_processes_cpu_pct"]),
            "backend_events_per_s": med(lambda r: r["backend_events_per_s"]),
            "ttfb_p50": med(lambda r: r["ttfb_ms"]["p50"]),
            "behind": [
                r
                for r in group
                if r["events_per_s"] < 0.97 * r["expected_events_per_s"]
                or r.get("streams_without_events")
            ],
            "errors": [r["errors"] for r in group if r.get("errors")],
        }
        for q in ("min", "p50", "p90", "p99", "p999", "max"):
            row[f"lat_{q}"] = med(lambda r, q=q: r["latency_ms"][q])
        rows.append(row)
    order = list(VARIANTS)
    rows.sort(key=lambda r: (r["streams"], order.index(r["variant"])))
    return rows


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
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="100,1000", help="comma-separated stream counts")
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
    parser.add_argument("--variants", default=",".join(VARIANTS))
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
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the muxproxy and trio-relay variants during each window (no RSS test)",
    )
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the logs and nginx conf")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.profiles = []
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if any(VARIANTS[v][1] == "nginx" for v in args.variants) and not Path(args.nginx).exists():
        parser.error("nginx not found (apt-get install nginx-light), or leave out --variants nginx")
    Path(args.out).mkdir(parents=True, exist_ok=True)

    result = bench(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(args.out) / f"sse-bench-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"\nresults: {path}")
    if args.profile:
        for prof in args.profiles:
            print(f"\n# {prof.name}")
            subprocess.run([sys.executable, str(PYSPY_TOP), str(prof)], check=False)


if __name__ == "__main__":
    main()
