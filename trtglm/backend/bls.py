"""ChatGLM3 pipeline as one python model (BLS): tokenize, call tensorrt_llm, detokenize.

It takes the ensemble's inputs and gives its outputs (text_output, cum_log_probs,
output_log_probs; text_output flat and after `postprocessing.reply_prefixes`, as the ensemble's).
Preprocessing is `preprocessing.preprocess`, run in-process; the engine is
called through Triton (`pb_utils.InferenceRequest` to the model named by the
tensorrt_llm_model_name parameter); the reply is decoded here. Since this model sees the
whole stream of a request, streamed pieces come from one `ReplyStream` per request and beam,
with no state shared between requests. With accumulate_tokens true, each streamed
text_output is the whole text so far instead of the new piece. As tensorrt_llm answers (and
NVIDIA's BLS model passes on), each prompt of a batch comes in responses of its own with its
batch_index (decoupled only: a repository that is not refuses a batch in tensorrt_llm), and with
num_return_sequences each sequence with its sequence_index.

Each instance answers one request at a time, on the thread Triton calls `execute` on, as NVIDIA's
BLS model does: Triton 2.51's python-backend stub wedges (every thread waiting on the server for
good) or corrupts its heap when several threads of one model send responses, ask whether a request
is cancelled and start BLS requests at once under load. Requests overlap across instances, and the
engine batches them in flight: a repository has one instance per sequence the engine runs at once
(the profile's serve.bls_instances, 0: the engine's max_batch_size). A decoupled repository streams
each request's responses; otherwise each request gets one response.

The engine's responses are read by a thread of their own (which calls nothing else of Triton's)
and awaited WAIT_S at a time, checking in between that the engine's python-backend process still
runs: when it has died (Triton 2.51 then never answers, nor
restarts it), the request ends with an error saying so, within about WAIT_S, and later
requests are refused at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from trtglm.backend import triton_io
from trtglm.backend.contract import (ACCUMULATE_TOKENS, BLS, BLS_ONLY_INPUTS, CONTRACT, ENSEMBLE, FLAGGED_OUTPUTS,
                                     LLM_MODEL_NAME, MAX_RETURN_SEQUENCES, PREPROCESSING, REPLY_FORM_INPUTS,
                                     TENSORRT_LLM, Limits, client_outputs_from, feeds, flag_set, for_backend, names,
                                     refusal)
from trtglm.backend.postprocessing import flat_texts, reply_prefixes
from trtglm.backend.preprocessing import preprocess
from trtglm.backend.triton_io import pb_utils
from trtglm.chatglm.chat import ReplyStream, reply_text
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import TrtglmError, UsageError, is_busy
from trtglm.request_config import check_return_sequences

log = logging.getLogger(__name__)

# the ensemble's steps, run here (contract.py)
TO_PREPROCESSING = feeds(ENSEMBLE, PREPROCESSING)  # client input -> preprocessing input
PREPROCESSED = feeds(PREPROCESSING, TENSORRT_LLM)  # preprocessing output -> tensorrt_llm input
PASSED = {client: llm for client, llm in feeds(ENSEMBLE, TENSORRT_LLM).items()  # client input -> tensorrt_llm input
          if llm not in REPLY_FORM_INPUTS}
REPLY_FORM = {llm: client for client, llm in feeds(ENSEMBLE, TENSORRT_LLM).items()  # applied here, not sent on
              if llm in REPLY_FORM_INPUTS}
ENGINE_OUTPUTS = names(for_backend(CONTRACT[TENSORRT_LLM].outputs, None))  # what either backend may send
# ChatGLM3 is decoder-only: these hold one pad id, and v0.7.1's tensorrt_llm does not declare them
DECODER_IDS = ("DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN")
# what every version of tensorrt_llm declares; the others are asked for only when the client's flag asks
ALWAYS_ASKED = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
LOG_PROBS = tuple(client_outputs_from(TENSORRT_LLM, None))  # of either backend, what the client gets as it is
REPORTED = ("finish_reason",)  # what only trtglm's runtime sends, passed on where this model declares it (with it)
ENDING = ("finish_reason", "num_output_tokens")  # what a stream's last response tells too: why it ended, its tokens
WAIT_S = 0.5  # longest wait for an engine response before looking whether the engine still runs


class EngineError(TrtglmError):
    """tensorrt_llm answered with an error; a full queue's is passed on as UNAVAILABLE (retry later)."""

    def __init__(self, message: str):
        busy = is_busy(message)
        super().__init__(f"{message}; retry later" if busy and "retry later" not in message else message)
        self.status = "UNAVAILABLE" if busy else "INVALID_ARG"


def engine_inputs(prepared: dict[str, np.ndarray], client: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """tensorrt_llm's input arrays: the preprocessed ones, then the client's sampling options."""
    arrays = {PREPROCESSED[name]: array for name, array in prepared.items()
              if name in PREPROCESSED and name not in DECODER_IDS}
    if arrays["embedding_bias"].shape[1] == 0:
        del arrays["embedding_bias"]
    batch = len(arrays["input_ids"])
    for name, engine_name in PASSED.items():
        if client.get(name) is not None:
            array = np.asarray(client[name])
            arrays[engine_name] = array if array.ndim > 2 else array.reshape(batch, -1)  # tables keep their shape
    return arrays


def streaming(client: dict[str, np.ndarray | None]) -> bool:
    stream = client.get("stream")
    return stream is not None and bool(np.asarray(stream).reshape(-1)[0])


class EngineCall:
    """One request to the engine, its responses read by a thread of their own so that the caller can stop
    waiting: Triton's response iterator waits forever once the engine's process is gone. After every
    WAIT_S without a response, `check()` is called; if it raises, the call is cancelled and that error
    ends the iteration."""

    _END = object()

    def __init__(self, engine_request, decoupled: bool, check: Callable[[], None]):
        self.check = check
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.iterator = None
        threading.Thread(target=self._read, args=(engine_request, decoupled), name="bls-engine", daemon=True).start()

    def _read(self, engine_request, decoupled: bool) -> None:
        try:
            self.iterator = engine_request.exec(decoupled=True) if decoupled else iter([engine_request.exec()])
            for response in self.iterator:
                self.responses.put(response)
            self.responses.put(self._END)
        except Exception as e:
            self.responses.put(e)

    def __iter__(self):
        """Lists of responses: each holds every response that arrived while the caller was busy."""
        while True:
            try:
                item = self.responses.get(timeout=WAIT_S)
            except queue.Empty:
                self._check()
                continue
            batch = []
            while item is not self._END and not isinstance(item, Exception):
                batch.append(item)
                try:
                    item = self.responses.get_nowait()
                except queue.Empty:
                    item = None
                    break
            if batch:
                yield batch
            if item is self._END:
                return
            if isinstance(item, Exception):
                raise item

    def _check(self) -> None:
        try:
            self.check()
        except Exception:
            self.cancel()
            raise

    def cancel(self) -> None:
        getattr(self.iterator, "cancel", lambda: None)()  # Triton 2.51's iterator has no cancel()


class ReplyTexts:
    """The text of one request's reply (all batch rows and beams) as engine responses arrive; a response of
    one batch row (batch_index `row`) holds that row alone."""

    def __init__(self, tokenizer: ChatGLMTokenizer, accumulate: bool):
        self.tokenizer, self.accumulate = tokenizer, accumulate
        self.streams: dict[tuple[int, int], ReplyStream] = {}
        self.texts: dict[tuple[int, int], str] = {}
        self.ids: dict[tuple[int, int], list[int]] = {}

    def add(self, output_ids: np.ndarray, lengths: np.ndarray, sequence: int | None = None,
            row: int | None = None) -> list[list[str]]:
        """Streamed: the new piece (or the text so far) per row and beam (one of several sequences: `sequence`)."""
        out = {}
        for key, ids in _sequences(output_ids, lengths, sequence, row):
            out[key] = self._shown(key, self.streams.setdefault(key, ReplyStream(self.tokenizer)).add(ids))
        return _grid(out)

    def ends(self, streamed: bool) -> dict[tuple[int, int], str]:
        """Per (row, beam): streamed, the held-back text at the end; else the whole text."""
        if streamed:
            return {key: self._shown(key, stream.finish()) for key, stream in sorted(self.streams.items())}
        return {key: reply_text(self.tokenizer, ids) for key, ids in sorted(self.ids.items())}

    def collect(self, output_ids: np.ndarray, lengths: np.ndarray, sequence: int | None = None,
                row: int | None = None) -> None:
        """Not streamed: remember ids (a response may carry all ids or the next part of them)."""
        for key, ids in _sequences(output_ids, lengths, sequence, row):
            self.ids.setdefault(key, []).extend(int(i) for i in ids)

    def whole(self) -> list[list[str]]:
        return _grid(self.ends(False))

    def _shown(self, key: tuple[int, int], piece: str) -> str:
        self.texts[key] = self.texts.get(key, "") + piece
        return self.texts[key] if self.accumulate and piece else piece


def _sequences(output_ids: np.ndarray, lengths: np.ndarray, sequence: int | None = None, row: int | None = None):
    """((row, beam), ids) of an engine response; a response of one batch row (`row`) or of one of several
    sequences holds that row or sequence alone, kept in its place."""
    for index in range(output_ids.shape[0]):
        for beam in range(output_ids.shape[1]):
            yield ((index if row is None else row, beam if sequence is None else sequence),
                   output_ids[index, beam, :min(int(lengths[index, beam]), output_ids.shape[2])])


Part = tuple[int, int | None]  # (batch_index, sequence_index or None): whose responses an engine response is


def _by_part(batch: list[dict[str, np.ndarray]]) -> list[tuple[Part, list[dict[str, np.ndarray]]]]:
    """Engine responses grouped by their batch_index (0 without one) and sequence_index (None without one),
    in order of arrival."""
    groups: dict[Part, list] = {}
    for outputs in batch:
        row, index = (outputs.get(name) for name in ("batch_index", "sequence_index"))
        key = (0 if row is None else int(row.reshape(-1)[0]), None if index is None else int(index.reshape(-1)[0]))
        groups.setdefault(key, []).append(outputs)
    return list(groups.items())


def _part_order(part: Part) -> tuple[int, int]:
    return part[0], -1 if part[1] is None else part[1]


def _grid(cells: dict[tuple[int, int], str]) -> list[list[str]]:
    rows: dict[int, list[str]] = {}
    for (row, _), text in sorted(cells.items()):
        rows.setdefault(row, []).append(text)
    return [rows[row] for row in sorted(rows)]


class TritonPythonModel:
    """Triton's entry point (decoupled or not, as the repository's decoupled_mode says)."""

    reported: tuple[str, ...] = ()  # of REPORTED, what this model's config declares (set by `initialize`)
    passed = LOG_PROBS  # tensorrt_llm's outputs the client gets as they are

    def initialize(self, args: dict) -> None:
        setup = triton_io.setup(args, BLS)
        config = setup.config
        self.tokenizer, self.limits = setup.tokenizer(), Limits.from_parameters(setup.params, setup.name)
        self.engine = setup.parameter(LLM_MODEL_NAME)
        self.engine_processes = triton_io.ModelProcesses(self.engine)
        self.accumulate = triton_io.bool_parameter(setup.params, ACCUMULATE_TOKENS, setup.name)
        self.max_return_sequences = triton_io.int_parameter(setup.params, MAX_RETURN_SEQUENCES, setup.name)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine_decoupled = self.decoupled  # tensorrt_llm answers as this model does (the repository's mode)
        self.dtypes = triton_io.output_dtypes(config)
        self.reported = tuple(name for name in REPORTED if name in self.dtypes)
        self.passed = LOG_PROBS + self.reported
        self.asked: set[str] | None = None  # the outputs the request in hand asked for (None: all)

    def execute(self, requests: list):
        """One request after another on this thread (see the module's docstring)."""
        if not self.decoupled:
            return [self._answer(request) for request in requests]
        for request in requests:
            self._stream(request)
        return None

    # --- one request ----------------------------------------------------------------------------

    def _prepare(self, request) -> tuple[dict, dict]:
        # the outputs this request's client asked for (None: all): a response carrying others crashed the stub
        # under gRPC streaming load on a GPU machine (Triton 2.51, Python 3.12 stub); one request at a time
        self.asked = triton_io.requested_outputs(request)
        client = triton_io.input_arrays(request, (*TO_PREPROCESSING, *PASSED, *REPLY_FORM.values(),
                                                  *names(BLS_ONLY_INPUTS)))
        for tensor in BLS_ONLY_INPUTS:
            why = refusal(tensor, client.pop(tensor.name))
            if why:
                raise UsageError(why)
        check_return_sequences(return_sequence_count(client), self.max_return_sequences)
        prepared = preprocess(self.tokenizer, self.limits,
                              {TO_PREPROCESSING[name]: client[name] for name in TO_PREPROCESSING})
        return client, engine_inputs(prepared, client)

    def _answer(self, request):
        """Non-decoupled: the whole reply in one response."""
        try:
            client, inputs = self._prepare(request)
            if streaming(client):
                raise UsageError("stream needs a decoupled repository (decoupled_mode true)")
            reply, log_probs = ReplyTexts(self.tokenizer, self.accumulate), {}
            for batch in self._generate(inputs, request):
                for outputs in batch:
                    reply.collect(outputs["output_ids"], outputs["sequence_length"])
                    log_probs.update({k: outputs[k] for k in self.passed if k in outputs})
            return self._response(reply.whole(), log_probs, client)
        except Exception as e:
            return triton_io.error_response(e)

    def _stream(self, request) -> None:
        """Decoupled: pieces as they come (or the whole reply when not streamed), then the final flag. Each
        prompt of a batch (batch_index) and each of num_return_sequences' sequences (sequence_index) has
        responses of its own, as tensorrt_llm sends them."""
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            client, inputs = self._prepare(request)
            stream = streaming(client)
            reply, log_probs = ReplyTexts(self.tokenizer, self.accumulate), {}
            for batch in self._generate(inputs, request):
                for (row, index), outputs in _by_part(batch):
                    log_probs[row, index] = _joined_log_probs([{k: o[k] for k in self.passed if k in o}
                                                               for o in outputs])
                    if not stream:
                        for o in outputs:
                            reply.collect(o["output_ids"], o["sequence_length"], index, row)
                        continue
                    texts = _joined([reply.add(o["output_ids"], o["sequence_length"], index, row) for o in outputs],
                                    self.accumulate)
                    if texts and (any(any(cells) for cells in texts) or _wants_token_outputs(client)):
                        sender.send(self._response(texts, log_probs[row, index], client, row, index))
            self._send_ends(sender, reply.ends(stream), log_probs, client, stream)
        except Exception as e:
            sender.send(triton_io.error_response(e), flags=final)

    def _send_ends(self, sender, texts: dict[tuple[int, int], str], log_probs: dict[Part, dict], client: dict,
                   stream: bool) -> None:
        """The end of the reply (the held-back streamed text, or the whole text with its log probs), then the
        final flag: one response, or with several parts (a batch's prompts, num_return_sequences' sequences)
        one for each part with something to send, then the final flag alone."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if set(log_probs) <= {(0, None)}:
            whole = _ending(log_probs.get((0, None), {})) if stream else log_probs.get((0, None), {})
            has_text = any(texts.values())
            sender.send(self._response(_grid(texts), whole, client) if has_text or not stream else None, flags=final)
            return
        for row, index in sorted(log_probs, key=_part_order):
            cells = [text for (at, column), text in sorted(texts.items()) if at == row and index in (None, column)]
            if any(cells) or not stream:
                sender.send(self._response([cells], _ending(log_probs[row, index]) if stream else log_probs[row, index],
                                           client, row, index))
        sender.send(None, flags=final)

    def _generate(self, inputs: dict[str, np.ndarray], request):
        """tensorrt_llm's responses as lists of {output name: array} (those that arrived while the caller
        was busy); EngineError when it answers with an error, ModelGone when its process is gone (before
        or while it generates)."""
        stubs = self.engine_processes.running()
        engine_request = pb_utils.InferenceRequest(
            model_name=self.engine, requested_output_names=[*asked_outputs(inputs), *self.reported],
            inputs=[pb_utils.Tensor(name, np.ascontiguousarray(array)) for name, array in inputs.items()])
        responses = EngineCall(engine_request, self.engine_decoupled, lambda: self.engine_processes.check(stubs))
        for batch in responses:
            arrived = [self._outputs(response) for response in batch]
            arrived = [outputs for outputs in arrived if "output_ids" in outputs and "sequence_length" in outputs]
            if arrived:
                yield arrived
            if triton_io.cancelled(request):
                responses.cancel()
                raise UsageError("request cancelled")

    def _outputs(self, response) -> dict[str, np.ndarray]:
        """The response's output arrays, copied: `as_numpy()` views the response's shared memory, which is freed
        with the response, and a view kept past it (log probs sent on later) crashed the stub under load."""
        if response.has_error():
            raise EngineError(f"{self.engine}: {response.error().message()}")
        outputs = {}
        for name in (*ENGINE_OUTPUTS, *self.reported):
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is not None:
                outputs[name] = np.array(tensor.as_numpy(), copy=True)
        return outputs

    def _response(self, texts: list[list[str]], log_probs: dict[str, np.ndarray], client: dict, row: int = 0,
                  sequence_index: int | None = None):
        """A response of `texts` [rows][beams], from the request's batch row `row` on; with batch_index when
        the request holds several prompts, and with `sequence_index` when given."""
        text = client.get(REPLY_FORM["input_text"])
        batch = 1 if text is None else len(text)
        prefixes = reply_prefixes(text, client.get(REPLY_FORM["exclude_input_in_output"]), streaming(client), batch)
        arrays = {"text_output": flat_texts(texts, prefixes[row:row + len(texts)]), **log_probs}
        for name, value in (("batch_index", row if batch > 1 else None), ("sequence_index", sequence_index)):
            if value is not None:
                arrays[name] = np.array([[value]], dtype=np.int32)
        if self.asked is not None:
            arrays = {name: array for name, array in arrays.items() if name in self.asked}
        return pb_utils.InferenceResponse(output_tensors=triton_io.output_tensors(arrays, self.dtypes))


def _joined(grids: list[list[list[str]]], accumulate: bool) -> list[list[str]]:
    """The pieces of several engine responses as one grid: concatenated, or with accumulate_tokens the
    last text so far."""
    if len(grids) == 1:
        return grids[0]
    cells = [[[grid[row][beam] for grid in grids] for beam in range(len(grids[-1][row]))]
             for row in range(len(grids[-1]))]
    if accumulate:
        return [[next((text for text in reversed(cell) if text), "") for cell in row] for row in cells]
    return [["".join(cell) for cell in row] for row in cells]


PER_TOKEN_AXIS = {"output_log_probs": -1, "generation_logits": 1}  # streamed: [1, 1, tokens], [1, tokens, 1, vocab]


def _joined_log_probs(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The log probs and logits of several engine responses as one: each token's in order, the last cumulative
    one."""
    joined = dict(parts[-1])
    for name, axis in PER_TOKEN_AXIS.items():
        if len(parts) > 1 and name in joined:
            joined[name] = np.concatenate([p[name] for p in parts if name in p], axis=axis)
    return joined


def _ending(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: array for name, array in outputs.items() if name in ENDING}


def return_sequence_count(inputs: dict[str, np.ndarray | None]) -> int:
    """num_return_sequences as the request gives it (1 when absent)."""
    array = inputs.get("num_return_sequences")
    return 1 if array is None or array.size == 0 else int(array.reshape(-1)[0])


def asked_outputs(inputs: dict[str, np.ndarray]) -> list[str]:
    """tensorrt_llm's outputs to ask for: those every version declares, and those the request's flags ask for."""
    several = return_sequence_count(inputs) > 1
    return [*ALWAYS_ASKED, *(name for flag, outputs in FLAGGED_OUTPUTS.items() if flag_set(inputs.get(flag))
                             for name in outputs), *["sequence_index"] * several,
            *["batch_index"] * (len(inputs["input_ids"]) > 1)]


def _wants_token_outputs(client: dict) -> bool:
    """Whether the client asks for something of every token (a streamed piece of no text still carries it)."""
    return any(flag_set(client.get(flag)) for flag in ("return_log_probs", "return_generation_logits"))
