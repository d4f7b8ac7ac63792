"""A generation request's settings, in one table (`REQUEST_FIELDS`) and grouped as TensorRT-LLM's executor groups
them: `SamplingConfig` (how tokens are chosen) and `OutputConfig` (what a response carries besides tokens).

A row of the table is one setting on its whole way: its field here, the ensemble's (and BLS model's) input that
carries it, tensorrt_llm's input (NVIDIA's names), their numpy type, its default and its bounds. Everything
reads it: the OpenAI-compatible API sends a request's settings as the ensemble's inputs (`client_inputs`), the
serving contract declares those inputs and tensorrt_llm's (backend/contract.py), the `tensorrt_llm` model reads
them back and checks them (`engine_settings`), and the executor's `Request` carries them to the token choice
(runtime/sampling.py). No torch here: the API process imports this module too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

from trtglm.errors import UsageError, int32_range_error


@dataclass(frozen=True)
class RequestField:
    """One setting: `config`, its name here (and the runtime's); `ensemble`, the ensemble's and BLS model's input
    (None: clients do not send it); `engine`, tensorrt_llm's input (NVIDIA's v0.19.0 name); `newer`, the name NVIDIA's
    v1.2.1 models take both inputs by too; `dtype`, numpy's name of both inputs' type; `default`; `low` and `high`,
    its bounds (`above_low`: low itself is out); `required`: every request gives it; `preprocessed`: it reaches
    tensorrt_llm through preprocessing, not as it is."""

    config: str
    ensemble: str | None
    engine: str
    dtype: str
    default: object
    low: float | None = None
    high: float | None = None
    above_low: bool = False
    newer: str | None = None
    required: bool = False
    preprocessed: bool = False

    def names(self, side: str) -> tuple[str, ...]:
        """The input names on the "ensemble" side or the "engine" side (tensorrt_llm)."""
        first = self.ensemble if side == "ensemble" else self.engine
        return tuple(name for name in (first, self.newer if first else None) if name)

    def cast(self, value) -> object:
        return {"float32": float, "bool": bool}.get(self.dtype, int)(value)

    def check(self, value, name: str | None = None) -> None:
        """UsageError naming the setting (`name`: as the input that brought it) when `value` is out of bounds."""
        name = name or self.config
        if self.dtype.startswith("int"):
            if self.low is not None and value < self.low:
                raise int32_range_error(name, value, int(self.low))
        elif self.dtype == "float32" and not self._within(value):
            raise UsageError(f"{name} must be {self._bounds(name)}, not {value:g}")

    def _within(self, value: float) -> bool:
        low = self.low is None or (value > self.low if self.above_low else value >= self.low)
        return math.isfinite(value) and low and (self.high is None or value <= self.high)

    def _bounds(self, name: str) -> str:
        if self.high is not None:
            return f"a number with {self.low:g} {'<' if self.above_low else '<='} {name} <= {self.high:g}"
        if self.low is None:
            return "a finite number"
        return f"a finite number greater than {self.low:g}" if self.above_low else \
            f"a finite number with {name} >= {self.low:g}"


REQUEST_FIELDS = (
    RequestField("max_tokens", "max_tokens", "request_output_len", "int32", None, low=1, required=True,
                 preprocessed=True),
    RequestField("temperature", "temperature", "temperature", "float32", 0.0, low=0),
    RequestField("top_k", "top_k", "runtime_top_k", "int32", 0, low=0),
    RequestField("top_p", "top_p", "runtime_top_p", "float32", 1.0, low=0, high=1, above_low=True),
    RequestField("seed", "random_seed", "random_seed", "uint64", None, newer="seed"),
    RequestField("min_tokens", "min_length", "min_length", "int32", 0, low=0, newer="min_tokens"),
    RequestField("repetition_penalty", "repetition_penalty", "repetition_penalty", "float32", 1.0, low=0,
                 above_low=True),
    RequestField("presence_penalty", "presence_penalty", "presence_penalty", "float32", 0.0),
    RequestField("frequency_penalty", "frequency_penalty", "frequency_penalty", "float32", 0.0),
    RequestField("beam_width", "beam_width", "beam_width", "int32", 1, low=1),
    RequestField("length_penalty", "length_penalty", "len_penalty", "float32", 1.0),
    RequestField("early_stopping", None, "early_stopping", "bool", 1),  # TensorRT-LLM's default 1 (True)
    RequestField("return_log_probs", "return_log_probs", "return_log_probs", "bool", False),
    RequestField("return_context_logits", "return_context_logits", "return_context_logits", "bool", False),
    RequestField("return_generation_logits", "return_generation_logits", "return_generation_logits", "bool", False),
)
FIELD = {field.config: field for field in REQUEST_FIELDS}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")  # sent together, read together (TensorRT-LLM's rule)


def _default(name: str):
    return FIELD[name].default


@dataclass(frozen=True)
class SamplingConfig:
    """How a request's tokens are chosen: TensorRT-LLM's executor `SamplingConfig` (the fields trtglm honours).

    Greedy when `temperature` is 0 or `top_k` is 1; otherwise temperature, then top-k (0: off), then top-p, drawn
    by `seed` (None: a random one). Penalties as TensorRT-LLM applies them (sampling.py); `min_tokens` holds the
    end id and one-token stop words back until that many tokens exist. `beam_width` above 1 searches beams
    (beams.py), which `length_penalty` and `early_stopping` steer."""

    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    seed: int | None = _default("seed")
    min_tokens: int = _default("min_tokens")
    repetition_penalty: float = _default("repetition_penalty")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    beam_width: int = _default("beam_width")
    length_penalty: float = _default("length_penalty")
    early_stopping: bool | int | str = _default("early_stopping")  # or transformers' "never"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)


@dataclass(frozen=True)
class OutputConfig:
    """What a request's outputs carry besides tokens: TensorRT-LLM's executor `OutputConfig` (the fields trtglm
    honours). Logits are computed only when asked: context logits run the prompt on its own."""

    return_log_probs: bool = _default("return_log_probs")
    return_context_logits: bool = _default("return_context_logits")  # the logits of every prompt position
    return_generation_logits: bool = _default("return_generation_logits")  # the logits each token was chosen from


def client_inputs(sampling: SamplingConfig, output: OutputConfig = OutputConfig(),
                  max_tokens: int | None = None) -> dict[str, tuple[object, str]]:
    """The ensemble's inputs that carry `sampling`, `output` and the output budget `max_tokens` (when given): input
    name -> (value, numpy dtype name). A setting at its default is not sent; sampling sends temperature, top_k and
    top_p together (TensorRT-LLM samples when top_k or top_p is above 0, and samples by temperature alone with
    top_p 1)."""
    values = {} if max_tokens is None else {"max_tokens": max_tokens}
    for config in (sampling, output):
        for item in fields(config):
            field, value = FIELD[item.name], getattr(config, item.name)
            if field.ensemble and value is not None and value != field.default:
                values[item.name] = value
    if sampling.temperature == 0:  # greedy: TensorRT-LLM's default
        values = {k: v for k, v in values.items() if k not in SAMPLING_FIELDS}
    else:  # sampled, or greedy by top_k 1 (the temperature still scales the penalties)
        values.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return {FIELD[name].ensemble: (value, FIELD[name].dtype) for name, value in values.items()}


def engine_settings(given: Callable[[RequestField], tuple[str, object] | None]
                    ) -> tuple[SamplingConfig, OutputConfig]:
    """A request's settings from tensorrt_llm's inputs, by TensorRT-LLM's rules: `given(field)` is (the input's name,
    its value) when the request gives the field's input. Each given value is checked against its bounds, named as
    the input; sampled only when top_k or top_p is above 0 (the temperature then 1 unless given), top_p 0 or less
    being unset."""
    values = {}
    for field in REQUEST_FIELDS:
        named = None if field.preprocessed else given(field)
        if named is None:
            continue
        values[field.config] = value = field.cast(named[1])
        if not (field.config == "top_p" and value <= 0):  # NVIDIA's backend drops top_p <= 0 as unset
            field.check(value, named[0])
    sampled = values.get("top_k", 0) > 0 or values.get("top_p", 0.0) > 0
    values["temperature"] = values.get("temperature", 1.0) if sampled else 0.0
    values["top_p"] = values["top_p"] if values.get("top_p", 0.0) > 0 else 1.0
    return tuple(config(**{f.name: values[f.name] for f in fields(config) if f.name in values})
                 for config in (SamplingConfig, OutputConfig))


def check_sampling(sampling: SamplingConfig, max_beam_width: int = 1) -> None:
    """UsageError for settings out of their bounds (NaN and infinities included), named as tensorrt_llm's inputs, or
    a beam search wider than `max_beam_width`."""
    for item in fields(sampling):
        value, field = getattr(sampling, item.name), FIELD[item.name]
        if value is not None and item.name != "early_stopping":
            field.check(value, field.engine)
    if sampling.beam_width > max_beam_width:
        raise UsageError(f"beam_width {sampling.beam_width} is outside 1..{max_beam_width} (the engine's "
                         "max_beam_width)")
    early_stopping_mode(sampling.early_stopping)


def check_return_sequences(count: int, limit: int, name: str = "num_return_sequences") -> None:
    """UsageError for more sequences of one prompt than the server allows (the profile's serve.max_return_sequences):
    each is a request of the engine's, so this is checked before any work."""
    if count > limit:
        raise UsageError(f"{name} {count} is more than this server allows ({limit}, its serve.max_return_sequences)")


MAX_WORDS = 64  # stop or bad words of one request: each is searched for at every step
MAX_WORD_BYTES = 256  # one stop or bad word's UTF-8 bytes


def check_words(words: list[str], name: str) -> None:
    """UsageError for more stop or bad words, or longer ones, than a request may bring (checked before any
    work: every word is tokenized and then matched at every step)."""
    if len(words) > MAX_WORDS:
        raise UsageError(f"{name}: at most {MAX_WORDS} words, not {len(words)}")
    for word in words:
        if len(word.encode()) > MAX_WORD_BYTES:
            raise UsageError(f"{name}: a word may hold at most {MAX_WORD_BYTES} bytes, not {len(word.encode())}")


def early_stopping_mode(value: bool | int | str) -> bool | str:
    """True, False or "never" from a bool, TensorRT-LLM's integer (1, 0, other) or transformers' string."""
    if isinstance(value, str):
        if value != "never":
            raise UsageError(f"early_stopping must be true, false or never, not {value!r}")
        return value
    return {1: True, 0: False}.get(int(value), "never")
