"""The fast runtime tensor-parallel over the GPUs of one host, against tp 1.

For each tp size (default 1, 2 and 4; sizes above the GPU count are skipped), one process per GPU draws
the same random ChatGLM3-6B-shaped weights from one seed, keeps the tensors that `convert --tp-size N`
writes to its rank file, joins the other ranks (NCCL with NVLink multicast off: trtglm.runtime.distributed)
and runs a `FastModel` with its CUDA graphs, every rank making the same calls:

- correctness: a few prompts, each prefilled alone into slot 0 and decoded greedily for --steps steps;
  afterwards tp N is compared with tp 1: the largest |Δlogit| of the prefills and of the decode steps
  while the tokens agree, and for each prompt the first step whose greedy token differs (with tp 1's
  margin between its top two logits there: a margin below the differences is a rounding tie);
- speed: `bench runtime`'s decode timing (--prompt-len prompts, --new-tokens tokens): the decode step at
  each of --batches, and generated tokens/s (time to first token included);
- the collectives alone: one step's all-reduces (2 × layers of `[batch, hidden]`, in the compute dtype) as the
  model runs them (runtime/fast/parallel.py: the one-shot kernel over symmetric memory for decode-sized
  messages on GPUs, NCCL beyond), and apart: torch.distributed's (NCCL; gloo on the CPU) and the one-shot
  kernel's at every batch, its sums against NCCL's (whole numbers: equal; normal draws: the largest |Δ|); the
  gather of the logits; all timed as CUDA graphs as the decode graphs replay them; and rank 0's host time to
  tell the followers a decode step (`StepChannel.send`: its slots over gloo, the tokens' ids queued on the
  compute group), the followers receiving as a served follower does.

Prints the batch-1 step of tp N over tp 1's against the targets (≤ 0.6 at tp 2, ≤ 0.4 at tp 4), the one-shot
all-reduce of up to 64 rows against its targets (≤ 6 µs at tp 2, ≤ 8 µs at tp 4), and writes
OUT/tp.json. --device cpu runs the same code over gloo with the torch ops (e.g. --preset tiny --dtype
float32), as the tests do.

    trtglm bench tp [--tp 1,2,4] [--preset 6b] [--steps 128] [--batches 1,64] [--out DIR]
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trtglm.bench.collectives import (collective_times, one_shot_text, one_shot_verdicts, step_message_us,
                                      sync)
from trtglm.errors import DependencyError, UsageError

log = logging.getLogger(__name__)

TARGET_STEP_RATIO = {2: 0.6, 4: 0.4}  # batch-1 decode step of tp N over tp 1's
PROMPT_LENGTHS = (32, 100, 200)  # the correctness prompts
PR_SET_PDEATHSIG = 1  # Linux prctl: the signal a process gets when its parent dies


@dataclass(frozen=True)
class Options:
    preset: str
    layers: int | None
    dtype: str
    weight_only: str
    device: str
    steps: int
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    max_seq_len: int
    seed: int
    tune: bool  # time the matmuls' block shapes at start-up (kept on disk per GPU: kernel_cache.py)


def parse_sizes(text: str | int | tuple, what: str) -> tuple[int, ...]:
    """'1,2,4' (or fire's int / tuple) → (1, 2, 4); a clear UsageError for anything else."""
    items = text if isinstance(text, tuple | list) else str(text).split(",")
    try:
        sizes = tuple(int(str(item).strip()) for item in items)
    except ValueError:
        raise UsageError(f"--{what} takes whole numbers separated by commas, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--{what} takes numbers of at least 1, not {text!r}")
    return sizes


def run(*, tp: str, out: str, **options) -> dict:
    """Every tp size in turn (one process per rank), then the comparison; returns what OUT/tp.json holds."""
    sizes = parse_sizes(tp, "tp")
    opts = Options(**{**options, "batches": parse_sizes(options["batches"], "batches")})
    _check(opts, sizes)
    sizes = _sizes_that_fit(sizes, opts.device)
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="trtglm-bench-tp-") as work:
        for size in sizes:
            started = time.monotonic()
            _run_ranks(size, opts, Path(work))
            runs[size] = json.loads((Path(work) / f"tp{size}.json").read_text())
            runs[size]["wall_s"] = time.monotonic() - started
            print(_speed_line(size, runs[size]), flush=True)
        results = {"options": asdict(opts), "runs": {str(k): v for k, v in runs.items()},
                   "against_tp1": {str(size): compare(Path(work), size) for size in sizes if size != 1 and 1 in runs}}
    results["step_ratios"] = step_ratios(runs)
    for size, ratio in results["step_ratios"].items():
        target = TARGET_STEP_RATIO.get(int(size))
        verdict = f" (target ≤ {target}: {'met' if ratio <= target else 'missed'})" if target else ""
        print(f"tp {size}: batch-1 step {ratio:.2f} × tp 1's{verdict}", flush=True)
    results["one_shot_us"] = one_shot_verdicts(runs)
    for size, check in results["against_tp1"].items():
        print(_check_line(int(size), check), flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "tp.json").write_text(json.dumps(results, indent=1))
    return results


def _check(opts: Options, sizes: tuple[int, ...]) -> None:
    if opts.device not in ("cuda", "cpu"):
        raise UsageError(f"--device must be cuda or cpu, not {opts.device!r}")
    longest = max(PROMPT_LENGTHS) + opts.steps + 1
    if max(longest, opts.prompt_len + opts.new_tokens) > opts.max_seq_len:
        raise UsageError(f"--max-seq-len {opts.max_seq_len} is too short for {max(PROMPT_LENGTHS)}-token prompts and "
                         f"{opts.steps} steps, or --prompt-len + --new-tokens")
    if 1 not in sizes:
        log.warning("no tp 1 run: nothing to compare the others with")


def _sizes_that_fit(sizes: tuple[int, ...], device: str) -> tuple[int, ...]:
    if device == "cpu":
        return sizes
    from trtglm.bench.measure import cuda_device

    cuda_device("tp")  # a clear error without a GPU or Triton
    gpus = torch.cuda.device_count()
    fit = tuple(size for size in sizes if size <= gpus)
    for size in sorted(set(sizes) - set(fit)):
        print(f"tp {size}: skipped ({gpus} GPU(s) here)", flush=True)
    if not fit:
        raise DependencyError(f"no tp size of {sizes} fits the {gpus} GPU(s) here")
    return fit


def _run_ranks(size: int, opts: Options, work: Path) -> None:
    """One process per rank (started fresh: CUDA and NCCL state stay in them)."""
    import torch.multiprocessing as mp

    meeting = (work / f"meeting-tp{size}").as_uri()
    mp.start_processes(_rank_main, args=(size, opts, str(work), meeting), nprocs=size, start_method="spawn")


# --- one rank ----------------------------------------------------------------------------------------------------

def _rank_main(rank: int, size: int, opts: Options, work: str, meeting: str) -> None:
    from trtglm.runtime.distributed import RankInfo, join
    from trtglm.runtime.fast import FastModel

    _die_with_parent()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda", rank) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    started = time.monotonic()
    say = print if rank == 0 else lambda *_, **__: None  # progress, where a run that stalls stops
    joined = join(RankInfo(rank, size, rank, size), device, init_method=meeting)
    cfg, tensors, weights_sum = rank_tensors(opts, size, rank, device)
    say(f"tp {size}: ranks joined, weights drawn in {time.monotonic() - started:.1f} s", flush=True)
    model = FastModel(cfg, tensors, num_slots=max(opts.batches), max_seq_len=opts.max_seq_len, device=device,
                      weight_only=opts.weight_only, tune=None if opts.tune else False,
                      process_group=joined.collectives.group)
    del tensors
    say(f"tp {size}: model ready (kernels tuned, graphs captured) after {time.monotonic() - started:.1f} s",
        flush=True)
    same_weights = _same_on_every_rank(weights_sum, device)
    logits, ids = greedy_runs(model, opts)
    timings = [decode_timing(model, batch, opts) for batch in opts.batches]
    collectives = collective_times(model, opts.batches) if size > 1 else []
    for row in collectives:
        row["step_message_us"] = step_message_us(joined, device, row["batch"])
    say(f"tp {size}: measured after {time.monotonic() - started:.1f} s", flush=True)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({"prefill": logits[0], "decode": logits[1], "ids": ids}, str(Path(work) / f"tp{size}.safetensors"))
        report = {"tp": size, "device": _device_name(device), "weights_identical_on_ranks": same_weights,
                  "weight_gb_per_rank": model.weight_bytes / 1e9, "timings": timings, "collectives": collectives}
        (Path(work) / f"tp{size}.json").write_text(json.dumps(report))
    joined.close()
    sys.stdout.flush()
    os._exit(0)  # as a served rank's engine process ends: no teardown of CUDA graphs and NCCL at exit


def _die_with_parent() -> None:
    """A rank waiting in a collective for a peer that failed ends with the benchmark's process (when a timeout
    kills it, say) instead of holding its GPU."""
    import multiprocessing

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the rank lives on as before
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died while this rank was starting
        os._exit(1)


def rank_tensors(opts: Options, size: int, rank: int, device: torch.device):
    """(CheckpointConfig, this rank's tensors, a checksum of the drawn weights) of the random checkpoint."""
    from trtglm.bench.measure import checkpoint_tensors, synth_tensors

    hf_cfg, hf_tensors = synth_tensors(opts.preset, opts.layers, opts.dtype, opts.seed, device)
    weights_sum = sum(float(t.float().sum()) for t in hf_tensors.values())
    cfg, tensors = checkpoint_tensors(hf_cfg, hf_tensors, opts.dtype, size, rank)
    del hf_tensors
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cfg, tensors, weights_sum


def _same_on_every_rank(value: float, device: torch.device) -> bool:
    """Every rank drew the same weights (each draws them on its own GPU from one seed)."""
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(bool(torch.equal(v, mine)) for v in every)


def greedy_runs(model, opts: Options) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((prefill logits `[P, vocab]`, decode logits `[P, steps, vocab]`), greedy ids `[P, steps + 1]`), each
    prompt alone in slot 0."""
    generator = torch.Generator().manual_seed(opts.seed + 1)
    prefills, decodes, ids = [], [], []
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, model.vocab_size, (length,), generator=generator).tolist()
        first = model.prefill([0], [prompt])
        token, steps, tokens = first.argmax(-1), [], [first.argmax(-1)]
        for _ in range(opts.steps):
            logits = model.decode([0], token)
            token = logits.argmax(-1)
            steps.append(logits[0])
            tokens.append(token)
        model.release(0)
        prefills.append(first[0].cpu())
        decodes.append(torch.stack(steps).cpu())
        ids.append(torch.cat(tokens).cpu())
    return (torch.stack(prefills), torch.stack(decodes)), torch.stack(ids)


def decode_timing(model, batch: int, opts: Options) -> dict:
    """`bench runtime`'s timing: `batch` prompts prefilled together (timed after a warm-up), then new_tokens - 1
    greedy decode steps."""
    slots = list(range(batch))
    generator = torch.Generator().manual_seed(opts.seed + batch)
    prompts = torch.randint(0, model.vocab_size, (batch, opts.prompt_len), generator=generator).tolist()
    model.prefill(slots, prompts)  # warm-up
    sync(model.device)
    start = time.perf_counter()
    tokens = model.prefill(slots, prompts).argmax(-1)
    sync(model.device)
    prefilled = time.perf_counter()
    for _ in range(opts.new_tokens - 1):
        tokens = model.decode(slots, tokens).argmax(-1)
    sync(model.device)
    done = time.perf_counter()
    for slot in slots:
        model.release(slot)
    step_ms = (done - prefilled) * 1e3 / max(1, opts.new_tokens - 1)
    return {"batch": batch, "ttft_ms": (prefilled - start) * 1e3, "step_ms": step_ms,
            "tokens_per_s": batch * opts.new_tokens / (done - start)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --- the comparison ----------------------------------------------------------------------------------------------

def compare(work: Path, size: int) -> dict:
    """tp `size` against tp 1 (the tensors rank 0 of each run saved)."""
    from safetensors.torch import load_file

    base, split = load_file(str(work / "tp1.safetensors")), load_file(str(work / f"tp{size}.safetensors"))
    return compare_runs(base, split)


def compare_runs(base: dict[str, torch.Tensor], split: dict[str, torch.Tensor]) -> dict:
    """Largest |Δ| of the prefill logits and of the decode steps before each prompt's first differing token;
    per prompt that step (None: the same tokens throughout) and tp 1's top-two margin there."""
    prompts = []
    decode_diff = 0.0
    for row, (ids, other_ids) in enumerate(zip(base["ids"], split["ids"], strict=True)):
        differs = (ids != other_ids).nonzero()
        first = int(differs[0]) if differs.numel() else None
        agreed = ids.numel() - 1 if first is None else first  # decode steps fed the same tokens so far
        if agreed:
            decode_diff = max(decode_diff, _max_diff(base["decode"][row, :agreed], split["decode"][row, :agreed]))
        margin = None
        if first is not None:
            logits = base["prefill"][row] if first == 0 else base["decode"][row, first - 1]
            top = logits.topk(2).values
            margin = float(top[0] - top[1])
        prompts.append({"first_differing_step": first, "tp1_margin_there": margin})
    return {"prefill_max_abs_diff": _max_diff(base["prefill"], split["prefill"]), "decode_max_abs_diff": decode_diff,
            "steps": int(base["ids"].shape[1]) - 1, "prompts": prompts,
            "greedy_ids_equal": all(p["first_differing_step"] is None for p in prompts)}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def step_ratios(runs: dict[int, dict]) -> dict[str, float]:
    """Batch-1 decode step of each tp size over tp 1's (where both were timed at batch 1)."""
    def batch1(run: dict) -> float | None:
        return next((t["step_ms"] for t in run["timings"] if t["batch"] == 1), None)

    base = batch1(runs[1]) if 1 in runs else None
    return {str(size): batch1(run) / base for size, run in runs.items()
            if size != 1 and base and batch1(run) is not None}


def _speed_line(size: int, run: dict) -> str:
    timings = ", ".join(f"batch {t['batch']}: {t['step_ms']:.3f} ms/step, {t['tokens_per_s']:.0f} tokens/s"
                        for t in run["timings"])
    collectives = "; ".join(f"batch {c['batch']}: all-reduce {c['all_reduce_us']:.1f} µs × "
                            f"{c['all_reduces_per_step']} = {c['step_all_reduce_ms']:.3f} ms/step ("
                            f"torch.distributed {c['group_all_reduce_us']:.1f} µs" + one_shot_text(c) +
                            f"), logits gather {c['gather_logits_us']:.1f} µs, step message "
                            f"{c['step_message_us']:.1f} µs" for c in run["collectives"])
    same = "" if run["weights_identical_on_ranks"] else " WEIGHTS DIFFER BETWEEN RANKS"
    return f"tp {size} on {run['device']}: {timings}" + (f"; {collectives}" if collectives else "") + same


def _check_line(size: int, check: dict) -> str:
    equal = sum(p["first_differing_step"] is None for p in check["prompts"])
    parts = [f"tp {size} vs tp 1: prefill max |Δlogit| {check['prefill_max_abs_diff']:.4g}, decode "
             f"{check['decode_max_abs_diff']:.4g}; greedy tokens equal over {check['steps']} steps for {equal} of "
             f"{len(check['prompts'])} prompts"]
    for i, p in enumerate(check["prompts"]):
        if p["first_differing_step"] is not None:
            parts.append(f"prompt {i} parts at step {p['first_differing_step']} (tp 1's top-two margin there "
                         f"{p['tp1_margin_there']:.4g})")
    return "; ".join(parts)
