"""The `launch`, `stop` and `models` subcommands as fire functions."""

from __future__ import annotations


def launch(repo: str, world_size: int | None = None, tritonserver: str | None = None, host: str = "127.0.0.1",
           http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002, log_dir: str | None = None,
           detach: bool = False, timeout: float = 300.0):
    """Serve a Triton model repository with tritonserver (mpirun for --world-size > 1) until Ctrl-C.

    --world-size defaults to the engine's tp × pp; --host binds rank 0's endpoints (loopback by
    default); --detach returns once ready (stop with `trtglm stop`); --timeout: seconds to wait
    for readiness.
    """
    from trtglm.serve.launch import launch as run

    run(repo, world_size=world_size, tritonserver=tritonserver, host=host, http_port=http_port,
        grpc_port=grpc_port, metrics_port=metrics_port, log_dir=log_dir, detach=detach, timeout=timeout)


def stop(repo: str | None = None):
    """Stop a launch (default: the only one running) and everything it started."""
    from trtglm.serve.launch import stop as run

    run(repo)


def models(action: str, name: str | None = None, url: str = "http://127.0.0.1:8000"):
    """Triton's repository API: `models load NAME`, `models unload NAME`, `models list`."""
    from trtglm.serve.control import models as run

    index = run(action, name, url=url)
    for entry in index or ():
        print(f"{entry.get('name')}\t{entry.get('version', '-')}\t{entry.get('state', '-')}\t{entry.get('reason', '')}"
              .rstrip())

