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
  settings (which write files) are restricted (`restricted_args`: `--http-restricted-api`,
  `--grpc-restricted-protocol`). Those flags hold the secret, so they are never on a command line:
  they reach tritonserver through its environment (preload.py);
- `--backend-directory` when the python backend lives outside /opt/tritonserver;
- `--exit-timeout-secs` bounds how long a SIGTERM'd server waits for in-flight requests;
- mpirun talks to its ranks over loopback (MPI_LOOPBACK: Open MPI 4's and 5's flags differ; its listeners
  are held to loopback by preload.py), as do the ranks' torch.distributed sockets (GLOO_SOCKET_IFNAME,
  NCCL_SOCKET_IFNAME); NCCL runs with
  NVLink multicast off (conventions.MULTICAST_OFF: NCCL's and PyTorch's symmetric memory's) unless the
  environment says otherwise;
- mpirun runs with `--noprefix` (Open MPI started by absolute path would otherwise put its
  own bin/ first on the ranks' PATH, so the python stubs would find the system python3),
  `--bind-to none` (Open MPI would pin each rank to one core, starving a CPU engine),
  `--oversubscribe` when there are more ranks than cores, `-x VAR` for the environment the
  python stubs need, and per-rank logs in DIR/JOB/rank.N/stdout and stderr (MPI_OUTPUT).

A world size of 1 runs tritonserver directly: no mpirun needed, same flags as rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trtglm.backend.contract import TENSORRT_LLM

LLM_MODEL = TENSORRT_LLM  # the one model ranks > 0 load
API_KEY_HEADER = "trtglm-api-key"
# The ranks share one host: Open MPI's bootstrap and MPI transports use loopback alone, by major version.
# Open MPI 5's runtime (PRRTE) refuses loopback as its bootstrap network ("No network interfaces were found
# for out-of-band communications"); its bootstrap listeners are held to loopback by preload.py instead.
MPI_LOOPBACK = {4: ("--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"),
                5: ("--mca", "btl_tcp_if_include", "lo")}
# Per-rank logs in DIR/JOB/rank.N/{stdout,stderr}, not copied to mpirun's own output, by major version.
MPI_OUTPUT = {4: ("--output-filename", "{dir}:nocopy"), 5: ("--output", "dir={dir}")}
# How trtglm runs mpirun: as root too (containers), without Open MPI's prefix on the ranks' PATH, unpinned.
MPIRUN_OPTIONS = ("--allow-run-as-root", "--noprefix", "--bind-to", "none")
EXIT_TIMEOUT_S = 5  # tritonserver's own wait for in-flight requests, unless `launch --drain` says (< the grace)
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")


@dataclass(frozen=True)
class Endpoints:
    """Where rank 0 listens, and the OpenAI-compatible API (None: not served). The metrics port binds to
    `metrics_host` where one is given: a replica behind the front keeps its other ports on loopback."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int | None = None
    metrics_host: str | None = None

    def ports(self) -> dict[str, int]:
        ports = {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}
        return ports if self.openai_port is None else {**ports, "openai": self.openai_port}

    def bind_host(self, port_name: str) -> str:
        """The address the port named `port_name` (a key of `ports()`) binds to."""
        return self.metrics_host if port_name == "metrics" and self.metrics_host is not None else self.host

    def urls(self) -> dict[str, str]:
        """Client addresses; a wildcard bind address is reached through loopback."""
        host = client_host(self.host)
        urls = {"http": f"http://{host}:{self.http_port}", "grpc": f"{host}:{self.grpc_port}",
                "metrics": f"http://{client_host(self.bind_host('metrics'))}:{self.metrics_port}/metrics"}
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
                exit_timeout_s: int = EXIT_TIMEOUT_S, server_flags: Sequence[str] = ()) -> list[str]:
    """One rank's tritonserver command line (`server_flags`: the user's own, last)."""
    args = [str(tritonserver), f"--model-repository={repo}", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix(shm_base, rank)}"]
    if backend_dir is not None:
        args.append(f"--backend-directory={backend_dir}")
    if rank == 0:
        args += [f"--http-address={endpoints.host}", f"--http-port={endpoints.http_port}",
                 f"--grpc-address={endpoints.host}", f"--grpc-port={endpoints.grpc_port}",
                 f"--metrics-address={endpoints.bind_host('metrics')}", f"--metrics-port={endpoints.metrics_port}",
                 "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
                 "--model-control-mode=explicit", "--load-model=*"]
    else:
        args += ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
                 "--model-control-mode=explicit", f"--load-model={LLM_MODEL}"]
    args.append(f"--exit-timeout-secs={exit_timeout_s}")
    return args + list(server_flags)


def restricted_args(api_key: str) -> list[str]:
    """The flags that open rank 0's restricted APIs to requests carrying `api_key` (secret: never on a command
    line; preload.py passes them)."""
    restricted = f"{','.join(RESTRICTED_APIS)}:{API_KEY_HEADER}={api_key}"
    return [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


def mpi_major(version_text: str) -> int:
    """Open MPI's major version from `mpirun --version` ("mpirun (Open MPI) 5.0.11"); ValueError for another MPI
    or a version without a table entry."""
    match = re.search(r"\(Open MPI\) (\d+)\.", version_text)
    if match is None:
        raise ValueError(f"not Open MPI: {version_text.strip().splitlines()[:1]}")
    major = int(match.group(1))
    if major not in MPI_LOOPBACK:
        raise ValueError(f"Open MPI {major} is not supported (known: {', '.join(map(str, sorted(MPI_LOOPBACK)))})")
    return major


def mpirun_args(mpirun: str | Path, sections: list[list[str]], *, mpi_version: int = 4, export_vars: list[str] = (),
                oversubscribe: bool = False, output_dir: str | Path | None = None,
                host_args: Sequence[str] = ()) -> list[str]:
    """`mpirun [options] -n 1 SECTION0 : -n 1 SECTION1 : …` for Open MPI `mpi_version` (a major version); with
    `host_args` (hosts.py) the ranks run on those hosts and talk over their networks, not over loopback."""
    args = [str(mpirun), *MPIRUN_OPTIONS, *(host_args or MPI_LOOPBACK[mpi_version])]
    if oversubscribe:
        args.append("--oversubscribe")
    if output_dir is not None:
        args += [arg.format(dir=output_dir) for arg in MPI_OUTPUT[mpi_version]]
    for name in export_vars:
        args += ["-x", name]
    for i, section in enumerate(sections):
        args += ([":"] if i else []) + ["-n", "1", *section]
    return args


def launch_args(tritonserver: str | Path, repo: str | Path, world_size: int, endpoints: Endpoints, *,
                mpirun: str | Path = "mpirun", mpi_version: int = 4, shm_base: str = "prefix",
                backend_dir: str | Path | None = None, exit_timeout_s: int = EXIT_TIMEOUT_S,
                export_vars: list[str] = (),
                cpu_count: int = 1, output_dir: str | Path | None = None,
                server_flags: Sequence[str] = (), host_args: Sequence[str] = (),
                rank_prefix: Sequence[str] = ()) -> list[str]:
    """The whole command: tritonserver itself for one rank, mpirun for several (on the hosts of `host_args`, each
    rank's command after `rank_prefix`: hosts.py)."""
    sections = [[*rank_prefix, *server_args(tritonserver, repo, rank, endpoints, shm_base=shm_base,
                                            backend_dir=backend_dir, exit_timeout_s=exit_timeout_s,
                                            server_flags=server_flags)]
                for rank in range(world_size)]
    if world_size == 1:
        return sections[0]
    return mpirun_args(mpirun, sections, mpi_version=mpi_version, export_vars=export_vars,
                       oversubscribe=world_size > cpu_count and not host_args, output_dir=output_dir,
                       host_args=host_args)
