"""`trtglm bench KIND`: the benchmarks (trtglm/bench/), one function per kind."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from trtglm.bench import DEFAULT_PROMPT, INFLIGHT_OUTPUTS, INFLIGHT_PROMPTS, range_flag
from trtglm.bench.served_flags import SERVED_FLAGS as SERVED
from trtglm.cli.flags import CountInt, Passthrough, PosFloat, PosInt
from trtglm.client import ANSWER_TIMEOUT_S
from trtglm.conventions import MAX_NUM_TOKENS, TOKENS_PER_BLOCK
from trtglm.ports import HTTP_PORT, LOCAL_URL, METRICS_PORT


def serving(url: str = LOCAL_URL, concurrency: str = "1,8,32", requests: PosInt = 128, repeats: PosInt = 50,
            max_tokens: PosInt = 64, prompt: str = DEFAULT_PROMPT, model: str = "ensemble",
            engine_dir: str | None = None, device: str | None = None, out: str | None = None,
            timeout: PosFloat = ANSWER_TIMEOUT_S, compare_replies: bool = True):
    """A served repository: Triton's overhead over the runtime, and tokens/s by concurrency.

    `bench serving --url URL`: --repeats sequential requests through --model against the same
    call to trtglm's runtime in-process (median/p90 ms), then --requests requests at each
    --concurrency level (comma-separated; `none` skips them) for generated tokens/s. --engine-dir
    defaults to the server's engine folder; --out DIR writes serving.json and serving.md;
    --no-compare-replies times random-weight replies without comparing their text.
    """
    from trtglm.bench.serving import ServingSettings, bench_serving, markdown, parse_concurrency

    settings = ServingSettings(url=url, model=model, prompt=prompt, max_tokens=max_tokens,
                        concurrency=parse_concurrency(concurrency), requests=requests, repeats=repeats,
                        engine_dir=engine_dir, device=device, timeout=timeout, compare_replies=compare_replies)
    print(markdown(bench_serving(settings, out)), end="", flush=True)


def serving_local(work_dir: str = "/tmp/trtglm-bench-serving", config: str = "configs/tiny.yaml",
                  out: str | None = None, bench_flags: Passthrough = ()):
    """`bench serving` from nothing: build --config's engine, render its repository, launch it on free
    loopback ports, run `trtglm bench serving` (with the flags after `--`) against it, stop it."""
    from trtglm.bench.serving_local import run

    run(work_dir, config, out, list(bench_flags))


def served(url: str = LOCAL_URL, grpc: str | None = None, metrics_url: str | None = None,
           engine_dir: str | None = SERVED.engine_dir, device: str | None = SERVED.device,
           repeats: CountInt = SERVED.repeats, overhead_tokens: PosInt = SERVED.overhead_tokens,
           overhead_prompt: str = SERVED.overhead_prompt, overhead_model: str = SERVED.overhead_model,
           requests: CountInt = SERVED.requests, concurrency: PosInt = SERVED.concurrency,
           prompt_len: PosInt = SERVED.prompt_len, new_tokens: PosInt = SERVED.new_tokens, paths: str = SERVED.paths,
           mixed_requests: CountInt = SERVED.mixed_requests, mixed_concurrency: PosInt = SERVED.mixed_concurrency,
           mixed_prompts: str = SERVED.mixed_prompts, mixed_outputs: str = SERVED.mixed_outputs,
           mixed_paths: str = SERVED.mixed_paths, seed: CountInt = SERVED.seed, timeout: PosFloat = SERVED.timeout,
           stop_after: float = SERVED.stop_after, out: str | None = None):
    """A served repository streamed to, next to the same engine in-process (random weights welcome).

    `bench served --url URL --grpc HOST:PORT --metrics-url URL/metrics`: Triton's overhead at
    --overhead-tokens (one request at a time, --repeats calls each); --requests streamed prompts
    of --prompt-len ids and --new-tokens each, --concurrency in flight, through each of --paths
    (MODEL:http for server-sent events, MODEL:grpc for tritonclient's stream) and in-process:
    tokens/s, requests/s, TTFT and inter-token p50/p99, served/in-process; the same for the mixed
    workload (--mixed-*; --mixed-requests 0 skips it). --out DIR writes served.json and served.md.
    """
    flags = dict(locals())
    from trtglm.bench.served import run

    run(**flags)


def runtime(preset: Literal["tiny", "6b", "6b-32k"] = "6b", dtype: Literal["bfloat16", "float16"] = "bfloat16",
            weight_only: str = "none", batch: str = "1,8,32,64", prompt_len: PosInt = 128,
            new_tokens: PosInt = 128, baseline: Literal["hf", "none"] = "hf",
            out: str = "out/bench-runtime", layers: PosInt | None = None, long_prompt: PosInt = 512,
            requests: CountInt = 256, concurrency: PosInt = 64, prefill_chunk: PosInt = 1024, check: bool = True,
            profile: bool = True, tune: bool | None = None, seed: CountInt = 0, fixture: Path | None = None):
    """The fast GPU runtime against HF generate() and the bandwidth floor, on random 6B-shaped weights.

    --weight-only none|int8|int4 (comma-separated for several), --batch 1,8,32,64: decode batch
    sizes, --prompt-len/--new-tokens: forced lengths (EOS ignored), --baseline hf|none,
    --long-prompt N: TTFT of one N-token prompt, --requests/--concurrency: the in-flight run
    (0 requests skips it, bench inflight runs it alone), --prefill-chunk N: tokens a step of its executor
    carries (decode tokens and prompt chunks; longer prompts go in chunks beside the decoding requests), --layers N: fewer layers, --no-check / --no-profile
    skip those parts, --no-tune skips timing the matmul kernels' block shapes at start-up (and
    cuBLAS against the one-row kernel for float weights), --fixture DIR: a trained small ChatGLM3
    (e.g. tests/fixtures/tiny-chatglm3) whose logits are checked too. Writes OUT/runtime.json and
    OUT/runtime.png and prints a table.
    """
    flags = dict(locals())
    from trtglm.bench.runtime import bench_runtime

    bench_runtime(**flags)


def inflight(fixture: Path | None = None, preset: Literal["tiny", "6b", "6b-32k"] = "6b",
             weight_only: Literal["none", "int8", "int4"] = "none", requests: PosInt = 256, concurrency: PosInt = 64,
             prompts: str = range_flag(INFLIGHT_PROMPTS), outputs: str = range_flag(INFLIGHT_OUTPUTS),
             prefix: CountInt = 1000,
             max_num_tokens: PosInt = MAX_NUM_TOKENS, tokens_per_block: PosInt = TOKENS_PER_BLOCK, seed: CountInt = 0,
             out: str = "out/bench-inflight"):
    """The in-flight batching executor against the ideal of its parts, and a shared prefix with reuse off and on.

    --prompts/--outputs LOW,HIGH: uniform lengths; --prefix N: the shared system prompt's tokens;
    --max-num-tokens: tokens a step carries (decode tokens and prompt chunks); --fixture DIR: a small HF
    ChatGLM3 (e.g. tests/fixtures/tiny-chatglm3; the portable runtime on the CPU), else random --preset
    weights on the GPU. Prints generated tokens/s against the ideal, TTFT and inter-token p50/p99, and
    TTFT p50 with prefix reuse off and on; writes OUT/inflight.json.
    """
    flags = dict(locals())
    from trtglm.bench.inflight import bench_inflight

    bench_inflight(**flags)


def sampling(url: str | None = None, metrics_url: str | None = None, model: str = "ensemble",
             fixture: Path | None = None, preset: Literal["tiny", "6b", "6b-32k"] = "6b",
             cases: str = "greedy,top-p,top-k,log-probs", rounds: PosInt = 2, requests: PosInt = 64,
             concurrency: PosInt = 64, prompt_len: PosInt = 32, new_tokens: PosInt = 48, seed: CountInt = 0,
             timeout: PosFloat = ANSWER_TIMEOUT_S, out: str | None = None):
    """What sampled and log-prob requests cost next to greedy ones, in the same run.

    Cases (comma-separated, greedy included): greedy, top-p (temperature 0.8, top_p 0.8: ChatGLM3's
    defaults), top-k (temperature 0.8, top_k 50), log-probs (greedy with return_log_probs); --rounds
    of each in turn. In-process (no --url): the executor over --fixture DIR (e.g.
    tests/fixtures/tiny-chatglm3) or random --preset weights (GPU), random prompts of --prompt-len
    ids, no end id, exactly --new-tokens each. Served: --url and --metrics-url of a launch, streamed
    to --model's generate_stream, tokens from the server's counters. Prints tokens/s, wall ms per
    decode step and each case over greedy; --out DIR writes sampling.json.
    """
    flags = dict(locals())
    from trtglm.bench.sampling import bench_sampling

    bench_sampling(**{**flags, "fixture": str(fixture) if fixture else None})


def replicas(url: str = LOCAL_URL, replicas: PosInt = 1, model: str = "ensemble", per_replica: PosInt = 256,
             requests_per_slot: PosInt = 4, rounds: PosInt = 2, prompt_len: PosInt = 128, new_tokens: PosInt = 128,
             seed: CountInt = 0, timeout: PosFloat = ANSWER_TIMEOUT_S, out: str | None = None):
    """What a launch of --replicas N behind the front (--url) serves at --per-replica × N streams in flight: tokens/s
    summed over every replica's counters, TTFT p50/p99. --out DIR writes replicas.json; `python -m
    trtglm.bench.replicas DEST` compares DEST/replicas-N/ with one replica's (targets 2: ≥ 1.9×, 4: ≥ 3.7×).
    """
    flags = dict(locals())
    from trtglm.bench.replicas import bench_replicas

    bench_replicas(**flags)


def latency(url: str = LOCAL_URL, metrics_url: str | None = None, model: str = "ensemble",
            concurrency: str = "64,256", cases: str = "greedy,top-p", requests_per_slot: PosInt = 4,
            prompt_len: PosInt = 128, new_tokens: PosInt = 128, seed: CountInt = 0,
            timeout: PosFloat = ANSWER_TIMEOUT_S, out: str | None = None):
    """Where a streamed request's time goes when the server is full: at each --concurrency and --cases case, tokens/s
    (the server's counters at --metrics-url, default the HTTP port + 2), TTFT, the gap between stream events,
    genai-perf's inter-token latency, and the first token's path in parts (NVIDIA's perf metrics), against a full
    server's targets. --out DIR writes latency.json.
    """
    flags = dict(locals())
    from trtglm.bench.latency import bench_latency
    from trtglm.client.http import Server

    server = Server.parse(url)
    metrics_port = server.port + METRICS_PORT - HTTP_PORT  # beside the HTTP port, as Triton's defaults lie
    bench_latency(**{**flags, "metrics_url": metrics_url or f"http://{server.host}:{metrics_port}/metrics"})


def proxy(url: str = LOCAL_URL, direct_url: str | None = None, metrics_url: str | None = None,
          model: str = "ensemble", concurrency: str = "64,256", requests_per_slot: PosInt = 4, rounds: PosInt = 2,
          prompt_len: PosInt = 128, new_tokens: PosInt = 128, seed: CountInt = 0, timeout: PosFloat = ANSWER_TIMEOUT_S,
          out: str | None = None):
    """What the front (Envoy) of `launch --front` costs: the same streamed load through --url (the front) and
    straight at the replica (--direct-url, default the front's HTTP port + 100), in alternating rounds at each
    --concurrency; tokens/s from the server's counters (--metrics-url, default the replica's: the front's + 102),
    TTFT p50/p99, and the front against direct (targets ≥ 97 % of the tokens/s, ≤ +2 ms TTFT p50). --out DIR
    writes proxy.json.
    """
    flags = dict(locals())
    from trtglm.bench.proxy import bench_proxy

    bench_proxy(**flags)


def matmul(portable: bool = False, kinds: str = "bf16,int8,int4", rows: str = "1", out: str | None = None):
    """The decode matmuls on their own, on the GPU: every block shape of each kernel, 1 or more --rows."""
    from trtglm.bench.matmul import run

    run(portable, kinds, rows, out)


def pdl(kinds: str = "none,int8,int4", out: str | None = None):
    """Decode steps with and without programmatic dependent launch, on the GPU (--out: JSON results)."""
    from trtglm.bench.pdl import run

    run(kinds, out)


def prefill(kinds: str = "none,int8,int4", out: str | None = None):
    """One prompt's time to first token with the prefill CUDA graphs and launched eagerly, on the GPU."""
    from trtglm.bench.prefill import run

    run(kinds, out)


def step_parts(kinds: str = "int4", out: str | None = None):
    """What each kind of small kernel costs a batch-1 decode step, on the GPU (timing only)."""
    from trtglm.bench.step_parts import run

    run(kinds, out)


def tp(tp: str = "1,2,4", preset: Literal["tiny", "6b", "6b-32k"] = "6b", layers: PosInt | None = None,
       dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
       weight_only: Literal["none", "int8", "int4"] = "none", device: Literal["cuda", "cpu"] = "cuda",
       steps: PosInt = 128, batches: str = "1,64", prompt_len: PosInt = 128, new_tokens: PosInt = 128,
       max_seq_len: PosInt = 512, seed: CountInt = 0, tune: bool = True, out: str = "out/bench-tp"):
    """The fast runtime tensor-parallel over the GPUs here (one process each) against tp 1, on random weights.

    --tp 1,2,4: the sizes (those above the GPU count are skipped); the logits and --steps greedy tokens of a few
    prompts compared with tp 1's; the decode step and tokens/s at each of --batches (--prompt-len/--new-tokens);
    one step's all-reduces (as the model runs them; torch.distributed's and the one-shot kernel's apart) and logits
    gather alone; --no-tune skips timing the matmuls' block shapes at start-up.
    --device cpu: gloo and the torch ops (e.g. --preset tiny --dtype float32). Writes OUT/tp.json.
    """
    flags = dict(locals())
    from trtglm.bench.tp import run

    run(**flags)


def fp8(preset: Literal["tiny", "6b", "6b-32k"] = "6b", layers: PosInt | None = None,
        baseline_checkpoint: str | None = None, fp8_checkpoint: str | None = None, tokenizer_dir: str | None = None,
        prompts: str | None = None, calibration_prompts: str | None = None, parts: str = "accuracy,speed",
        steps: PosInt = 128, requests: PosInt = 256, concurrency: PosInt = 256, prompt_len: PosInt = 128,
        new_tokens: PosInt = 128, prefill_prompts: PosInt = 8, prefill_len: PosInt = 1024,
        max_num_tokens: PosInt = MAX_NUM_TOKENS, device: Literal["cuda", "cpu"] = "cuda", emulate_fp8: bool = False,
        fp8_kv_cache: bool = True, tune: bool = True, seed: CountInt = 0, out: str = "out/bench-fp8"):
    """FP8 against the same model unquantized, in one process: accuracy on real prompts, and speed on the GPU.

    Random --preset weights (bfloat16, and FP8 with an FP8 KV cache, or without with --no-fp8-kv-cache, calibrated as
    `convert --fp8` does, on --calibration-prompts or trtglm's own), or --baseline-checkpoint DIR --fp8-checkpoint
    DIR written by `trtglm convert` (tp 1). --tokenizer-dir encodes the prompts (--prompts FILE, default trtglm's
    held-out set). --parts accuracy: the logits' cosine similarity and top-1 agreement with the baseline's, teacher-forced on its greedy
    continuations, and greedy agreement over --steps; speed: --requests of --prompt-len → --new-tokens ids at
    --concurrency in flight through the executor (generated tokens/s), the batch-1 decode step, the prefill of
    --prefill-prompts × --prefill-len tokens (tokens/s), the weights held and the KV-cache positions. --device cpu
    --emulate-fp8: a dry run (FP8 in float32). Writes OUT/fp8.json.
    """
    flags = dict(locals())
    from trtglm.bench.fp8 import bench_fp8

    bench_fp8(**flags)


def convert(work_dir: str = "/tmp/trtglm-bench", json: str | None = None, repeats: PosInt = 3, clean: bool = False):
    """`trtglm convert` on a ChatGLM3-6B-shaped checkpoint against a plain `cp`: wall time and peak RSS."""
    from trtglm.bench.convert_speed import run

    run(work_dir, json, repeats, clean)


KINDS = {"serving": serving, "serving-local": serving_local, "served": served, "runtime": runtime, "inflight": inflight,
         "sampling": sampling, "proxy": proxy, "latency": latency, "replicas": replicas, "matmul": matmul, "pdl": pdl,
         "prefill": prefill, "step-parts": step_parts, "tp": tp, "fp8": fp8, "convert": convert}
