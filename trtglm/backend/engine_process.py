"""The engine in a process of its own, beside the `tensorrt_llm` model's python stub.

Building and sending a python-backend response takes the stub's GIL, and 64 streams send
thousands of responses a second: with the executor's step loop in the same interpreter, a 7 ms
decode step became a 13 ms one on an H100 (docs/benchmarks.md). So the stub starts
`python -m trtglm.backend.engine_process`, which loads the engine (`ServedEngine`) and runs its step
loop under a GIL of its own; the stub only parses requests and sends responses.

`EngineProcess` (in the stub) takes the executor's calls: `submit` checks a request against the
engine's limits and counts it against the queue at once (so a bad or refused request fails
synchronously, as with an executor in the same process), `stats` gives the engine's latest
counters, `stop` ends the process. Outputs come back batched: the engine's step thread sends what
its step gave as one message when the step ends (no thread hand-over, no second thread taking the
GIL from the steps), and the stub's reader thread hands each output to its request's callback.
A cancelled request (its `is_cancelled`, asked every CANCEL_CHECK_S, or a callback that raises:
the client is gone) is cancelled in the engine too.

The two ends talk over a socket pair private to them (pickled tuples; both ends are trtglm's own):

    stub → engine: ("submit", id, Request)  ("cancel", id)  ("stop",)
    engine → stub: ("ready", EngineFacts, ExecutorStats) or ("failed", exception class, message), once;
                   then ("outputs", [(id, Output), …], ExecutorStats)

The engine process ends when the stub asks, or when the stub is gone (end of file). When the
engine process dies, every request in flight ends with an error and `on_death` is called (the
model's stub exits, and the launch's supervisor, seeing it dead, stops the launch: serve/stubs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from trtglm.backend.cpus import pin_engine
from trtglm.errors import TrtglmError, UsageError
from trtglm.conventions import FREE_GPU_MEM_FRACTION
from trtglm.runtime.executor import (CANCEL_CHECK_S, ExecutorStats, ExecutorStopped, Handle, Output,
                                     OutputCallback, QueueFullError, Request, check_request)

log = logging.getLogger(__name__)

ERRORS = {cls.__name__: cls for cls in (UsageError, QueueFullError, ExecutorStopped, TrtglmError)}
STOP_TIMEOUT_S = 10.0  # the engine's own close allows 5 s for followers and process groups


@dataclass(frozen=True)
class EngineFacts:
    """What the stub needs to know of the engine: whether this rank takes requests, and its limits."""

    rank: int
    takes_requests: bool
    vocab_size: int
    max_seq_len: int
    capacity: int  # requests the executor holds at once: its slots plus its queue
    max_beam_width: int = 1


# --- the wire ------------------------------------------------------------------------------------------


class MessagePipe:
    """One end of the socket pair: whole pickled messages, sent by any thread, one at a time."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.connection.send_bytes(data)

    def receive(self) -> tuple:
        return pickle.loads(self.connection.recv_bytes())


def portable(request: Request) -> Request:
    """`request` with its bias as a numpy array (a torch tensor would be pickled through shared memory)."""
    if request.embedding_bias is None or isinstance(request.embedding_bias, np.ndarray):
        return request
    return dataclasses.replace(request, embedding_bias=request.embedding_bias.numpy())


def unpacked(request: Request) -> Request:
    if isinstance(request.embedding_bias, np.ndarray):
        return dataclasses.replace(request, embedding_bias=torch.from_numpy(request.embedding_bias))
    return request


# --- the stub's side -------------------------------------------------------------------------------------


@dataclass
class _Live:
    handle: Handle
    on_output: OutputCallback
    is_cancelled: Callable[[], bool] | None
    cancel_sent: bool = False
    # Set, under `lock`, before the final output is handed on: once a request's final response is sent, Triton
    # frees it, and asking it `is_cancelled` then crashes the server. So the watcher asks only under `lock`.
    finished: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def ask_cancelled(self) -> bool:
        with self.lock:
            if self.finished or self.cancel_sent:
                return False
            try:
                return bool(self.is_cancelled())
            except Exception:
                return True  # the request is gone from Triton

    def mark_finished(self) -> None:
        with self.lock:
            self.finished = True


class EngineProcess:
    """The engine's process, seen from the stub: the executor's calls, answered by that process."""

    def __init__(self, process: subprocess.Popen, wire: MessagePipe, limits: EngineFacts,
                 on_death: Callable[[str], None] | None = None, stats: ExecutorStats | None = None):
        self.process, self.wire, self.limits, self.on_death = process, wire, limits, on_death
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._next_id = 0
        self._stats = stats or ExecutorStats()  # the engine's at start: the KV cache's size before any request
        self._closing = False
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="trtglm-engine-reader", daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch_cancels, name="trtglm-cancel-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, engine_dir: str, max_queue: int | None = None, kv_cache_reuse: bool = False,
              kv_fraction: float = FREE_GPU_MEM_FRACTION,
              on_death: Callable[[str], None] | None = None) -> EngineProcess:
        """Start the engine's process and wait until it is ready (its load error raised here, as one line)."""
        ours, theirs = socket.socketpair()
        argv = [engine_python(), "-m", __name__, "--fd", str(theirs.fileno()), "--engine-dir", str(engine_dir)]
        if max_queue:
            argv += ["--max-queue", str(max_queue)]
        if kv_cache_reuse:
            argv.append("--kv-cache-reuse")
        argv += ["--kv-fraction", str(kv_fraction)]
        log.info("starting the engine's process: %s", " ".join(argv))
        with theirs:
            process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        wire = MessagePipe(Connection(ours.detach()))
        try:
            message = wire.receive()
        except (EOFError, OSError):
            code = process.wait()
            raise TrtglmError(f"the engine's process exited with code {code} while loading (its log is above)") \
                from None
        if message[0] == "failed":
            process.wait()
            raise ERRORS.get(message[1], TrtglmError)(message[2])
        return cls(process, wire, message[1], on_death, message[2])

    # --- the executor's calls ---------------------------------------------------------------------

    def submit(self, request: Request, on_output: OutputCallback,
               is_cancelled: Callable[[], bool] | None = None) -> Handle:
        check_request(request, self.limits.vocab_size, self.limits.max_seq_len, self.limits.max_beam_width)
        with self._lock:
            if self._dead or self._closing:
                raise ExecutorStopped(self._dead or "the executor is stopping")
            if len(self._live) >= self.limits.capacity:
                raise QueueFullError(f"busy: {len(self._live)} requests are already being served or waiting "
                                     "(the queue is full); retry later")
            number, self._next_id = self._next_id, self._next_id + 1
            handle = Handle(number)
            self._live[number] = _Live(handle, on_output, is_cancelled)
        try:
            self.wire.send(("submit", number, portable(request)))
        except OSError as e:
            self._forget(number)
            raise ExecutorStopped(f"the engine's process is gone ({e})") from None
        return handle

    def stats(self) -> ExecutorStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the engine's process to end (its requests end with errors); kill it if it does not."""
        with self._lock:
            self._closing = True
        try:
            self.wire.send(("stop",))
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine's process did not end within %.0f s; killing it", timeout)
            self.process.kill()
            self.process.wait()
        self._reader.join(2.0)
        self._fail_all("the server is shutting down")

    # --- outputs and cancellations ----------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                kind, outputs, stats = self.wire.receive()
            except (EOFError, OSError):
                break
            with self._lock:
                self._stats = stats
            for number, output in outputs:
                self._deliver(number, output)
        self._died()

    def _deliver(self, number: int, output: Output) -> None:
        with self._lock:
            live = self._live.get(number)
        if live is None:
            return
        finished = output.finished
        if finished:
            live.mark_finished()
        try:
            live.on_output(output)
        except Exception as e:
            log.warning("request %d: could not deliver its output (%s); stopping it", number, e)
            self._cancel(number, live)
            finished = True
        if finished:
            self._forget(number)

    def _forget(self, number: int) -> None:
        with self._lock:
            live = self._live.pop(number, None)
        if live is not None:
            live.handle.done.set()

    def _cancel(self, number: int, live: _Live) -> None:
        if live.cancel_sent:
            return
        live.cancel_sent = True
        try:
            self.wire.send(("cancel", number))
        except OSError:
            pass

    def _watch_cancels(self) -> None:
        while self.process.poll() is None and not self._dead:
            time.sleep(CANCEL_CHECK_S)
            with self._lock:
                watched = [(n, live) for n, live in self._live.items() if live.is_cancelled and not live.cancel_sent]
            for number, live in watched:
                if live.ask_cancelled():
                    self._cancel(number, live)

    def _died(self) -> None:
        code = self.process.wait()
        with self._lock:
            closing = self._closing
            self._dead = f"the engine's process ended (exit code {code})"
        if closing:
            return
        log.error("%s while serving; its log is above", self._dead)
        self._fail_all(self._dead)
        if self.on_death is not None:
            self.on_death(self._dead)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            lives = list(self._live.items())
        for number, live in lives:
            live.mark_finished()
            try:
                live.on_output(Output([], finished=True, reason="error", error=message))
            except Exception:
                pass
            self._forget(number)


def engine_python() -> str:
    """The interpreter for the engine's process: the stub's own when it is one, else the `python3` on PATH
    (launch puts the stubs' environment first there)."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    found = os.environ.get("TRTGLM_ENGINE_PYTHON") or shutil.which("python3")
    if not found:
        raise TrtglmError("no python3 on PATH to run the engine's process in (set TRTGLM_ENGINE_PYTHON)")
    return found


# --- the engine's side -----------------------------------------------------------------------------------


class EngineHost:
    """Runs in the engine's process: submits what the stub sends, sends back what the executor gives."""

    def __init__(self, engine, wire: MessagePipe):
        self.engine, self.wire, self.executor = engine, wire, engine.executor
        self._lock = threading.Lock()
        if self.executor is not None:
            self.executor.on_step_end = self.flush
            # The stub counts requests against the capacity (slots plus queue) as it submits them, before this
            # process sees them; the executor's own bound (on its queue alone) must not refuse what it admitted.
            self.capacity = self.executor.scheduler.max_queue + engine.engine.max_batch_size
            self.executor.scheduler.max_queue = self.capacity
        self._outgoing: list[tuple[int, Output]] = []
        self._cancelled: set[int] = set()

    def limits(self) -> EngineFacts:
        engine = self.engine
        capacity = self.capacity if self.executor else 0
        return EngineFacts(engine.info.rank, self.executor is not None, engine.model.vocab_size,
                           engine.engine.max_seq_len, capacity, engine.engine.max_beam_width)

    def stats(self) -> ExecutorStats:
        return self.executor.stats() if self.executor else ExecutorStats()

    def serve(self) -> None:
        """Take messages until the stub says stop or is gone; then close the engine."""
        while True:
            try:
                message = self.wire.receive()
            except (EOFError, OSError):
                log.info("the model's stub is gone; stopping the engine")
                break
            if message[0] == "stop":
                break
            if message[0] == "submit":
                self._submit(message[1], unpacked(message[2]))
            elif message[0] == "cancel":
                self._cancelled.add(message[1])
        self.engine.close()
        self.flush()  # the requests that the close ended

    def _submit(self, number: int, request: Request) -> None:
        if self.executor is None:
            self._queue_output(number, Output([], finished=True, reason="error",
                                              error=f"rank {self.engine.info.rank} takes no requests"))
            self.flush()
            return
        try:
            self.executor.submit(request, lambda output: self._queue_output(number, output),
                                 lambda: number in self._cancelled)
        except Exception as e:
            self._queue_output(number, Output([], finished=True, reason="error", error=str(e)))
            self.flush()

    def _queue_output(self, number: int, output: Output) -> None:
        with self._lock:
            self._outgoing.append((number, output))
        if output.finished:
            self._cancelled.discard(number)

    def flush(self) -> None:
        """Send what piled up, with the counters (at the end of a step that gave outputs, on its thread; or after
        a refusal). A step that gave none sends nothing: the stub would only unpickle the counters."""
        with self._lock:
            outputs, self._outgoing = self._outgoing, []
        if not outputs:
            return
        stats = self.stats()
        try:
            self.wire.send(("outputs", outputs, stats))
        except OSError:
            pass  # the stub is gone; the reader sees it and stops the engine


def main(argv: list[str] | None = None) -> int:
    from trtglm.backend.engine import ServedEngine, log_to_stderr

    parser = argparse.ArgumentParser(prog="python -m trtglm.backend.engine_process")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--max-queue", type=int, default=None)
    parser.add_argument("--kv-cache-reuse", action="store_true")
    parser.add_argument("--kv-fraction", type=float, default=FREE_GPU_MEM_FRACTION)
    args = parser.parse_args(argv)
    log_to_stderr()
    if torch.cuda.is_available():  # a CPU engine needs every core it has
        pin_engine()  # before the engine starts its threads, which take this thread's CPUs
    wire = MessagePipe(Connection(args.fd))
    try:
        engine = ServedEngine(args.engine_dir, max_queue=args.max_queue, kv_cache_reuse=args.kv_cache_reuse,
                              kv_fraction=args.kv_fraction)
    except Exception as e:
        log.exception("the engine failed to load")
        name = type(e).__name__ if type(e).__name__ in ERRORS else "TrtglmError"
        wire.send(("failed", name, str(e).splitlines()[0] if str(e) else type(e).__name__))
        return 1
    host = EngineHost(engine, wire)
    wire.send(("ready", host.limits(), host.stats()))
    host.serve()
    return 0


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s, so that what it pickles names trtglm.backend.engine_process.
    from trtglm.backend.engine_process import main as module_main

    code = module_main()
    logging.shutdown()
    os._exit(code)  # the engine is closed; skip the interpreter's slow teardown of CUDA and threads
