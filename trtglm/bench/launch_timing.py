"""How long `trtglm launch --detach` takes to ready, and what the time goes to.

`timed_launch` runs the launch as a user would (a subprocess of `python -m trtglm launch`),
and meanwhile reads rank 0's log files as they grow (every POLL_S, each new line stamped with
the seconds since the launch began) and asks `/v2/health/ready`. The phases are the gaps
between marker lines, in launch order (MARKERS): the launch command before tritonserver logs
anything (its CLI, the python stubs' environment, the supervisor), Triton until the
tensorrt_llm stub starts, the stub's start and imports, the weights moved to the GPU (the fast
runtime logs "fast model: …" once they are), kernel tuning and compilation with the CUDA graph
capture (until "captured decode graphs …"), the warm-up request, the rest of Triton's loading
(ensemble, endpoints) until /v2/health/ready answers, and launch's own checks until it returns.
The tensorrt_llm model's INFO lines that carry their own durations (`… in 12.34 s`) are kept
as logged: they are exact, where a stamp is within POLL_S plus the log's buffering.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from trtglm.client import NO_PROXY
from trtglm.serve.rank_logs import LogTail

POLL_S = 0.05
ROOT = Path(__file__).resolve().parents[2]

# (key, regex on a log line, the phase that ends at this marker); the first line matching each counts.
MARKERS = (
    ("triton_started", re.compile(r"."), "launch command until tritonserver logs (CLI, stub environment, supervisor)"),
    ("stub_started", re.compile(r"TRITONBACKEND_ModelInstanceInitialize: tensorrt_llm_0"),
     "Triton until the tensorrt_llm stub starts"),
    ("initializing", re.compile(r"tensorrt_llm: initializing"), "stub start and imports (Python, torch, trtglm)"),
    ("loading", re.compile(r"rank 0: loading the model"), "engine folder and device"),
    ("weights", re.compile(r"fast model: "), "weights read and moved to the GPU (the fast runtime)"),
    ("graphs", re.compile(r"captured decode graphs"), "kernel tuning and compilation, CUDA graph capture"),
    ("model_loaded", re.compile(r"rank 0: model loaded in"),
     "the rest of the model's set-up (all of it where no step above is logged)"),
    ("warmed_up", re.compile(r"rank 0: warm-up request in"), "warm-up request"),
    ("tensorrt_llm_loaded", re.compile(r"successfully loaded 'tensorrt_llm'"), "tensorrt_llm's last steps (metrics)"),
)
LOGGED = re.compile(r"trtglm INFO [\w.]+: (.* in \d+\.\d+ s.*)$")


def timed_launch(label: str, repo: Path, ports: dict[str, int], log_dir: Path, env: dict[str, str],
                 timeout: float) -> dict:
    """Launch `repo` detached; the launch's timings (see the module docstring) and output."""
    argv = [sys.executable, "-m", "trtglm", "launch", "--repo", str(repo), "--detach", "--no-openai",
            "--timeout", f"{timeout:g}", "--log-dir", str(log_dir), *(f"--{name}-port={port}" for name, port in ports.items())]
    start = time.monotonic()
    tail, lines = LogTail(log_dir, "ranks/**/rank.0/std*"), []  # lines: (seconds since start, line)
    ready: list[float] = []
    done = threading.Event()

    def read_log() -> None:
        now = time.monotonic() - start
        lines.extend((now, line) for _, line in tail.new_lines())

    def watch() -> None:
        url = f"http://127.0.0.1:{ports['http']}/v2/health/ready"
        while not done.is_set():
            read_log()
            if not ready:
                try:
                    with NO_PROXY.open(url, timeout=1) as reply:
                        if reply.status == 200:
                            ready.append(time.monotonic() - start)
                except OSError:
                    pass
            done.wait(POLL_S)

    watcher = threading.Thread(target=watch, name="launch-watch", daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout + 120)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode, output = None, f"launch did not return within {timeout + 120:g} s: {e}"
    launch_s = time.monotonic() - start
    done.set()
    watcher.join()
    read_log()
    result = {"label": label, "command": " ".join(argv[1:]), "launch_s": round(launch_s, 2),
              "ready_s": round(ready[0], 2) if ready else None, "returncode": returncode,
              "output": output[-4000:]}
    result.update(phases(lines, result["ready_s"], launch_s))
    return result


def phases(lines: list[tuple[float, str]], ready_s: float | None, launch_s: float) -> dict:
    """Marker stamps, the phases between them, and the model's own timed log lines."""
    stamps: dict[str, float] = {}
    for stamp, line in lines:
        for key, pattern, _ in MARKERS:
            if key not in stamps and pattern.search(line):
                stamps[key] = stamp
    ends = [(key, stamps[key], phase) for key, _, phase in MARKERS if key in stamps]
    if ready_s is not None:
        ends.append(("ready", ready_s, "Triton's other models and endpoints until /v2/health/ready"))
    ends.append(("returned", launch_s, "launch's checks until it returns"))
    result, previous = {}, 0.0
    for key, stamp, phase in ends:
        result[phase] = round(max(0.0, stamp - previous), 2)
        previous = max(previous, stamp)
    logged = [m.group(1) for _, line in lines if (m := LOGGED.search(line))]
    return {"marks_s": {key: round(stamp, 2) for key, stamp in stamps.items()}, "phases": result, "logged": logged}


def rank_log(log_dir: Path) -> str:
    """Rank 0's stdout and stderr (the server's log), one after the other."""
    parts = []
    for path in sorted(Path(log_dir).glob("ranks/**/rank.0/std*")):
        parts.append(f"==> {path.name} <==\n{path.read_text(encoding='utf-8', errors='replace')}")
    return "\n".join(parts)
