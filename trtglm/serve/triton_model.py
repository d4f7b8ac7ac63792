"""trtglm's PyTorch runtime as Triton's `tensorrt_llm` model (python backend, NVIDIA's tensor contract).

The engine folder is the `gpt_model_path` parameter (`trtglm build-engine` output with engine
`torch`). Every rank loads only its own `rank{r}.safetensors` (trtglm.runtime.distributed);
rank 0 takes the requests and runs the in-flight batching executor (trtglm.runtime.executor)
on a background thread, the other ranks follow its steps. At load the model runs one short
request (prefill and decode) so that the first real one is not slow.

Inputs (batch size 1 per request, as NVIDIA's in-flight batching backend requires):
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
return_log_probs). Not streaming: one response with every token. Streaming: one response per
step's token, or several tokens in one when sending fell behind (below), the last one flagged final; a request that ends at end_id (never returned) ends with a
final response of no tokens. The python backend's repository also declares
`generated_ids` (every token so far) and `is_final` (whether this is the last response),
which let the ensemble's postprocessing decode a streamed reply exactly; they are sent only
when requested.

Errors a client causes come back as error responses; a full queue is one too ("busy … retry
later"). A cancelled request (`is_cancelled()`, or a response that cannot be sent) stops at
the next step and frees its slot. Decoupled responses are sent by a few sender threads
(serve/outbox.py), never by the executor, with the tokens that piled up during a send merged
into the next response; a request whose send has waited outbox.SEND_TIMEOUT_S is stopped
(whoever asked is gone).

Custom metrics on rank 0: `trtglm_active_sequences`, `trtglm_queued_requests`,
`trtglm_max_decode_batch`, `trtglm_decode_steps_total`, `trtglm_generated_tokens_total`
(Triton's /metrics).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trtglm.chatglm.chat import word_sequences
from trtglm.engine.manifest import read_manifest
from trtglm.errors import TrtglmError, UsageError
from trtglm.runtime.distributed import Distributed, LeaderSlotModel, RankInfo, StepChannel, follow, join, rank_info
from trtglm.runtime.executor import Executor, Output, QueueFullError, Request
from trtglm.runtime.slots import SlotModel
from trtglm.serve.outbox import Outbox

log = logging.getLogger(__name__)

ENGINE_PARAMETER = "gpt_model_path"
INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
          "bad_words_list", "embedding_bias", "beam_width", "temperature", "runtime_top_k", "runtime_top_p",
          "len_penalty", "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty",
          "random_seed", "return_log_probs", "streaming")
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # refused otherwise
QUEUE_PER_SLOT = 8  # waiting requests per slot when the config sets no max_queue_size
DRAIN_S = 2.0  # at unload, how long the last responses (shutdown errors) may take to go out
WARM_UP_PROMPT = (1, 2, 3, 4)


# --- requests -----------------------------------------------------------------------------------------


def _one(arrays: Mapping[str, np.ndarray | None], name: str, default=None):
    array = arrays.get(name)
    if array is None:
        if default is None:
            raise UsageError(f"{name} is required")
        return default
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise UsageError(f"{name} must hold one value for the request's one sequence, not {values.size}")
    return values[0].item()


def engine_request(arrays: Mapping[str, np.ndarray | None]) -> tuple[Request, bool]:
    """The executor's Request and whether to stream, from a request's input arrays (batch first)."""
    ids = arrays.get("input_ids")
    if ids is None:
        raise UsageError("input_ids is required")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise UsageError(f"tensorrt_llm takes one sequence per request (batch size 1); input_ids is "
                         f"{list(ids.shape)}: send each sequence as its own request")
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
    sampled = top_k > 0 or top_p > 0
    end_id = int(_one(arrays, "end_id", -1))
    bias, seed = arrays.get("embedding_bias"), arrays.get("random_seed")
    request = Request(
        prompt=[int(t) for t in ids[0, :length]],
        max_new_tokens=int(_one(arrays, "request_output_len")),
        end_id=end_id if end_id >= 0 else None,
        stop_words=_words(arrays, "stop_words_list"),
        bad_words=_words(arrays, "bad_words_list"),
        min_length=int(_one(arrays, "min_length", 0)),
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
        raise UsageError(f"{name} must be [1, 2, n] for the request's one sequence, not {list(array.shape)}")
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


# --- the engine in this process -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    checkpoint_dir: Path
    tp_size: int
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokenizer_size: int  # ids the tokenizer can decode; the engine's vocabulary may be padded past them


def engine_info(engine_dir: str | Path) -> EngineInfo:
    manifest = read_manifest(engine_dir)
    if manifest["engine"] != "torch":
        raise UsageError(f"{engine_dir} holds a {manifest['engine']} engine; the python backend serves torch engines "
                         "(NVIDIA's tensorrtllm backend serves TensorRT ones)")
    limits, mapping = manifest["limits"], manifest["mapping"]
    return EngineInfo(Path(manifest["checkpoint_dir"]), int(mapping["tp_size"]) * int(mapping["pp_size"]),
                      int(limits["max_batch_size"]), int(limits["max_seq_len"]), int(limits["max_num_tokens"]),
                      int(manifest["tokenizer"]["vocab_size"]))


def pick_device(info: RankInfo, requested: str | None = None) -> torch.device:
    """$TRTGLM_DEVICE or `requested` if given; else this rank's GPU when there are GPUs, else the CPU."""
    requested = requested or os.environ.get("TRTGLM_DEVICE")
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def slot_model(engine: EngineInfo, info: RankInfo, device: torch.device, group=None) -> SlotModel:
    """This rank's SlotModel: the fast one on a single GPU when it loads, else the portable one."""
    from trtglm.runtime.model import load_model
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    if device.type == "cuda" and info.world_size == 1 and os.environ.get("TRTGLM_RUNTIME", "auto") != "portable":
        try:
            from trtglm.runtime.fast import load_fast_model

            return load_fast_model(engine.checkpoint_dir, max_batch=engine.max_batch_size,
                                   max_seq_len=engine.max_seq_len, device=device)
        except ImportError as e:
            log.warning("the fast GPU runtime is not available (%s); using the portable one", e)
    rank = info.rank if info.world_size > 1 else None
    model = load_model(engine.checkpoint_dir, device=device, rank=rank, group=group)
    return ShardedSlotModel(model, engine.max_batch_size, engine.max_seq_len)


class ServedEngine:
    """The engine as one rank of a server runs it: rank 0 an executor, the others a follower thread."""

    def __init__(self, engine_dir: str | Path, max_queue: int | None = None, info: RankInfo | None = None,
                 device: str | None = None, warm_up: bool = True):
        started = time.monotonic()
        self.engine = engine_info(engine_dir)
        self.info = info or rank_info()
        if self.info.world_size != self.engine.tp_size:
            raise UsageError(f"{self.info.world_size} rank(s) serve an engine of tp × pp = {self.engine.tp_size} "
                             f"({engine_dir}); launch with --world-size {self.engine.tp_size}")
        self.device = pick_device(self.info, device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.info.local_size)))
        self.distributed: Distributed | None = None
        if self.info.world_size > 1:
            self.distributed = join(self.info, self.device)
            log.info("rank %d: joined %d ranks in %.2f s", self.info.rank, self.info.world_size,
                     time.monotonic() - started)
        group = self.distributed.collectives if self.distributed else None
        log.info("rank %d: loading the model on %s", self.info.rank, self.device)
        loading = time.monotonic()
        model = slot_model(self.engine, self.info, self.device, group)
        log.info("rank %d: model loaded in %.2f s (weights; on one GPU also kernel tuning and CUDA graphs)",
                 self.info.rank, time.monotonic() - loading)
        self.executor: Executor | None = None
        self.follower: threading.Thread | None = None
        if self.info.rank == 0:
            if self.distributed:
                model = LeaderSlotModel(model, StepChannel(self.distributed.control))
            self.model = model
            self.executor = Executor(model, max_queue or QUEUE_PER_SLOT * self.engine.max_batch_size,
                                     max_prefill_tokens=self.engine.max_num_tokens, device=self.device,
                                     vocab_limit=self.engine.tokenizer_size)
            self.executor.start()
            if warm_up:
                warming = time.monotonic()
                self.warm_up()
                log.info("rank 0: warm-up request in %.2f s", time.monotonic() - warming)
        else:
            self.model = model
            self.follower = threading.Thread(target=follow, args=(model, StepChannel(self.distributed.control)),
                                             name="trtglm-follower", daemon=True)
            self.follower.start()
        log.info("rank %d of %d ready on %s: %s", self.info.rank, self.info.world_size, self.device,
                 self.engine.checkpoint_dir)
        log.info("rank %d: engine set up in %.2f s", self.info.rank, time.monotonic() - started)

    def warm_up(self) -> None:
        outputs: list[Output] = []
        vocab = self.model.vocab_size
        request = Request([t % vocab for t in WARM_UP_PROMPT], max_new_tokens=2)
        handle = self.executor.submit(request, outputs.append)
        handle.done.wait()
        if outputs and outputs[-1].error:
            raise TrtglmError(f"warm-up failed: {outputs[-1].error}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests; rank 0 tells the followers to stop; leave the process groups."""
        if self.executor is not None:
            self.executor.stop(timeout)
            if isinstance(self.model, LeaderSlotModel):
                _with_deadline(self.model.stop_followers, timeout)
        elif self.follower is not None:
            self.follower.join(timeout)
        if self.distributed is not None and (self.follower is None or not self.follower.is_alive()):
            # The ranks leave together (a barrier), so allow for the slowest one on a busy host.
            _with_deadline(self.distributed.close, max(timeout, LEAVE_TIMEOUT_S))


LEAVE_TIMEOUT_S = 60.0


def _with_deadline(call: Callable[[], None], timeout: float) -> None:
    """Run `call` on a daemon thread; give up waiting after `timeout` (a peer that is gone may block it)."""
    thread = threading.Thread(target=_quietly, args=(call,), daemon=True)
    thread.start()
    thread.join(timeout)


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as e:
        log.warning("while shutting down: %s", e)


# --- Triton ----------------------------------------------------------------------------------------------


class TritonPythonModel:
    """Triton's entry point (decoupled for streaming; non-decoupled answers each request once)."""

    def initialize(self, args: dict) -> None:
        from trtglm.repo.python_models import triton_io
        from trtglm.repo.python_models.triton_io import pb_utils

        _log_to_stderr()
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
        self.engine = ServedEngine(engine_dir, max_queue=queue or None)
        self.metrics = Metrics(self.engine.executor, pb_utils) if self.engine.executor is not None else None
        log.info("%s: initialized in %.2f s", name, time.monotonic() - started)

    def execute(self, requests: list):
        if self.engine.executor is None:  # ranks > 0 serve no clients
            error = self.io.error_response(UsageError(f"rank {self.engine.info.rank} takes no requests; send them to "
                                                      "rank 0"))
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
        self.engine.close()
        self.outbox.stop(DRAIN_S)

    # --- requests ---------------------------------------------------------------------------------------

    def _parse(self, request) -> tuple[Request, bool]:
        return engine_request(self.io.input_arrays(request, INPUTS))

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
            parsed, streaming = self._parse(request)
            wanted = self._wanted(request)
        except Exception as e:
            self._send_alone(request, self._error(e))
            return

        def send(arrays: dict, last: bool) -> None:
            sender.send(self._response(arrays, wanted), flags=final if last else 0)

        def fail(message: str) -> None:
            sender.send(self.io.error_response(TrtglmError(message)), flags=final)

        try:
            mailbox = self.outbox.mailbox(Reply(streaming, send, fail))
            self.engine.executor.submit(parsed, mailbox, request.is_cancelled)
        except Exception as e:
            self._send_alone(request, self._error(e))

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
        """Non-decoupled: every request of the batch runs together; one response each."""
        waiting, responses = [], [None] * len(requests)
        for index, request in enumerate(requests):
            try:
                parsed, streaming = self._parse(request)
                if streaming:
                    raise UsageError("streaming needs a decoupled tensorrt_llm (decoupled_mode true)")
                wanted = self._wanted(request)

                def send(arrays: dict, _last: bool, index=index, wanted=wanted) -> None:
                    responses[index] = self._response(arrays, wanted)

                def fail(message: str, index=index) -> None:
                    responses[index] = self.io.error_response(TrtglmError(message))

                waiting.append(self.engine.executor.submit(parsed, Reply(False, send, fail)))
            except Exception as e:
                responses[index] = self._error(e)
        for handle in waiting:
            handle.done.wait()
        return responses


class Metrics:
    """The executor's counters as Triton custom metrics, refreshed twice a second by a thread of their own."""

    GAUGES = {"trtglm_active_sequences": ("active", "requests being generated now"),
              "trtglm_queued_requests": ("queued", "requests waiting for a slot"),
              "trtglm_max_decode_batch": ("max_decode_batch", "the most requests decoded together in one step")}
    COUNTERS = {"trtglm_decode_steps_total": ("decode_calls", "decode steps run"),
                "trtglm_generated_tokens_total": ("generated_tokens", "tokens generated")}
    PERIOD_S = 0.5

    def __init__(self, executor: Executor, pb_utils):
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


def _log_to_stderr() -> None:
    """trtglm's INFO lines reach the server's log (the python backend configures no logging)."""
    logger = logging.getLogger("trtglm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("trtglm %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
