"""Benchmarks: `trtglm bench serving` (serving.py) measures a launched model repository;
`trtglm bench served` (served.py, stream_load.py) streams to one next to its engine in-process;
`trtglm bench runtime` (runtime.py) the fast GPU runtime; pipeline.py runs the served benchmark
from nothing (model, engine, repository, timed launches)."""

from __future__ import annotations

from trtglm.client import DEFAULT_URL

DEFAULT_PROMPT = "What is the capital of France?"  # the test fixture's question


def serving(url: str = DEFAULT_URL, concurrency: str = "1,8,32", requests: int = 128, repeats: int = 50,
          max_tokens: int = 64, prompt: str = DEFAULT_PROMPT, model: str = "ensemble",
          engine_dir: str | None = None, device: str | None = None, out: str | None = None,
          timeout: float = 600.0, compare_replies: bool = True):
    """A served repository: Triton's overhead over the runtime, and tokens/s by concurrency.

    `bench serving --url URL`: --repeats sequential requests through --model against the same
    call to trtglm's runtime in-process (median/p90 ms), then --requests requests at each
    --concurrency level (comma-separated; `none` skips them) for generated tokens/s. --engine-dir
    defaults to the server's engine folder; --out DIR writes serving.json and serving.md;
    --compare-replies=False times random-weight replies without comparing their text.
    """
    from trtglm.bench.serving import run

    run(url=url, concurrency=concurrency, requests=requests, repeats=repeats, max_tokens=max_tokens, prompt=prompt,
        model=model, engine_dir=engine_dir, device=device, out=out, timeout=timeout,
        compare_replies=compare_replies)


def served_command(url: str = DEFAULT_URL, grpc: str | None = None, metrics_url: str | None = None,
                   engine_dir: str | None = None, device: str | None = None, repeats: int = 20,
                   overhead_tokens: int = 128, overhead_prompt: str = DEFAULT_PROMPT, overhead_model: str = "ensemble",
                   requests: int = 256, concurrency: int = 64, prompt_len: int = 128, new_tokens: int = 128,
                   paths: str = "ensemble:http,ensemble:grpc,tensorrt_llm_bls:http,tensorrt_llm_bls:grpc",
                   mixed_requests: int = 256, mixed_concurrency: int = 64, mixed_prompts: str = "32,1024",
                   mixed_outputs: str = "16,256", mixed_paths: str = "ensemble:http,tensorrt_llm_bls:grpc",
                   seed: int = 0, timeout: float = 600.0, stop_after: float = 0.0, out: str | None = None):
    """A served repository streamed to, next to the same engine in-process (random weights welcome).

    `bench served --url URL --grpc HOST:PORT --metrics-url URL/metrics`: Triton's overhead at
    --overhead-tokens (one request at a time, --repeats calls each); --requests streamed prompts
    of --prompt-len ids and --new-tokens each, --concurrency in flight, through each of --paths
    (MODEL:http for server-sent events, MODEL:grpc for tritonclient's stream) and in-process:
    tokens/s, requests/s, TTFT and inter-token p50/p99, served/in-process; the same for the mixed
    workload (--mixed-*; --mixed-requests 0 skips it). --out DIR writes served.json and served.md.
    (Named so as not to hide the served module of this package; `trtglm bench served` runs it.)
    """
    from trtglm.bench.served import run

    run(url=url, grpc=grpc, metrics_url=metrics_url, engine_dir=engine_dir, device=device, repeats=repeats,
        overhead_tokens=overhead_tokens, overhead_prompt=overhead_prompt, overhead_model=overhead_model,
        requests=requests, concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens, paths=paths,
        mixed_requests=mixed_requests, mixed_concurrency=mixed_concurrency, mixed_prompts=mixed_prompts,
        mixed_outputs=mixed_outputs, mixed_paths=mixed_paths, seed=seed, timeout=timeout, stop_after=stop_after,
        out=out)
