"""The served benchmark from nothing, in one command: model → engine → repository → launches → measurements.

    python3 -m trtglm.bench.pipeline --out DEST [--synth 6b | --model-dir HF] [--tokenizer-dir DIR]
        [--config configs/chatglm3-6b-bf16-tp1.yaml] [--set build.engine=torch ...] [--work-dir DIR]
        [--launches 2] [--keep-caches] [--deadline SECONDS] [-- FLAGS OF `trtglm bench served`]

Steps, each timed (`steps` in served.json):

1. `trtglm synth-model --preset P` (random weights; the tokenizer of --tokenizer-dir is copied
   beside them, since synth writes none), unless --model-dir names a model; a synth folder
   left by an earlier run of the same preset is reused;
2. `trtglm build-engine --config C --model-dir HF --set build.engine=torch` (plus --set);
3. `trtglm patch-repo` (with --tokenizer-dir when given);
4. `trtglm launch --detach` on free loopback ports, timed with its phases (launch_timing.py),
   with empty caches (TRITON_CACHE_DIR and XDG_CACHE_HOME under the work folder: no Triton kernel
   compiled, no kernel tuning stored, no python-stub environment prepared): the cold launch
   (--keep-caches keeps an earlier run's: a warm first launch);
5. `trtglm bench served` against it in this process (served.py: overhead, fixed and mixed
   workloads over HTTP SSE and gRPC, each next to its in-process run), on the CPUs the launch
   left to the server (trtglm.backend.cpus: a client runs off the engine's core, as clients on
   other machines do);
6. `trtglm stop`; then, with --launches 2, a second launch (those caches now filled) timed the
   same way, and `trtglm stop`.

Every result lands in DEST: served.json (everything), served.md (the tables, also printed
last), server-cold.log and server-warm.log (rank 0's log of each launch). --deadline: no
measurement starts once that many seconds have passed since the start, less the time kept for
the stops and a second launch as long as the first (a GPU call has a hard limit); the second
launch is skipped when it would not fit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from trtglm.backend.cpus import engine_cpus_env
from trtglm.bench import launch_timing, served, served_report
from trtglm.bench.served_flags import SERVED_FLAGS
from trtglm.chatglm.variants import VARIANTS
from trtglm.engine.build import TOKENIZER_FILES
from trtglm.serve.checks import resolve_world_size

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
PORT_RANGE = (19000, 20000)
SYNTH_DONE = ".trtglm-synth-done"


def free_ports(count: int = 3, low: int = PORT_RANGE[0], high: int = PORT_RANGE[1]) -> list[int]:
    """`count` loopback ports in [low, high) that are free now (picked from a per-process offset)."""
    ports, candidate = [], low + (os.getpid() * 7) % (high - low)
    for _ in range(high - low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
                ports.append(candidate)
            except OSError:
                pass
        if len(ports) == count:
            return ports
        candidate = low + (candidate + 1 - low) % (high - low)
    raise RuntimeError(f"no {count} free ports in {low}-{high - 1}")


class Pipeline:
    def __init__(self, options: argparse.Namespace):
        self.o = options
        self.start = time.monotonic()
        self.out = Path(options.out).resolve()
        self.work = Path(options.work_dir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        # Caches a first launch fills: Triton's compiled kernels, and under XDG_CACHE_HOME the python stubs'
        # environment (trtglm/serve/stub_python.py) and the fast runtime's kernel tuning.
        self.caches = {"TRITON_CACHE_DIR": self.work / "triton-cache", "XDG_CACHE_HOME": self.work / "cache"}
        self.env = {**os.environ, "TRTGLM_STATE_DIR": str(self.work / "state"), "PYTHONUNBUFFERED": "1",
                    **{name: str(path) for name, path in self.caches.items()}}
        os.environ.update({name: str(path) for name, path in self.caches.items()})  # the in-process engine too
        self.results: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                              "pipeline": " ".join(sys.argv), "steps": {}, "launches": []}
        self.repo = self.work / "repo"

    # --- helpers -------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def trtglm(self, step: str, *args: str, timeout: float = 900) -> None:
        """Run `trtglm ARGS` (its output shown as it comes), timed as `step`; RuntimeError when it fails."""
        print(f"\n=== {step}: trtglm {' '.join(args)}", flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "trtglm", *args], cwd=ROOT, env=self.env, timeout=timeout)
        self.results["steps"][step] = round(time.monotonic() - started, 2)
        if done.returncode != 0:
            raise RuntimeError(f"trtglm {args[0]} exited {done.returncode}")

    def save(self) -> None:
        (self.out / "served.json").write_text(json.dumps(self.results, indent=2, ensure_ascii=False) + "\n")
        (self.out / "served.md").write_text(served_report.markdown(self.results))

    # --- steps -------------------------------------------------------------------------------------------------

    def model_dir(self) -> Path:
        if self.o.model_dir:
            return Path(self.o.model_dir).resolve()
        hf = self.work / f"hf-{self.o.synth}"
        marker = hf / SYNTH_DONE
        if marker.is_file() and marker.read_text() == self.synth_key():
            print(f"\n=== synth-model: reusing {hf}", flush=True)
            self.results["steps"]["synth-model (reused)"] = 0.0
        else:
            layers = ["--layers", str(self.o.synth_layers)] if self.o.synth_layers else []
            self.trtglm("synth-model", "synth-model", "--preset", self.o.synth, "--out", str(hf), "--dtype",
                        self.o.synth_dtype, *layers, "--force")
            marker.write_text(self.synth_key())
        if self.o.tokenizer_dir:
            for name in TOKENIZER_FILES:
                source = Path(self.o.tokenizer_dir) / name
                if source.is_file():
                    (hf / name).unlink(missing_ok=True)  # a read-only copy from an earlier run
                    shutil.copy(source, hf / name)
        if not (hf / "tokenizer.model").is_file():
            raise RuntimeError(f"{hf} has no tokenizer.model: give --tokenizer-dir (synth-model writes none)")
        return hf

    def synth_key(self) -> str:
        return f"{self.o.synth} {self.o.synth_dtype} {self.o.synth_layers or 'all'} layers"

    def launch(self, label: str) -> dict:
        log_dir = self.work / f"logs-{label}"
        shutil.rmtree(log_dir, ignore_errors=True)
        ports = dict(zip(("http", "grpc", "metrics"), free_ports()))
        print(f"\n=== launch ({label}) on ports {ports}", flush=True)
        result = launch_timing.timed_launch(label, self.repo, ports, log_dir, self.env, self.o.launch_timeout)
        result["ports"] = ports
        self.results["launches"].append(result)
        self.results["steps"][f"launch ({label})"] = result["launch_s"]
        self.save_server_log(label)
        print(launch_timing_text(result), flush=True)
        self.save()
        if result["returncode"] != 0:
            raise RuntimeError(f"launch ({label}) failed:\n{result['output']}")
        self.keep_off_engine_cores()
        return result

    def keep_off_engine_cores(self) -> None:
        """Run the clients (and the in-process runs) off the cores the launch gave its engine, as clients on other
        machines would be: the launch's plan, made from the same CPUs (trtglm.backend.cpus)."""
        if "client_cpus" in self.results:
            return  # a later launch plans from this process's CPUs, already without the engine's
        _, server_cpus = engine_cpus_env(resolve_world_size(self.repo, None), self.env)
        if server_cpus:
            os.sched_setaffinity(0, server_cpus)
            self.results["client_cpus"] = sorted(server_cpus)

    def save_server_log(self, label: str) -> None:
        """Rank 0's log of launch `label` as it is now, in DEST/server-LABEL.log."""
        (self.out / f"server-{label}.log").write_text(launch_timing.rank_log(self.work / f"logs-{label}"))

    def stop(self, label: str) -> None:
        try:
            self.trtglm(f"stop ({label})", "stop", "--repo", str(self.repo), timeout=180)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            self.results.setdefault("errors", []).append(f"stop ({label}): {e}")

    def measure(self, ports: dict[str, int], launch_s: float) -> None:
        print("\n=== bench served", flush=True)
        started = time.monotonic()
        flags = served_flags(self.o.served)
        if self.o.deadline:  # time kept for the stop and a second launch like the first
            reserve = 20.0 + (launch_s + 30.0 if self.o.launches >= 2 else 0.0)
            flags["stop_after"] = max(1.0, self.o.deadline - self.elapsed() - reserve)
        extra = {key: self.results[key] for key in ("pipeline", "steps", "launches")}  # the same objects, kept current
        try:
            results = served.run(url=f"http://127.0.0.1:{ports['http']}", grpc=f"127.0.0.1:{ports['grpc']}",
                                 metrics_url=f"http://127.0.0.1:{ports['metrics']}/metrics", out=str(self.out),
                                 extra=extra, quiet=True, **flags)
            self.results.update({k: v for k, v in results.items() if k not in ("date",)})
        except Exception as e:  # the server is stopped and the launches reported all the same
            log.exception("bench served failed")
            self.results.setdefault("errors", []).append(f"bench served: {type(e).__name__}: {e}")
        self.results["steps"]["bench served"] = round(time.monotonic() - started, 2)
        self.save()

    def run(self) -> int:
        status = 0
        try:
            hf = self.model_dir()
            engine = self.work / "engine"
            sets = [arg for value in self.o.set for arg in ("--set", value)]
            self.trtglm("build-engine", "build-engine", "--config", self.o.config, "--model-dir", str(hf),
                        "--output-dir", str(engine), "--force", *sets)
            tokenizer = ["--tokenizer-dir", str(Path(self.o.tokenizer_dir).resolve())] if self.o.tokenizer_dir else []
            self.trtglm("patch-repo", "patch-repo", "--engine-dir", str(engine), "--output-repo", str(self.repo),
                        "--force", *tokenizer)
            if not self.o.keep_caches:  # a cold launch: nothing compiled, tuned or prepared yet
                for path in self.caches.values():
                    shutil.rmtree(path, ignore_errors=True)
            cold = self.launch("cold")
            try:
                self.measure(cold["ports"], cold["launch_s"])
            finally:
                self.save_server_log("cold")
                self.stop("cold")
            if self.o.launches >= 2:
                if self.o.deadline and self.elapsed() + cold["launch_s"] + 30 > self.o.deadline:
                    self.results.setdefault("errors", []).append(
                        f"warm launch skipped: {self.elapsed():.0f} s gone of --deadline {self.o.deadline:g}")
                else:
                    try:
                        self.launch("warm")
                    finally:
                        self.stop("warm")
        except Exception as e:
            log.error("%s", e)
            self.results.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
            status = 1
        self.results["steps"]["total"] = round(self.elapsed(), 2)
        self.save()
        print("\n" + served_report.markdown(self.results), end="", flush=True)
        if self.results.get("errors"):
            print("\nErrors: " + " | ".join(self.results["errors"]), flush=True)
        return status


def launch_timing_text(result: dict) -> str:
    lines = [f"launch ({result['label']}): returned after {result['launch_s']} s (exit {result['returncode']}), "
             f"ready after {result['ready_s']} s"]
    lines += [f"  {seconds:8.2f} s  {phase}" for phase, seconds in result["phases"].items()]
    lines += [f"  logged: {line}" for line in result["logged"]]
    return "\n".join(lines)


def served_flags(args: list[str]) -> dict:
    """`--name value` / `--name=value` pairs (after --) as keyword arguments of served.run, the flags left out
    with their defaults."""
    known = asdict(SERVED_FLAGS)
    flags, i = {}, 0
    while i < len(args):
        name, has_value, value = args[i].removeprefix("--").partition("=")
        if not has_value:
            i += 1
            value = args[i] if i < len(args) else ""
        key = name.replace("-", "_")
        if key not in known:
            raise SystemExit(f"pipeline: unknown `bench served` flag --{name} (known: {', '.join(sorted(known))})")
        default = known[key]
        flags[key] = type(default)(value) if isinstance(default, (int, float)) and not isinstance(default, bool) \
            else value
        i += 1
    return {**known, **flags}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m trtglm.bench.pipeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--config", default=f"configs/{VARIANTS['chatglm3-6b'].profile}.yaml")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synth", help="synth-model preset (random weights), e.g. 6b")
    source.add_argument("--model-dir", help="an HF model folder")
    parser.add_argument("--synth-dtype", default="bfloat16")
    parser.add_argument("--synth-layers", type=int, help="fewer layers than the preset's (a quick check)")
    parser.add_argument("--tokenizer-dir", help="tokenizer for the synth model and the repository")
    parser.add_argument("--set", action="append", default=[], help="profile override (build.engine=torch is added)")
    parser.add_argument("--work-dir", default="/tmp/trtglm-served")
    parser.add_argument("--launches", type=int, default=2, choices=(1, 2))
    parser.add_argument("--keep-caches", action="store_true",
                        help="keep the kernel and tuning caches of an earlier run (the first launch is then warm)")
    parser.add_argument("--launch-timeout", type=float, default=480.0)
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds after which no new measurement starts (0: none)")
    parser.add_argument("served", nargs=argparse.REMAINDER, help="-- then flags of `trtglm bench served`")
    options = parser.parse_args(argv)
    options.served = [a for a in options.served if a != "--"]
    if not any(s.startswith("build.engine=") for s in options.set):
        options.set.append("build.engine=torch")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(Pipeline(options).run())


if __name__ == "__main__":
    main()
