"""The server command lines, as pure functions of their inputs (no files, no environment).

Several ranks run as one `mpirun` command with one `-n 1 tritonserver …` section per rank,
separated by `:`, the scheme of NVIDIA's launch_triton_server.py: every rank gets the same
model repository and its own python-backend shared-memory prefix; rank 0 serves clients and
loads every model, ranks > 0 load only `tensorrt_llm` (`--model-control-mode=explicit`).

What differs from NVIDIA's command, for a CPU machine and for supervision:
- ranks > 0 open no endpoints (`--allow-http=false --allow-grpc=false --allow-metrics=false`)
  instead of all ranks asking for the same ports;
- rank 0 binds its endpoints to `host` (loopback by default) and exports no GPU metrics;
- rank 0 runs in explicit model-control mode with `--load-model=*`: it loads every model at
  start as before, and the repository API (`trtglm models load|unload`) is allowed, but only
  to requests that carry the launch's secret in the API_KEY_HEADER header: the repository API
  (which loads a model's code sent in the request), system shared memory, trace and logging
  settings (which write files) are restricted (`--http-restricted-api`, `--grpc-restricted-protocol`);
- `--backend-directory` when the python backend lives outside /opt/tritonserver;
- `--exit-timeout-secs` bounds how long a SIGTERM'd server waits for in-flight requests;
- mpirun listens on loopback alone (`--mca oob_tcp_if_include lo`, `btl_tcp_if_include lo`),
  as do the ranks' torch.distributed sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); NCCL runs with
  NVLink multicast off (NCCL_NVLS_ENABLE=0) unless the environment says otherwise;
- mpirun runs with `--noprefix` (Open MPI started by absolute path would otherwise put its
  own bin/ first on the ranks' PATH, so the python stubs would find the system python3),
  `--bind-to none` (Open MPI would pin each rank to one core, starving a CPU engine),
  `--oversubscribe` when there are more ranks than cores, `-x VAR` for the environment the
  python stubs need, and `--output-filename DIR:nocopy` for per-rank logs
  (DIR/1/rank.N/stdout and stderr).

A world size of 1 runs tritonserver directly: no mpirun needed, same flags as rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trtglm.backend.contract import TENSORRT_LLM

LLM_MODEL = TENSORRT_LLM  # the one model ranks > 0 load
API_KEY_HEADER = "trtglm-api-key"
# The ranks share one host: Open MPI's daemons and transports listen on loopback alone, not on every interface.
LOOPBACK_ONLY = ("--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo")
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")


@dataclass(frozen=True)
class Endpoints:
    """Where rank 0 listens, and the OpenAI-compatible API (None: not served)."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int | None = None

    def ports(self) -> dict[str, int]:
        ports = {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}
        return ports if self.openai_port is None else {**ports, "openai": self.openai_port}

    def urls(self) -> dict[str, str]:
        """Client addresses; a wildcard bind address is reached through loopback."""
        host = client_host(self.host)
        urls = {"http": f"http://{host}:{self.http_port}", "grpc": f"{host}:{self.grpc_port}",
                "metrics": f"http://{host}:{self.metrics_port}/metrics"}
        return urls if self.openai_port is None else {**urls, "openai": f"http://{host}:{self.openai_port}/v1"}


def client_host(host: str) -> str:
    """The address a local client uses for a server bound to `host` (IPv6 in brackets)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def shm_prefix(base: str, rank: int) -> str:
    """The python backend's shared-memory prefix of one rank (NVIDIA's scheme: base `prefix` → `prefix0_`)."""
    return f"{base}{rank}_"


def server_args(tritonserver: str | Path, repo: str | Path, rank: int, endpoints: Endpoints, *,
                shm_base: str = "prefix", backend_dir: str | Path | None = None,
                exit_timeout_s: int = 5, api_key: str | None = None, server_flags: Sequence[str] = ()) -> list[str]:
    """One rank's tritonserver command line (`api_key`: rank 0's restricted APIs need it; `server_flags`: the
    user's own, last)."""
    args = [str(tritonserver), f"--model-repository={repo}", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix(shm_base, rank)}"]
    if backend_dir is not None:
        args.append(f"--backend-directory={backend_dir}")
    if rank == 0:
        args += [f"--http-address={endpoints.host}", f"--http-port={endpoints.http_port}",
                 f"--grpc-address={endpoints.host}", f"--grpc-port={endpoints.grpc_port}",
                 f"--metrics-address={endpoints.host}", f"--metrics-port={endpoints.metrics_port}",
                 "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
                 "--model-control-mode=explicit", "--load-model=*"]
        if api_key:
            restricted = f"{','.join(RESTRICTED_APIS)}:{API_KEY_HEADER}={api_key}"
            args += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
    else:
        args += ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
                 "--model-control-mode=explicit", f"--load-model={LLM_MODEL}"]
    args.append(f"--exit-timeout-secs={exit_timeout_s}")
    return args + list(server_flags)


def mpirun_args(mpirun: str | Path, sections: list[list[str]], *, export_vars: list[str] = (),
                oversubscribe: bool = False, output_dir: str | Path | None = None) -> list[str]:
    """`mpirun [options] -n 1 SECTION0 : -n 1 SECTION1 : …`."""
    args = [str(mpirun), "--allow-run-as-root", "--noprefix", "--bind-to", "none", *LOOPBACK_ONLY]
    if oversubscribe:
        args.append("--oversubscribe")
    if output_dir is not None:
        args += ["--output-filename", f"{output_dir}:nocopy"]
    for name in export_vars:
        args += ["-x", name]
    for i, section in enumerate(sections):
        args += ([":"] if i else []) + ["-n", "1", *section]
    return args


def launch_args(tritonserver: str | Path, repo: str | Path, world_size: int, endpoints: Endpoints, *,
                mpirun: str | Path = "mpirun", shm_base: str = "prefix", backend_dir: str | Path | None = None,
                exit_timeout_s: int = 5, export_vars: list[str] = (), cpu_count: int = 1,
                output_dir: str | Path | None = None, api_key: str | None = None,
                server_flags: Sequence[str] = ()) -> list[str]:
    """The whole command: tritonserver itself for one rank, mpirun for several."""
    sections = [server_args(tritonserver, repo, rank, endpoints, shm_base=shm_base, backend_dir=backend_dir,
                            exit_timeout_s=exit_timeout_s, api_key=api_key, server_flags=server_flags)
                for rank in range(world_size)]
    if world_size == 1:
        return sections[0]
    return mpirun_args(mpirun, sections, export_vars=export_vars, oversubscribe=world_size > cpu_count,
                       output_dir=output_dir)
