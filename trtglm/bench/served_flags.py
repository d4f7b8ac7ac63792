"""`bench served`'s flags other than where the server is and where the results go, with the values they take
when left out: the command line's (trtglm/cli/bench.py) and the pipeline's (pipeline.py) alike."""

from __future__ import annotations

from dataclasses import dataclass

from trtglm.bench import DEFAULT_PROMPT, INFLIGHT_OUTPUTS, INFLIGHT_PROMPTS, range_flag
from trtglm.client import ANSWER_TIMEOUT_S


@dataclass(frozen=True)
class ServedFlags:
    engine_dir: str | None = None  # None: the server's engine folder
    device: str | None = None  # None: as the server picks it
    repeats: int = 20
    overhead_tokens: int = 128
    overhead_prompt: str = DEFAULT_PROMPT
    overhead_model: str = "ensemble"
    requests: int = 256
    concurrency: int = 64
    prompt_len: int = 128
    new_tokens: int = 128
    paths: str = "ensemble:http,ensemble:grpc,tensorrt_llm_bls:http,tensorrt_llm_bls:grpc"
    mixed_requests: int = 256
    mixed_concurrency: int = 64
    mixed_prompts: str = range_flag(INFLIGHT_PROMPTS)
    mixed_outputs: str = range_flag(INFLIGHT_OUTPUTS)
    mixed_paths: str = "ensemble:http,tensorrt_llm_bls:grpc"
    seed: int = 0
    timeout: float = ANSWER_TIMEOUT_S
    stop_after: float = 0.0  # seconds after which no new run starts (0: no limit)


SERVED_FLAGS = ServedFlags()
