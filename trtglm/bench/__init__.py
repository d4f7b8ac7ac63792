"""Benchmarks: `trtglm bench serving` (serving.py) measures a launched model repository;
`trtglm bench runtime` (runtime.py) the fast GPU runtime."""

from __future__ import annotations

from trtglm.client import DEFAULT_URL

DEFAULT_PROMPT = "What is the capital of France?"  # the test fixture's question


def serving(url: str = DEFAULT_URL, concurrency: str = "1,8,32", requests: int = 128, repeats: int = 50,
          max_tokens: int = 64, prompt: str = DEFAULT_PROMPT, model: str = "ensemble",
          engine_dir: str | None = None, device: str | None = None, out: str | None = None,
          timeout: float = 600.0):
    """A served repository: Triton's overhead over the runtime, and tokens/s by concurrency.

    `bench serving --url URL`: --repeats sequential requests through --model against the same
    call to trtglm's runtime in-process (median/p90 ms), then --requests requests at each
    --concurrency level (comma-separated) for generated tokens/s. --engine-dir defaults to the
    server's engine folder; --out DIR writes serving.json and serving.md.
    """
    from trtglm.bench.serving import run

    run(url=url, concurrency=concurrency, requests=requests, repeats=repeats, max_tokens=max_tokens, prompt=prompt,
        model=model, engine_dir=engine_dir, device=device, out=out, timeout=timeout)
