"""trtglm's PyTorch runtime as Triton's `tensorrt_llm` model (python backend, NVIDIA's tensor contract).

The engine folder is the `gpt_model_path` parameter (`trtglm build-engine` output with engine
`torch`). The engine runs in a process of its own (backend/engine_process.py: `ServedEngine` of
backend/engine.py, under its own GIL); this stub parses requests and sends responses. Every rank
loads only its own `rank{r}.safetensors`; rank 0 takes the requests and runs the in-flight
batching executor, the other ranks follow its steps.

Inputs (batch first; each sequence of a request is a request of its own to the in-flight batcher,
as in NVIDIA's backend):
input_ids, input_lengths, request_output_len, end_id, stop_words_list and bad_words_list
(TensorRT-LLM's [2, n] ids/offsets layout), embedding_bias, min_length, temperature,
runtime_top_k, runtime_top_p, random_seed, return_log_probs, streaming. pad_id and
len_penalty (beam search only) are accepted and unused. Sampling follows TensorRT-LLM: with
neither runtime_top_k nor runtime_top_p above 0 the choice is greedy; otherwise temperature
(default 1), then top-k, then top-p. beam_width above 1 and non-neutral repetition,
presence or frequency penalties are refused with an error naming them.

Outputs, as the repository's config declares them (`[batch, beam, …]`, the input never
included): output_ids and output_log_probs hold the response's tokens, sequence_length how
many there are, cum_log_probs the sum of the log probabilities so far (zeros unless
return_log_probs). Not streaming: one response with every token of every sequence, sent once
the last one finishes (rows shorter than the longest padded with -1; sequence_length tells
each row's count); the first sequence to fail fails the request and stops the others.
Streaming (one sequence per request): one response per step's token, or several tokens in
one when sending fell behind (below), the last one flagged final; a request that ends at
end_id (never returned) ends with a final response of no tokens. The python backend's
repository also declares `generated_ids` (every token so far) and `is_final` (whether this is the last response),
which let the ensemble's postprocessing decode a streamed reply exactly; they are sent only
when requested.

Errors a client causes come back as error responses; a full queue is one too ("busy … retry
later"). A cancelled request (`is_cancelled()`, or a response that cannot be sent) stops at
the next step and frees its slot. Decoupled responses are sent by a few sender threads
(backend/outbox.py), never by the executor, with the tokens that piled up during a send merged
into the next response; a request whose send has waited outbox.SEND_TIMEOUT_S is stopped
(whoever asked is gone).

Custom metrics on rank 0: `trtglm_active_sequences`, `trtglm_queued_requests`,
`trtglm_max_decode_batch`, `trtglm_decode_steps_total`, `trtglm_generated_tokens_total`,
`trtglm_step_microseconds_total` (Triton's /metrics).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from trtglm.chatglm.chat import word_sequences
from trtglm.errors import TrtglmError, UsageError, int32_range_error
from trtglm.runtime.executor import Output, QueueFullError, Request
from trtglm.backend.engine import log_to_stderr
from trtglm.backend.engine_process import EngineProcess
from trtglm.backend.outbox import Outbox

log = logging.getLogger(__name__)

ENGINE_PARAMETER = "gpt_model_path"
INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
          "bad_words_list", "embedding_bias", "beam_width", "temperature", "runtime_top_k", "runtime_top_p",
          "len_penalty", "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty",
          "random_seed", "return_log_probs", "streaming")
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # refused otherwise
DRAIN_S = 2.0  # at unload, how long the last responses (shutdown errors) may take to go out


# --- requests -----------------------------------------------------------------------------------------


def _one(arrays: Mapping[str, np.ndarray | None], name: str, default=None):
    array = arrays.get(name)
    if array is None:
        if default is None:
            raise UsageError(f"{name} is required")
        return default
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise UsageError(f"{name} must hold one value for each sequence, not {values.size}")
    return values[0].item()


def engine_requests(arrays: Mapping[str, np.ndarray | None]) -> tuple[list[Request], bool]:
    """One executor Request per sequence of a request's input arrays (batch first), and whether to stream.

    As in NVIDIA's backend, each sequence of a batch is a request of its own to the in-flight batcher."""
    ids = arrays.get("input_ids")
    if ids is None:
        raise UsageError("input_ids is required")
    if ids.ndim != 2 or ids.shape[0] < 1:
        raise UsageError(f"input_ids must be [batch, ids], not {list(ids.shape)}")
    batch = ids.shape[0]
    for name, array in arrays.items():
        if array is not None and (array.ndim == 0 or array.shape[0] != batch):
            raise UsageError(f"{name} has {array.shape[0] if array.ndim else 0} rows for the {batch} sequences of "
                             "input_ids")
    parsed = [_row_request(arrays, row, batch) for row in range(batch)]
    streaming = {stream for _, stream in parsed}
    if len(streaming) > 1:
        raise UsageError("streaming must be the same for every sequence of a request")
    if batch > 1 and True in streaming:
        raise UsageError(f"streaming takes one sequence per request; this one has {batch}: stream each as its own "
                         "request, or leave streaming off to have every reply in one response")
    return [request for request, _ in parsed], streaming.pop()


def _row_request(arrays: Mapping[str, np.ndarray | None], row: int, batch: int) -> tuple[Request, bool]:
    one_row = {name: None if array is None else array[row:row + 1] for name, array in arrays.items()}
    try:
        return engine_request(one_row)
    except UsageError as e:
        if batch == 1:
            raise
        raise UsageError(f"sequence {row} of {batch}: {e}") from None


def engine_request(arrays: Mapping[str, np.ndarray | None]) -> tuple[Request, bool]:
    """The executor's Request and whether to stream, from one sequence's input arrays (batch 1 first)."""
    ids = arrays.get("input_ids")
    if ids is None:
        raise UsageError("input_ids is required")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise UsageError(f"input_ids must be [1, ids] for one sequence, not {list(ids.shape)}")
    length = int(_one(arrays, "input_lengths", ids.shape[1]))
    if not 0 < length <= ids.shape[1]:
        raise UsageError(f"input_lengths {length} must be between 1 and the {ids.shape[1]} ids given")
    beams = int(_one(arrays, "beam_width", 1))
    if beams != 1:
        raise UsageError(f"beam_width {beams}: trtglm's runtime does not search beams (max_beam_width 1)")
    for name, neutral in NEUTRAL.items():
        value = float(_one(arrays, name, neutral))
        if value != neutral:
            raise UsageError(f"{name} {value:g} is not supported by trtglm's runtime (leave it out, or {neutral:g})")
    top_k, top_p = int(_one(arrays, "runtime_top_k", 0)), float(_one(arrays, "runtime_top_p", 0.0))
    output_len, min_length = int(_one(arrays, "request_output_len")), int(_one(arrays, "min_length", 0))
    for name, value, low in (("request_output_len", output_len, 1), ("runtime_top_k", top_k, 0),
                             ("min_length", min_length, 0)):
        if value < low:
            raise int32_range_error(name, value, low)
    sampled = top_k > 0 or top_p > 0
    end_id = int(_one(arrays, "end_id", -1))
    bias, seed = arrays.get("embedding_bias"), arrays.get("random_seed")
    request = Request(
        prompt=[int(t) for t in ids[0, :length]],
        max_new_tokens=output_len,
        end_id=end_id if end_id >= 0 else None,
        stop_words=_words(arrays, "stop_words_list"),
        bad_words=_words(arrays, "bad_words_list"),
        min_length=min_length,
        embedding_bias=torch.from_numpy(np.asarray(bias, np.float32).reshape(-1).copy())
        if bias is not None and bias.size else None,
        temperature=float(_one(arrays, "temperature", 1.0)) if sampled else 0.0,
        top_k=top_k,
        top_p=top_p if top_p > 0 else 1.0,
        seed=int(_one(arrays, "random_seed")) if seed is not None else None,
        log_probs=bool(_one(arrays, "return_log_probs", False)),
    )
    return request, bool(_one(arrays, "streaming", False))


def _words(arrays: Mapping[str, np.ndarray | None], name: str) -> list[list[int]]:
    array = arrays.get(name)
    if array is None:
        return []
    if array.ndim != 3 or array.shape[0] != 1:
        raise UsageError(f"{name} must be [1, 2, n] for each sequence, not {list(array.shape)}")
    return word_sequences(array[0], name)


# --- responses ----------------------------------------------------------------------------------------


def response_arrays(new_ids: list[int], new_log_probs: list[float], all_ids: list[int], cum_log_prob: float,
                    final: bool) -> dict[str, np.ndarray]:
    """Every output tensor of one response ([batch 1, beam 1, …])."""
    count = len(new_ids)
    log_probs = new_log_probs if len(new_log_probs) == count else [0.0] * count
    return {
        "output_ids": np.array(new_ids, dtype=np.int32).reshape(1, 1, count),
        "sequence_length": np.array([[count]], dtype=np.int32),
        "cum_log_probs": np.array([[cum_log_prob]], dtype=np.float32),
        "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, count),
        "generated_ids": np.array(all_ids, dtype=np.int32).reshape(1, 1, len(all_ids)),
        "is_final": np.array([[final]], dtype=bool),
    }


class Reply:
    """Turns one request's executor Outputs into responses (`send(arrays, final)` or `fail(message)`)."""

    def __init__(self, streaming: bool, send: Callable[[dict, bool], None], fail: Callable[[str], None]):
        self.streaming, self.send, self.fail = streaming, send, fail
        self.ids: list[int] = []
        self.log_probs: list[float] = []
        self.gone = False  # a response could not be sent: the client is gone

    def __call__(self, output: Output) -> None:
        if self.gone:
            return
        try:
            self._handle(output)
        except Exception:
            self.gone = True
            raise

    def _handle(self, output: Output) -> None:
        before = len(self.ids)
        self.ids += output.tokens
        self.log_probs += output.log_probs
        if output.error or output.reason == "cancelled":
            self.fail(output.error or "the request was cancelled")
        elif self.streaming:
            self.send(response_arrays(self.ids[before:], self.log_probs[before:], self.ids, sum(self.log_probs),
                                      output.finished), output.finished)
        elif output.finished:
            self.send(response_arrays(self.ids, self.log_probs, self.ids, sum(self.log_probs), True), True)


PADDING = -1  # past a sequence's length in a response of several (NVIDIA's padding of shorter beams)


def stacked(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several sequences' response arrays as one response's ([batch, …]), the shorter padded with PADDING."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        width = max(array.shape[-1] for array in arrays)
        out[name] = np.concatenate([np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])],
                                           constant_values=PADDING) for a in arrays])
    return out


class Gathered:
    """A request's sequences answered together in one response once every one has finished (each its whole
    reply); the first error fails the request, and `failed()` then tells the others to stop."""

    def __init__(self, count: int, send: Callable[[dict, bool], None], fail: Callable[[Exception], None]):
        self.send, self.fail = send, fail
        self.parts: list[dict | None] = [None] * count
        self._failed = False
        self._lock = threading.Lock()

    def reply(self, index: int) -> Reply:
        """The Reply that turns sequence `index`'s outputs into its part."""
        return Reply(False, lambda arrays, _last: self._arrived(index, arrays),
                     lambda message: self.error(TrtglmError(message)))

    def error(self, error: Exception) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
        self.fail(error)

    def failed(self) -> bool:
        return self._failed

    def _arrived(self, index: int, arrays: dict) -> None:
        with self._lock:
            self.parts[index] = arrays
            if self._failed or any(part is None for part in self.parts):
                return
        self.send(stacked(self.parts), True)


# --- Triton ----------------------------------------------------------------------------------------------


class TritonPythonModel:
    """Triton's entry point (decoupled for streaming; non-decoupled answers each request once)."""

    def initialize(self, args: dict) -> None:
        from trtglm.backend import triton_io
        from trtglm.backend.triton_io import pb_utils

        log_to_stderr()
        self.io, self.pb = triton_io, pb_utils
        config = triton_io.model_config(args)
        name = config.get("name", "tensorrt_llm")
        engine_dir = triton_io.parameter(triton_io.parameters(config), ENGINE_PARAMETER, name)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.dtypes = triton_io.output_dtypes(config)
        self.outbox = Outbox()
        queue = int((config.get("dynamic_batching") or {}).get("default_queue_policy", {}).get("max_queue_size", 0))
        started = time.monotonic()
        log.info("%s: initializing (engine %s)", name, engine_dir)
        self.engine = EngineProcess.start(engine_dir, max_queue=queue or None, on_death=self._engine_died)
        self.executor = self.engine if self.engine.limits.takes_requests else None
        self.metrics = Metrics(self.executor, pb_utils) if self.executor is not None else None
        log.info("%s: initialized in %.2f s", name, time.monotonic() - started)

    def execute(self, requests: list):
        if self.executor is None:  # ranks > 0 serve no clients
            error = self.io.error_response(UsageError(f"rank {self.engine.limits.rank} takes no requests; send them "
                                                      "to rank 0"))
            if self.decoupled:
                for request in requests:
                    self._send_alone(request, error)
                return None
            return [error for _ in requests]
        if self.decoupled:
            for request in requests:
                self._start_streamed(request)
            return None
        return self._answer_all(requests)

    def finalize(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        self.engine.stop()
        self.outbox.stop(DRAIN_S)

    def _engine_died(self, why: str) -> None:
        """The engine cannot come back in this stub: let the errors out, then end the stub, so that the
        launch's supervisor loads the model again (or stops the launch)."""
        self.outbox.stop(DRAIN_S)
        log.error("%s: ending this model's stub", why)
        logging.shutdown()
        os._exit(1)

    # --- requests ---------------------------------------------------------------------------------------

    def _parse(self, request) -> tuple[list[Request], bool]:
        return engine_requests(self.io.input_arrays(request, INPUTS))

    def _wanted(self, request) -> set[str]:
        names = set(request.requested_output_names())
        return names or set(self.dtypes)

    def _response(self, arrays: dict, wanted: set[str]):
        chosen = {name: array for name, array in arrays.items() if name in wanted}
        return self.pb.InferenceResponse(output_tensors=self.io.output_tensors(chosen, self.dtypes))

    def _start_streamed(self, request) -> None:
        sender = request.get_response_sender()
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            sequences, streaming = self._parse(request)
            wanted = self._wanted(request)
        except Exception as e:
            self._send_alone(request, self._error(e))
            return

        def send(arrays: dict, last: bool) -> None:
            sender.send(self._response(arrays, wanted), flags=final if last else 0)

        if streaming:  # one sequence (engine_requests refuses more)
            reply = Reply(True, send, lambda message: sender.send(self.io.error_response(TrtglmError(message)),
                                                                  flags=final))
            try:
                self.executor.submit(sequences[0], self.outbox.mailbox(reply), request.is_cancelled)
            except Exception as e:
                self._send_alone(request, self._error(e))
            return
        gathered = Gathered(len(sequences), send, lambda error: self._send_alone(request, self._error(error)))
        self._submit(sequences, gathered, lambda: request.is_cancelled() or gathered.failed(), self.outbox.mailbox)

    def _submit(self, sequences: list[Request], gathered: Gathered, is_cancelled: Callable[[], bool],
                deliver: Callable[[Reply], Callable[[Output], None]] = lambda reply: reply) -> list:
        """Queue each sequence with its part of `gathered`; the executor's handles of those queued."""
        handles = []
        for index, sequence in enumerate(sequences):
            try:
                handles.append(self.executor.submit(sequence, deliver(gathered.reply(index)), is_cancelled))
            except Exception as e:
                gathered.error(e)
                break
        return handles

    def _send_alone(self, request, response) -> None:
        """Send a request's one and final response from a thread of its own (a send may never return)."""
        sender = request.get_response_sender()
        threading.Thread(target=sender.send, args=(response,),
                         kwargs={"flags": self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL},
                         name="trtglm-send", daemon=True).start()

    def _error(self, error: Exception):
        """An error response; a full queue is UNAVAILABLE (HTTP 503: retry later), not the client's mistake."""
        if isinstance(error, QueueFullError):
            return self.pb.InferenceResponse(output_tensors=[], error=self.io.triton_error(str(error), "UNAVAILABLE"))
        return self.io.error_response(error)

    def _answer_all(self, requests: list) -> list:
        """Non-decoupled: every sequence of every request runs together; one response per request."""
        waiting, responses = [], [None] * len(requests)
        for index, request in enumerate(requests):
            try:
                sequences, streaming = self._parse(request)
                if streaming:
                    raise UsageError("streaming needs a decoupled tensorrt_llm (decoupled_mode true)")
                wanted = self._wanted(request)
            except Exception as e:
                responses[index] = self._error(e)
                continue

            def send(arrays: dict, _last: bool, index=index, wanted=wanted) -> None:
                responses[index] = self._response(arrays, wanted)

            def fail(error: Exception, index=index) -> None:
                responses[index] = self._error(error)

            gathered = Gathered(len(sequences), send, fail)
            waiting += self._submit(sequences, gathered, gathered.failed)
        for handle in waiting:
            handle.done.wait()
        return responses


class Metrics:
    """The executor's counters as Triton custom metrics, refreshed twice a second by a thread of their own."""

    GAUGES = {"trtglm_active_sequences": ("active", "requests being generated now"),
              "trtglm_queued_requests": ("queued", "requests waiting for a slot"),
              "trtglm_max_decode_batch": ("max_decode_batch", "the most requests decoded together in one step")}
    COUNTERS = {"trtglm_decode_steps_total": ("decode_calls", "decode steps run"),
                "trtglm_generated_tokens_total": ("generated_tokens", "tokens generated"),
                "trtglm_step_microseconds_total": ("step_us", "time the engine spent in steps")}
    PERIOD_S = 0.5

    def __init__(self, executor: EngineProcess, pb_utils):
        self.executor = executor
        self.metrics: dict[str, tuple[str, object, bool]] = {}
        self.families = []  # a metric works only while its family lives
        family = pb_utils.MetricFamily
        for table, kind, is_counter in ((self.GAUGES, family.GAUGE, False), (self.COUNTERS, family.COUNTER, True)):
            for name, (field, description) in table.items():
                self.families.append(family(name=name, description=description, kind=kind))
                self.metrics[name] = (field, self.families[-1].Metric(labels={}), is_counter)
        self.counted: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trtglm-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                self.refresh()
            except Exception as e:  # metrics must never take the model down
                log.warning("metrics: %s", e)

    def refresh(self) -> None:
        stats = self.executor.stats()
        for name, (field, metric, is_counter) in self.metrics.items():
            value = int(getattr(stats, field))
            if is_counter:
                delta = value - self.counted.get(name, 0)
                if delta:
                    metric.increment(delta)
                    self.counted[name] = value
            else:
                metric.set(value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.metrics.clear()  # metrics before their families
        self.families.clear()
