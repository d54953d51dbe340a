"""The deployment files under ``deploy/`` agree with each other and with muxproxy's code.

``docs/deploy.md`` describes them: the example configuration, the systemd unit, the
Dockerfile and the Kubernetes manifests. What must agree is checked here, taking each value
from the code where the code has it: the graceful-stop and reload signals (by handing them to
the command line's own signal handler), the stop margins (``FLUSH_TIME``, ``KILL_MARGIN``),
the admin token's variable, the readiness route (``READY_PATH``), the exit status of an
invalid configuration. The probes run for real against a proxy built from the example
configuration, before and during a graceful stop: the liveness probe as a process, the
readiness probe as the kubelet sends it (a GET without a token, on the pod's address);
``muxproxy check`` runs as a process too. Docker and Kubernetes
are not needed: the files are parsed (PyYAML for the manifests, small readers below for the
unit and the Dockerfile).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Mapping
from functools import cache, partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx
import pytest
import trio
import yaml

from muxproxy.config import ADMIN_TOKEN_ENV, Config, ConfigError, load_config, parse_config
from muxproxy.config.admin import is_loopback
from muxproxy.config.fleetkeys import FLEET_STORE_ENV
from muxproxy.process.cli import OneProcess
from muxproxy.process.common import EXIT_USAGE
from muxproxy.process.signals import HANDLED_SIGNALS, STOP_SIGNALS, obey
from muxproxy.process.workers import KILL_MARGIN
from muxproxy.trio.admin import READY_PATH
from muxproxy.trio.local import serve_control
from muxproxy.trio.server import FLUSH_TIME, Phase, ProxyServer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "muxproxy.toml"
KUBERNETES = DEPLOY / "kubernetes"
TOKEN = "deploy-test-token"

STOP_MARGIN = max(FLUSH_TIME, KILL_MARGIN)
"""Seconds past ``shutdown_grace`` a stop may take: a single process flushes its last sockets
for ``FLUSH_TIME``, a supervisor kills a worker ``KILL_MARGIN`` past the grace."""


# -- readers -----------------------------------------------------------------------------------


def example_config() -> Config:
    return parse_config(
        tomllib.loads(EXAMPLE.read_text()),
        base_dir=str(DEPLOY),
        environ={ADMIN_TOKEN_ENV: TOKEN},
    )


@cache
def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every document of every YAML file in deploy/kubernetes, by file name."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(KUBERNETES.glob("*.yaml"))
    }


def manifest(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (Deployment, Service...), of that ``name`` if given."""
    found = [
        doc
        for docs in manifests().values()
        for doc in docs
        if doc["kind"] == kind and name in (None, doc.get("metadata", {}).get("name"))
    ]
    assert len(found) == 1, f"{len(found)} manifests of kind {kind}"
    return found[0]


@cache
def examples() -> dict[str, list[dict[str, Any]]]:
    """Every document of deploy/kubernetes/examples/*.yaml, by file name."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted((KUBERNETES / "examples").glob("*.yaml"))
    }


def container() -> dict[str, Any]:
    containers = manifest("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


@cache
def unit() -> dict[str, dict[str, list[str]]]:
    """deploy/systemd/muxproxy.service: section -> key -> values, in order (a key may repeat,
    as ExecReload does)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] = {}
    for raw in (DEPLOY / "systemd" / "muxproxy.service").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, equals, value = line.partition("=")
        assert equals, f"not a key=value line: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(key: str) -> str:
    """The single value of ``key`` in the unit's [Service] section."""
    values = unit()["Service"][key]
    assert len(values) == 1, f"{key} set {len(values)} times"
    return values[0]


@cache
def dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments), continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    return instructions


def docker(instruction: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == instruction]


def final_stage() -> list[tuple[str, str]]:
    """The instructions of the image's last stage (from its last FROM on)."""
    starts = [i for i, (word, _) in enumerate(dockerfile()) if word == "FROM"]
    return dockerfile()[starts[-1] :]


def copied_to(source: str) -> str:
    """Where the final stage's ``COPY source DEST`` puts ``source``."""
    for word, rest in final_stage():
        if word == "COPY" and not rest.startswith("--"):
            src, dest = rest.split()
            if src == source:
                return dest
    raise AssertionError(f"the image does not copy {source}")


@attrs.define
class FakeServer:
    """What ``muxproxy.process.cli.OneProcess`` touches of a running ``ProxyServer``."""

    config: Config
    phase: Phase = Phase.SERVING
    generation: int = 1
    shutdowns: int = 0
    reloads: list[Config] = attrs.field(factory=list)

    def streams_in_flight(self) -> int:
        return 0

    def request_shutdown(self) -> None:
        self.shutdowns += 1

    def reload(self, config: Config) -> list[Any]:
        self.reloads.append(config)
        return []


def handled_as(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """What ``muxproxy serve --config deploy/muxproxy.toml`` does on the signal ``name``
    (``SIGTERM``, ``HUP``...) while serving: "stop", "reload" or "nothing" (a signal muxproxy
    does not receive, such as SIGKILL)."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    signum = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    if signum not in HANDLED_SIGNALS:  # never delivered to the handler: the default action
        return "nothing"
    server = FakeServer(config=example_config())

    async def received() -> AsyncIterator[int]:
        yield int(signum)

    trio.run(obey, received(), OneProcess(server, str(EXAMPLE), None))
    assert server.shutdowns + len(server.reloads) <= 1
    return "stop" if server.shutdowns else "reload" if server.reloads else "nothing"


def liveness_command() -> list[str]:
    """The liveness probe's command (an exec probe: probe.py on ``/status``)."""
    command: list[str] = container()["livenessProbe"]["exec"]["command"]
    return command


def readiness_get() -> dict[str, Any]:
    """The readiness probe's ``httpGet`` (path, port: a port's name or number)."""
    probe: dict[str, Any] = container()["readinessProbe"]
    assert set(probe) & {"exec", "httpGet", "tcpSocket", "grpc"} == {"httpGet"}
    get: dict[str, Any] = probe["httpGet"]
    return get


def container_port(port: int | str) -> int:
    """A probe's ``port``: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [item["containerPort"] for item in container()["ports"] if item["name"] == port]
    return int(number)


def seconds(text: str) -> float:
    """A systemd time span: ``130``, ``130s``, ``2min 10s``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60}
    total = 0.0
    for number, unit_name in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * units[unit_name]
    return total


# -- the example configuration -----------------------------------------------------------------


def test_example_configuration_takes_the_admin_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    config = load_config(EXAMPLE)
    assert config.admin is not None and config.admin.token == TOKEN
    assert "token" not in tomllib.loads(EXAMPLE.read_text())["admin"]
    # The admin address is not loopback: without the variable muxproxy refuses to start.
    assert not is_loopback(config.admin.host)
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    with pytest.raises(ConfigError) as refused:
        load_config(EXAMPLE)
    assert any(problem.startswith("admin.token: missing") for problem in refused.value.problems)


def test_muxproxy_check_accepts_the_example_configuration() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "muxproxy", "check", "--config", str(EXAMPLE)],
        env={**os.environ, ADMIN_TOKEN_ENV: TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout
    assert "graceful stop: streams get 120s to finish" in result.stdout


def test_configmap_holds_the_example_configuration_word_for_word() -> None:
    configmap = manifest("ConfigMap")
    assert list(configmap["data"]) == ["muxproxy.toml"]
    text = configmap["data"]["muxproxy.toml"]
    assert text == EXAMPLE.read_text()
    parsed = parse_config(tomllib.loads(text), environ={ADMIN_TOKEN_ENV: TOKEN})
    assert parsed == example_config()


# -- systemd -----------------------------------------------------------------------------------


def test_unit_checks_then_serves_the_same_configuration() -> None:
    start = shlex.split(service("ExecStart"))
    check = shlex.split(service("ExecStartPre"))
    assert start[1:3] == ["serve", "--config"] and check[1:3] == ["check", "--config"]
    assert check[0] == start[0] and check[3] == start[3]


def test_unit_kill_signal_is_muxproxys_graceful_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    kill_signal = service("KillSignal")
    assert signal.Signals[kill_signal] in STOP_SIGNALS
    assert handled_as(kill_signal, monkeypatch) == "stop"
    # Only the main process gets it: a worker sent it besides the supervisor's own "stop"
    # would take it for a second stop and cut its streams.
    assert service("KillMode") == "mixed"


def test_unit_waits_out_the_shutdown_grace_before_sigkill() -> None:
    grace = example_config().timeouts.shutdown_grace
    assert seconds(service("TimeoutStopSec")) >= grace + STOP_MARGIN


def test_unit_reload_checks_the_file_then_sends_muxproxys_reload_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check, kill = (shlex.split(line) for line in unit()["Service"]["ExecReload"])
    assert check == shlex.split(service("ExecStartPre"))
    assert kill[0].endswith("/kill") and kill[1] == "-s" and kill[3] == "$MAINPID"
    assert handled_as(kill[2], monkeypatch) == "reload"


def test_unit_restarts_on_failure_but_not_for_an_invalid_configuration() -> None:
    assert service("Restart") == "on-failure"
    assert str(EXIT_USAGE) in service("RestartPreventExitStatus").split()


def test_unit_descriptor_limit_covers_max_client_connections() -> None:
    # One descriptor per client connection, and as many again for backend connections.
    limits = example_config().limits
    assert int(service("LimitNOFILE")) >= 2 * limits.max_client_connections + 1024


def test_unit_runs_as_its_own_user_with_the_token_from_a_file() -> None:
    assert service("User") not in ("root", "0") and service("Group") not in ("root", "0")
    assert service("EnvironmentFile").startswith("/etc/muxproxy/")
    assert service("NoNewPrivileges") == "yes"
    assert service("ProtectSystem") == "strict"
    # ProtectSystem=strict leaves no place to write but this one (for [admin] state_file).
    commented = re.search(r'state_file = "(.+)"', EXAMPLE.read_text())
    assert commented is not None
    assert Path(commented.group(1)).parent == Path("/var/lib") / service("StateDirectory")


# -- the image ---------------------------------------------------------------------------------


def test_image_runs_as_a_user_that_is_not_root() -> None:
    (user,) = [rest for word, rest in final_stage() if word == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)


def test_image_build_checks_the_configuration_it_copies() -> None:
    config_path = copied_to("deploy/muxproxy.toml")
    runs = [rest for word, rest in final_stage() if word == "RUN"]
    checks = [run for run in runs if "muxproxy check" in run]
    assert len(checks) == 1
    words = shlex.split(checks[0])
    assert words[words.index("--config") + 1] == config_path
    assert any(word.startswith(f"{ADMIN_TOKEN_ENV}=") for word in words)
    (cmd,) = docker("CMD")
    assert json.loads(cmd) == ["serve", "--config", config_path]


def test_image_stop_signal_is_muxproxys_graceful_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    (stop_signal,) = docker("STOPSIGNAL")
    assert handled_as(stop_signal, monkeypatch) == "stop"


def test_image_exposes_the_listeners_and_the_admin_api() -> None:
    config = example_config()
    assert config.admin is not None
    exposed = {int(port) for rest in docker("EXPOSE") for port in rest.split()}
    assert exposed == {listener.port for listener in config.listeners} | {config.admin.port}


def test_image_installs_the_package_without_test_extras() -> None:
    runs = " ".join(rest for word, rest in dockerfile() if word == "RUN")
    assert re.search(r"pip install (--\S+ )*\.(\s|$)", runs)
    assert "[test]" not in runs


def test_image_copies_only_named_files_that_exist_and_are_not_ignored() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for word, rest in dockerfile():
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _ = rest.split()
        for source in sources:
            assert source not in (".", "./", "*"), "COPY of the whole context"
            assert (ROOT / source).exists(), source
            assert f"!{source}" in ignore, f"{source} is left out of the build context"


def test_image_healthcheck_is_the_pods_liveness_probe() -> None:
    (healthcheck,) = docker("HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command == liveness_command()
    assert command[1] == copied_to("deploy/probe.py")


def test_image_entrypoint_raises_the_soft_descriptor_limit(tmp_path: Path) -> None:
    # The ENTRYPOINT's shell, with a stand-in muxproxy that reports what it got.
    (entrypoint,) = docker("ENTRYPOINT")
    argv = json.loads(entrypoint)
    assert argv[:2] == ["/bin/sh", "-c"]
    fake = tmp_path / "muxproxy"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, resource, sys\n"
        "print(json.dumps([resource.getrlimit(resource.RLIMIT_NOFILE), sys.argv[1:]]))\n"
    )
    fake.chmod(0o755)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = min(256, hard)

    def lower_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    result = subprocess.run(
        [*argv, "serve", "--config", "/etc/muxproxy/muxproxy.toml"],
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        preexec_fn=lower_soft_limit,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    limits, args = json.loads(result.stdout)
    assert limits == [hard, hard]
    assert args == ["serve", "--config", "/etc/muxproxy/muxproxy.toml"]


# -- Kubernetes --------------------------------------------------------------------------------


def test_manifests_use_the_stable_api_versions() -> None:
    versions = {doc["kind"]: doc["apiVersion"] for docs in manifests().values() for doc in docs}
    assert versions == {
        "ConfigMap": "v1",
        "Deployment": "apps/v1",
        "Service": "v1",
        "PodDisruptionBudget": "policy/v1",
        "Secret": "v1",
        "Kustomization": "kustomize.config.k8s.io/v1beta1",
    }


def test_kustomization_applies_every_manifest_but_the_example_secret() -> None:
    listed = manifest("Kustomization")["resources"]
    wanted = set(manifests()) - {"kustomization.yaml", "secret.example.yaml"}
    assert sorted(listed) == sorted(wanted)


def test_service_pdb_and_deployment_select_the_same_pods() -> None:
    spec = manifest("Deployment")["spec"]
    labels = spec["selector"]["matchLabels"]
    assert labels.items() <= spec["template"]["metadata"]["labels"].items()
    assert manifest("Service")["spec"]["selector"] == labels
    assert manifest("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == labels
    assert manifest("PodDisruptionBudget")["spec"]["maxUnavailable"] < spec["replicas"]


def test_container_ports_are_the_listeners_and_the_admin_api() -> None:
    config = example_config()
    assert config.admin is not None
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    assert ports.pop("admin") == config.admin.port
    assert set(ports.values()) == {listener.port for listener in config.listeners}
    # The Service sends clients to a listener, never to the admin API.
    for port in manifest("Service")["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()


def test_readiness_probe_gets_the_ready_route_of_the_admin_api() -> None:
    config = example_config()
    assert config.admin is not None
    get = readiness_get()
    assert get["path"] == READY_PATH
    assert container_port(get["port"]) == config.admin.port
    # The kubelet sends it to the pod's address with no token: /ready must need none there.
    assert get.get("scheme", "HTTP") == "HTTP" and "httpHeaders" not in get
    assert "host" not in get and not is_loopback(config.admin.host)


def test_liveness_probe_asks_the_admin_api_for_its_status_on_loopback() -> None:
    # /status, not /ready: a 503 from /ready during the drain would get the pod killed.
    config = example_config()
    assert config.admin is not None
    command = liveness_command()
    assert command[:2] == ["python3", copied_to("deploy/probe.py")]
    url = urlsplit(command[2])
    # Inside the pod: loopback reaches an admin API bound to any address, and no one else.
    assert url.hostname is not None and is_loopback(url.hostname)
    assert url.port == config.admin.port and url.path == "/status"
    assert container()["livenessProbe"]["timeoutSeconds"] > 2.0  # probe.py's own TIMEOUT


def test_termination_grace_covers_prestop_and_shutdown_grace() -> None:
    pod = manifest("Deployment")["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    wait = float(pre_stop[1])
    assert wait >= 5  # kube-proxy and load balancers learn of a terminating pod in seconds
    grace = example_config().timeouts.shutdown_grace
    assert pod["terminationGracePeriodSeconds"] >= wait + grace + STOP_MARGIN


def test_rolling_update_keeps_every_replica_serving() -> None:
    strategy = manifest("Deployment")["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert strategy["rollingUpdate"]["maxSurge"] >= 1


def test_admin_token_comes_from_the_secret() -> None:
    (env,) = [var for var in container()["env"] if var["name"] == ADMIN_TOKEN_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = manifest("Secret", ref["name"])
    example_token = secret["stringData"][ref["key"]]
    # The example's placeholder is a token the configuration accepts.
    data = tomllib.loads(manifest("ConfigMap")["data"]["muxproxy.toml"])
    config = parse_config(data, environ={ADMIN_TOKEN_ENV: example_token})
    assert config.admin is not None and config.admin.token == example_token


def test_configuration_is_mounted_where_serve_reads_it() -> None:
    spec = container()
    args = spec["args"]
    assert args[:2] == ["serve", "--config"]
    assert args == json.loads(docker("CMD")[0])
    (volume,) = manifest("Deployment")["spec"]["template"]["spec"]["volumes"]
    assert volume["configMap"]["name"] == manifest("ConfigMap")["metadata"]["name"]
    (mount,) = spec["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    # A subPath mount would never see a changed ConfigMap: reloads would read the old file.
    assert "subPath" not in mount
    assert Path(mount["mountPath"]) / "muxproxy.toml" == Path(args[2])


def test_pod_runs_as_the_images_user_without_privileges() -> None:
    pod = manifest("Deployment")["spec"]["template"]["spec"]["securityContext"]
    (user,) = [rest for word, rest in final_stage() if word == "USER"]
    assert pod["runAsNonRoot"] is True
    assert f"{pod['runAsUser']}:{pod['runAsGroup']}" == user
    context = container()["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    requests = container()["resources"]["requests"]
    assert "cpu" in requests and "memory" in requests


# -- the probe against a real proxy ------------------------------------------------------------


def on_port_zero(address: str) -> str:
    return f"{address.rsplit(':', 1)[0]}:0"


def config_on_port_zero(backend_port: int) -> Config:
    """The example configuration on port 0, its one group on ``backend_port``."""
    data = tomllib.loads(EXAMPLE.read_text())
    for listener in data["listeners"]:
        listener["address"] = on_port_zero(listener["address"])
    data["admin"]["address"] = on_port_zero(data["admin"]["address"])
    # The example discovers its engines in the cluster's DNS; here one is listed instead.
    del data["upstreams"]["gpus"]["discover"]
    data["upstreams"]["gpus"]["servers"] = [{"address": f"127.0.0.1:{backend_port}"}]
    return parse_config(data, environ={ADMIN_TOKEN_ENV: TOKEN})


async def probe(admin_port: int, environ: Mapping[str, str]) -> int:
    """Run the pod's liveness probe against ``admin_port``; its exit status."""
    command = liveness_command()
    url = urlsplit(command[2])._replace(netloc=f"127.0.0.1:{admin_port}").geturl()
    result = await trio.run_process(
        [sys.executable, str(DEPLOY / "probe.py"), url],
        env=dict(environ),
        check=False,
        capture_stderr=True,
    )
    return result.returncode


async def hold_backend(
    generation_asked: trio.Event, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A GPU that answers health checks and never answers a generation."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            while True:  # the proxy may reuse a health check's connection for a request
                while b"\r\n\r\n" not in received:
                    chunk = await stream.receive_some()
                    if not chunk:
                        return
                    received += chunk
                head, _, received = received.partition(b"\r\n\r\n")
                if not head.startswith(b"GET /health "):
                    generation_asked.set()
                    await trio.sleep_forever()
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def ready(client: httpx.AsyncClient, admin_port: int) -> int:
    """The status the pod's readiness probe gets from ``admin_port``, as the kubelet asks:
    a GET of its path, no token."""
    response = await client.get(f"http://127.0.0.1:{admin_port}{readiness_get()['path']}")
    return response.status_code


async def test_probes_while_serving_and_draining() -> None:
    with_token = {**os.environ, ADMIN_TOKEN_ENV: TOKEN}
    without_token = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=5) as http:
            asked = trio.Event()
            backend_port = await nursery.start(hold_backend, asked)
            server = ProxyServer(config_on_port_zero(backend_port))
            (proxy,) = await nursery.start(server.run)
            admin = await nursery.start(partial(serve_control, server))
            assert not is_loopback(admin[0])  # as in a pod: reads need the token

            assert await probe(admin[1], with_token) == 0
            assert await probe(admin[1], without_token) == 1
            assert await ready(http, admin[1]) == 200

            # A stream in flight keeps the graceful stop going.
            client = await trio.open_tcp_stream("127.0.0.1", proxy[1])
            body = b'{"model": "m", "stream": true, "messages": []}'
            await client.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: muxproxy\r\n"
                b"content-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await asked.wait()
            server.request_shutdown()
            assert server.phase is Phase.DRAINING
            # Not ready from the start of the stop; alive (the admin API answers) until the
            # process stops, so the kubelet does not kill a draining pod.
            assert await ready(http, admin[1]) == 503
            assert await probe(admin[1], with_token) == 0
            nursery.cancel_scope.cancel()
        await client.aclose()
    assert await probe(admin[1], with_token) == 1


# -- the fleet ---------------------------------------------------------------------------------


def test_the_fleet_store_comes_from_its_secret_and_is_a_store_the_configuration_accepts() -> None:
    (env,) = [var for var in container()["env"] if var["name"] == FLEET_STORE_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = manifest("Secret", ref["name"])
    url = secret["stringData"][ref["key"]]
    data = tomllib.loads(manifest("ConfigMap")["data"]["muxproxy.toml"])
    assert "fleet" not in data, "the store's URL (and password) belongs in the Secret"
    config = parse_config(data, environ={ADMIN_TOKEN_ENV: TOKEN, FLEET_STORE_ENV: url})
    assert config.fleet is not None and config.fleet.store == url
    # The example Secret names the example Redis's Service.
    (redis_service,) = [doc for doc in examples()["redis.yaml"] if doc["kind"] == "Service"]
    host = urlsplit(url).hostname
    assert host is not None and host.split(".")[0] == redis_service["metadata"]["name"]
    assert urlsplit(url).port == redis_service["spec"]["ports"][0]["port"]


def test_without_the_store_the_example_runs_alone() -> None:
    assert example_config().fleet is None


def test_the_engines_are_discovered_through_their_headless_service() -> None:
    config = example_config()
    (group,) = config.upstreams.values()
    assert group.discover is not None, "the engines are discovered, not listed pod by pod"
    (service,) = examples()["engines-service.yaml"]
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    meta = service["metadata"]
    assert group.discover.dns == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    assert group.discover.port == service["spec"]["ports"][0]["port"]
    assert group.slow_start > 0


def test_the_example_manifests_are_not_applied_by_the_kustomization() -> None:
    listed = manifest("Kustomization")["resources"]
    assert not [path for path in listed if path.startswith("examples")]
    kinds = {doc["kind"] for docs in examples().values() for doc in docs}
    assert kinds == {"Deployment", "Service"}
