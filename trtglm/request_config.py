"""A generation request's settings, grouped as TensorRT-LLM's executor groups them: `SamplingConfig` (how
tokens are chosen) and `OutputConfig` (what a response carries besides tokens).

One object of each travels the whole way: the OpenAI-compatible API builds them from its requests
and sends them as the ensemble's inputs (`client_inputs`: the one table of which input each field
is), the `tensorrt_llm` model reads them back from its inputs (backend/llm_requests.py), and the
executor's `Request` carries them to the token choice (runtime/sampling.py). No torch here: the API
process imports this module too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from trtglm.errors import UsageError


@dataclass(frozen=True)
class SamplingConfig:
    """How a request's tokens are chosen: TensorRT-LLM's executor `SamplingConfig` (the fields trtglm honours).

    Greedy when `temperature` is 0 or `top_k` is 1; otherwise temperature, then top-k (0: off), then top-p, drawn
    by `seed` (None: a random one). Penalties as TensorRT-LLM applies them (sampling.py); `min_tokens` holds the
    end id and one-token stop words back until that many tokens exist. `beam_width` above 1 searches beams
    (beams.py), which `length_penalty` and `early_stopping` steer."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | int | str = 1  # TensorRT-LLM's default 1 (True)

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

    return_log_probs: bool = False
    return_context_logits: bool = False  # the logits of every prompt position
    return_generation_logits: bool = False  # the logits each generated token was chosen from


# The ensemble's (and the BLS model's) inputs, NVIDIA's v0.19.0 names: field -> (input, numpy dtype name). A
# field at its default is not sent; sampling sends temperature, top_k and top_p together (TensorRT-LLM samples
# when top_k or top_p is above 0, and samples by temperature alone with top_p 1).
CLIENT_INPUTS = {
    "temperature": ("temperature", "float32"), "top_k": ("top_k", "int32"), "top_p": ("top_p", "float32"),
    "seed": ("random_seed", "uint64"), "min_tokens": ("min_length", "int32"),
    "repetition_penalty": ("repetition_penalty", "float32"), "presence_penalty": ("presence_penalty", "float32"),
    "frequency_penalty": ("frequency_penalty", "float32"), "beam_width": ("beam_width", "int32"),
    "length_penalty": ("length_penalty", "float32"),
    "return_log_probs": ("return_log_probs", "bool"), "return_context_logits": ("return_context_logits", "bool"),
    "return_generation_logits": ("return_generation_logits", "bool"),
}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")


def client_inputs(sampling: SamplingConfig, output: OutputConfig = OutputConfig()) -> dict[str, tuple[object, str]]:
    """The ensemble's inputs that carry `sampling` and `output`: input name -> (value, numpy dtype name)."""
    values = {}
    for config in (sampling, output):
        for item in fields(config):
            value = getattr(config, item.name)
            if item.name in CLIENT_INPUTS and value is not None and value != item.default:
                values[item.name] = value
    if sampling.temperature == 0:  # greedy: TensorRT-LLM's default
        values = {k: v for k, v in values.items() if k not in SAMPLING_FIELDS}
    else:  # sampled, or greedy by top_k 1 (the temperature still scales the penalties)
        values.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return {CLIENT_INPUTS[name][0]: (value, CLIENT_INPUTS[name][1]) for name, value in values.items()}


def check_sampling(sampling: SamplingConfig, max_beam_width: int = 1) -> None:
    """UsageError for settings that leave no distribution to draw from (NaN and infinities included)."""
    if not (0 <= sampling.temperature < math.inf and sampling.top_k >= 0 and 0 < sampling.top_p <= 1):
        raise UsageError("need a finite temperature >= 0, runtime_top_k >= 0 and 0 < runtime_top_p <= 1")
    if not 0 < sampling.repetition_penalty < math.inf:
        raise UsageError("repetition_penalty must be a finite number greater than 0, not "
                         f"{sampling.repetition_penalty:g}")
    for name in ("presence_penalty", "frequency_penalty", "length_penalty"):
        if not math.isfinite(getattr(sampling, name)):
            raise UsageError(f"{name} must be a finite number, not {getattr(sampling, name):g}")
    if sampling.min_tokens < 0:
        raise UsageError(f"min_tokens must be >= 0, not {sampling.min_tokens}")
    if not 1 <= sampling.beam_width <= max_beam_width:
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
