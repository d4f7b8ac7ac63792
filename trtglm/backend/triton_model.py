"""trtglm's PyTorch runtime as Triton's `tensorrt_llm` model (python backend, NVIDIA's tensor contract).

The engine folder is the `gpt_model_path` parameter (`trtglm build-engine` output with engine
`torch`); `enable_kv_cache_reuse` true turns on prefix caching (runtime/prefix.py; off by default,
as in TensorRT-LLM). The engine runs in a process of its own (backend/engine_process.py: `ServedEngine` of
backend/engine.py, under its own GIL); this stub parses requests and sends responses. Every rank
loads only its own `rank{r}.safetensors`; rank 0 takes the requests and runs the in-flight
batching executor, the other ranks follow its steps.

Requests are parsed by `llm_requests` (NVIDIA's input tensors -> the executor's Requests, one per
sequence, as in NVIDIA's in-flight batching backend) and answered by `llm_responses`.

Outputs, as the repository's config declares them, each response for one sequence (`[1, beam, …]`,
the input never included): output_ids and output_log_probs hold the response's tokens,
sequence_length how many there are, cum_log_probs the sum of the log probabilities so far (zeros
unless return_log_probs). A batch of several prompts in one request needs a decoupled
tensorrt_llm, as in NVIDIA's backend (which refuses it otherwise: "Batch size > 1 requires the
tensorrt_llm backend to be using decoupled transaction policy"); each prompt is then a sequence
of its own, and so is each of one prompt's num_return_sequences n (sequence k sampling with the
request's seed + k). Each sequence answers in responses of its own, those of different sequences
interleaved as they come, carrying batch_index (a batch's row) or sequence_index (one prompt's
sample) where there are several; the request's final flag goes with the last response of the
last sequence to end. Not streaming: one response per sequence with every token once it
finishes; a beam search (beam_width up to the engine's max_beam_width) answers once with every
beam (`[1, beams, …]`, best first, shorter ones padded with -1). Streaming (beam 1): one response
per step's token, or several tokens in one when sending fell behind (below); a sequence that
ends at end_id (never returned) ends with a response of no tokens. The python backend's
repository also declares `generated_ids` (every token so far) and `is_final` (whether this is the
sequence's last response), which let the ensemble's postprocessing decode a streamed reply
exactly, and `reply_prefix` (`postprocessing.reply_prefixes` of input_text and
exclude_input_in_output: the request's text when it asks for its input in the output, which the
ensemble's postprocessing cannot read itself); they are sent only when requested.
num_input_tokens / num_output_tokens, the perf metrics (`llm_responses.Timing`) and the context
and generation logits (`llm_responses.Logits`, computed only for a request that asks) go out when
their return_* flag asks.

Errors a client causes come back as error responses; a full queue is one too ("busy … retry
later"). A cancelled request (`is_cancelled()`, or a response that cannot be sent) stops at
the next step and frees its slot. Decoupled responses are sent by a few sender threads
(backend/outbox.py), never by the executor, with the tokens that piled up during a send merged
into the next response; a request whose send has waited outbox.SEND_TIMEOUT_S is stopped
(whoever asked is gone).

Custom metrics on rank 0 (Triton's /metrics): trtglm's own and NVIDIA's `nv_trt_llm_*` families
(backend/metrics.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from trtglm.backend.contract import ENGINE_DIR, KV_CACHE_FRACTION, KV_CACHE_REUSE, MAX_RETURN_SEQUENCES, TENSORRT_LLM
from trtglm.backend.engine import log_to_stderr
from trtglm.backend.engine_process import EngineProcess
from trtglm.backend.llm_requests import (BATCH_NEEDS_DECOUPLED, INPUTS, batch_size, engine_requests,
                                         return_sequences, unasked_outputs)
from trtglm.backend.llm_responses import Responder
from trtglm.backend.metrics import Metrics
from trtglm.backend.outbox import Outbox
from trtglm.backend.postprocessing import reply_prefixes
from trtglm.errors import TrtglmError, UsageError
from trtglm.conventions import FREE_GPU_MEM_FRACTION
from trtglm.runtime.executor import QueueFullError, Request

log = logging.getLogger(__name__)

DRAIN_S = 2.0  # at unload, how long the last responses (shutdown errors) may take to go out


def kv_cache_fraction(params: dict[str, str], model: str) -> float:
    """`kv_cache_free_gpu_mem_fraction`: TensorRT-LLM's default (0.9) where a repository leaves it out."""
    value = params.get(KV_CACHE_FRACTION, "").strip()
    if not value:
        return FREE_GPU_MEM_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        fraction = 0.0
    if not 0 < fraction <= 1:
        raise UsageError(f"{model}: parameter {KV_CACHE_FRACTION} must be a number above 0 and at most 1, not "
                         f"{value!r}")
    return fraction


def kv_cache_reuse(params: dict[str, str], model: str) -> bool:
    """`enable_kv_cache_reuse`: false where a repository leaves it out (TensorRT-LLM's default)."""
    from trtglm.backend import triton_io

    return KV_CACHE_REUSE in params and triton_io.bool_parameter(params, KV_CACHE_REUSE, model)


class TritonPythonModel:
    """Triton's entry point (decoupled for streaming; non-decoupled answers each request once)."""

    def initialize(self, args: dict) -> None:
        from trtglm.backend import triton_io
        from trtglm.backend.triton_io import pb_utils

        log_to_stderr()
        self.io, self.pb = triton_io, pb_utils
        setup = triton_io.setup(args, TENSORRT_LLM)
        config, name, engine_dir = setup.config, setup.name, setup.parameter(ENGINE_DIR)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.dtypes = triton_io.output_dtypes(config)
        self.outbox = Outbox()
        queue = int((config.get("dynamic_batching") or {}).get("default_queue_policy", {}).get("max_queue_size", 0))
        started = time.monotonic()
        log.info("%s: initializing (engine %s)", name, engine_dir)
        reuse = kv_cache_reuse(setup.params, name)
        self.max_return_sequences = triton_io.int_parameter(setup.params, MAX_RETURN_SEQUENCES, name)
        self.engine = EngineProcess.start(engine_dir, max_queue=queue or None, kv_cache_reuse=reuse,
                                          kv_fraction=kv_cache_fraction(setup.params, name),
                                          on_death=self._engine_died)
        self.executor = self.engine if self.engine.limits.takes_requests else None
        self.metrics = (Metrics(self.executor.stats, pb_utils, name, str(args.get("model_version", "1")))
                        if self.executor is not None else None)
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
        """The engine cannot come back in this stub: let the errors out, then end the stub, which the launch's
        supervisor sees (serve/stubs.py) and stops the launch for."""
        self.outbox.stop(DRAIN_S)
        log.error("%s: ending this model's stub", why)
        logging.shutdown()
        os._exit(1)

    # --- requests ---------------------------------------------------------------------------------------

    def _parse(self, request) -> tuple[list[Request], bool, list[dict], set[str]]:
        """The request's sequences, whether to stream, what each sequence's responses carry besides (its row's
        reply_prefix and num_input_tokens; batch_index for a batch's rows and sequence_index for one prompt's
        num_return_sequences, where NVIDIA's backend writes them), and the outputs it wants."""
        arrays = self.io.input_arrays(request, INPUTS)
        rows = batch_size(arrays)
        if rows > 1 and not self.decoupled:
            raise UsageError(BATCH_NEEDS_DECOUPLED)
        sequences, streaming = engine_requests(arrays, self.max_return_sequences)
        samples = return_sequences(arrays, self.max_return_sequences)
        prefixes = reply_prefixes(arrays["input_text"], arrays["exclude_input_in_output"], streaming, rows)
        extras = []
        for index, sequence in enumerate(sequences):
            row = index if rows > 1 else 0
            extra = {"reply_prefix": prefixes[row:row + 1],
                     "num_input_tokens": np.array([[len(sequence.prompt)]], dtype=np.int32)}
            for tag, count in (("batch_index", rows), ("sequence_index", samples)):
                if count > 1:
                    extra[tag] = np.array([[index]], dtype=np.int32)
            extras.append(extra)
        wanted = (set(request.requested_output_names()) or set(self.dtypes)) - unasked_outputs(arrays)
        return sequences, streaming, extras, wanted

    def _response(self, arrays: dict, wanted: set[str]):
        chosen = {name: array for name, array in arrays.items() if name in wanted}
        return self.pb.InferenceResponse(output_tensors=self.io.output_tensors(chosen, self.dtypes))

    def _start_streamed(self, request) -> None:
        """Decoupled: each sequence of the request (a batch's rows, or one prompt's num_return_sequences) in
        responses of its own, as NVIDIA's backend answers; the request's final flag goes with the last response
        of the last sequence to end. One send at a time per request: an ensemble loses responses of one
        request sent concurrently."""
        sender, final, arrival = request.get_response_sender(), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, \
            time.time_ns()
        try:
            sequences, streaming, extras, wanted = self._parse(request)
        except Exception as e:
            self._send_alone(request, self._error(e))
            return
        ended, sending = set(), threading.Lock()

        def send(index: int, response, last: bool) -> None:
            with sending:
                if last:
                    ended.add(index)
                sender.send(response, flags=final if len(ended) == len(sequences) else 0)

        def sequence_reply(index: int) -> Responder:
            return Responder(streaming, lambda arrays, last: send(index, self._response({**arrays, **extras[index]},
                                                                                    wanted), last),
                         lambda message: send(index, self.io.error_response(TrtglmError(message)), True), arrival,
                         wanted)

        for index, sequence in enumerate(sequences):
            reply = sequence_reply(index)
            try:
                self.executor.submit(sequence, self.outbox.mailbox(reply), request.is_cancelled)
            except Exception as e:
                if index == 0:  # nothing runs: the request's one response (a full queue is UNAVAILABLE)
                    self._send_alone(request, self._error(e))
                    return
                with sending:
                    ended.update(range(index + 1, len(sequences)))  # never queued
                reply.fail(str(e))  # the final flag follows once the queued ones have ended
                return

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
        """Non-decoupled: one sequence a request (as NVIDIA's backend, which refuses a batch or streaming
        here); every request's sequence runs together; one response per request."""
        waiting, responses = [], [None] * len(requests)
        arrival = time.time_ns()
        for index, request in enumerate(requests):
            try:
                sequences, streaming, extras, wanted = self._parse(request)
                if streaming:
                    raise UsageError("streaming needs a decoupled tensorrt_llm (decoupled_mode true)")
                if len(sequences) > 1:
                    raise UsageError("num_return_sequences above 1 needs a decoupled tensorrt_llm (decoupled_mode "
                                     "true): each sequence comes in responses of its own")
            except Exception as e:
                responses[index] = self._error(e)
                continue

            def send(arrays: dict, _last: bool, index=index, wanted=wanted, extra=extras[0]) -> None:
                responses[index] = self._response({**arrays, **extra}, wanted)

            def fail(message: str, index=index) -> None:
                responses[index] = self.io.error_response(TrtglmError(message))

            try:
                waiting.append(self.executor.submit(sequences[0], Responder(False, send, fail, arrival, wanted),
                                                    lambda: False))
            except Exception as e:
                responses[index] = self._error(e)
        for handle in waiting:
            handle.done.wait()
        return responses
