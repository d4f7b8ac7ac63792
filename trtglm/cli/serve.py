"""`launch`, `stop`, `status`, `logs`, `models`: a supervised tritonserver for a model repository."""

from __future__ import annotations

from typing import Annotated, Literal

from trtglm.cli.flags import CountInt, Env, Passthrough, PosFloat, PosInt
from trtglm.errors import UsageError
from trtglm.ports import LOCAL_URL, OPENAI_PORT
from trtglm.serve.command import EXIT_TIMEOUT_S as DRAIN_S


def launch(repo: str, world_size: PosInt | None = None, replicas: PosInt = 1, gpus: str | None = None,
           front: bool | None = None, replica_ports: PosInt | None = None, tritonserver: str | None = None,
           host: str = "127.0.0.1", http_port: Annotated[PosInt | None, Env("HTTP_PORT")] = None,
           grpc_port: Annotated[PosInt | None, Env("GRPC_PORT")] = None,
           metrics_port: Annotated[PosInt | None, Env("METRICS_PORT")] = None, log_dir: str | None = None,
           detach: bool = False, timeout: PosFloat = 300.0,
           openai_port: Annotated[PosInt, Env("OPENAI_PORT")] = OPENAI_PORT, openai: bool = True,
           drain: PosFloat = DRAIN_S, hosts: str | None = None, hostfile: str | None = None,
           rsh_agent: str | None = None, server_flags: Passthrough = ()):
    """Serve a Triton model repository with tritonserver (mpirun for --world-size > 1) until Ctrl-C.

    --world-size defaults to the engine's tp × pp; --http-port, --grpc-port and --metrics-port to the
    engine profile's serve.*_port (Triton's 8000, 8001, 8002 when it names none); --host binds rank 0's endpoints
    and the OpenAI API (loopback by default); --detach returns once ready (stop with `trtglm stop`); --timeout:
    seconds to wait for readiness; --openai-port: the OpenAI-compatible API's port (--no-openai:
    none); --drain: seconds an orderly stop (Ctrl-C, SIGTERM, `trtglm stop`) lets requests in flight finish, the
    OpenAI API's and then Triton's. --replicas N runs N copies of the model, each on --world-size GPUs of its own
    (--gpus 0,1,…: which, in order; default the visible ones), behind a proxy (Envoy) on those ports; --front puts
    the proxy in front of one replica too. Each replica's own ports are the block --replica-ports + 4·i (default
    --http-port + 100). --hosts a,b:2 or --hostfile F (Open MPI's: HOST slots=N a line): one replica's ranks on
    those hosts' slots, in order, the first host being this one, reached with mpirun's remote shell (ssh, or
    --rsh-agent CMD). Words after `--` are passed on to every rank's tritonserver.
    """
    from trtglm.serve.launch import launch as run

    run(repo, world_size=world_size, tritonserver=tritonserver, host=host, http_port=http_port,
        grpc_port=grpc_port, metrics_port=metrics_port, log_dir=log_dir, detach=detach, timeout=timeout,
        server_flags=list(server_flags), openai_port=openai_port, openai=openai, replicas=replicas, front=front,
        gpus=_gpu_list(gpus), replica_ports=replica_ports, drain=drain, hosts=hosts, hostfile=hostfile,
        rsh_agent=rsh_agent)


def _gpu_list(gpus: str | None) -> list[str] | None:
    if gpus is None:
        return None
    entries = [entry.strip() for entry in str(gpus).split(",")]
    if not all(entries):
        raise UsageError(f"--gpus must be GPU ids separated by commas (0,1,2,3), not {gpus!r}")
    return entries


def stop(repo: str | None = None):
    """Stop a launch (default: the only one running) and everything it started."""
    from trtglm.serve.launch import stop as run

    run(repo)


def status(json: bool = False):
    """Launched servers: repository, state, supervisor pid, ports, whether it answers ready, and each replica
    (GPUs, state, ports, restarts); --json prints the same as a JSON list."""
    from trtglm.serve.status import launch_rows

    rows = launch_rows()
    if json:
        import json as json_text

        print(json_text.dumps(rows, indent=2))
        return
    if not rows:
        print("no launches")
    for row in rows:
        print(f"{row['repo']}\t{row['state']}\tpid {row['pid']}\t{_ports(row['ports'])}\t"
              f"{'ready' if row['ready'] else 'not ready'}")
        for replica in row["replicas"] if len(row["replicas"]) > 1 or row.get("front") else ():
            gpus = ",".join(replica["gpus"]) if replica["gpus"] is not None else "-"
            reason = f"\t{replica['reason']}" if replica.get("reason") and replica["state"] != "ready" else ""
            print(f"  replica {replica['index']}\tgpus {gpus}\t{replica['state']}\t{_ports(replica['ports'])}\t"
                  f"restarts {replica['restarts']}{reason}")


def _ports(ports: dict[str, int]) -> str:
    return " ".join(f"{name}={port}" for name, port in ports.items())


def logs(repo: str | None = None, replica: CountInt | None = None, rank: CountInt = 0, lines: PosInt = 40):
    """The last --lines lines of a launched server's logs: one rank's stdout and stderr (of one --replica of a
    launch of several), the supervisor's, the OpenAI API's, the front's."""
    from trtglm.serve.status import log_tails, recorded_launch

    for path, tail in log_tails(recorded_launch(repo), rank, lines, replica):
        print(f"==> {path} <==", *tail, sep="\n")


def models(action: Literal["load", "unload", "list"], name: str | None = None, url: str = LOCAL_URL):
    """Triton's repository API: `models load NAME`, `models unload NAME`, `models list`."""
    from trtglm.serve.control import models as run

    index = run(action, name, url=url)
    for entry in index or ():
        print(f"{entry.get('name')}\t{entry.get('version', '-')}\t{entry.get('state', '-')}\t{entry.get('reason', '')}"
              .rstrip())
