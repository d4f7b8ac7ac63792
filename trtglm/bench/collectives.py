"""`bench tp`'s collectives alone, each rank running the same calls: one decode step's all-reduces as the model
runs them and apart (torch.distributed's; on GPUs the one-shot kernel's, with its sums against NCCL's), the
gather of the logits, timed as CUDA graphs as the decode graphs replay them; and rank 0's host time to tell
the followers a decode step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

TIMED_REPLAYS = 20
TARGET_ONE_SHOT_US = {2: 6.0, 4: 8.0}  # one all-reduce of `[1..64, 4096]` 16-bit values at tp N
TARGET_ONE_SHOT_ROWS = 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_times(model, batches: tuple[int, ...]) -> list[dict]:
    """One decode step's collectives alone at each batch (µs): its 2 × layers all-reduces as the model runs them,
    torch.distributed's and (GPUs) the one-shot kernel's apart, with its sums against NCCL's; its logits' gather."""
    from trtglm.runtime.fast.parallel import one_shot_all_reduce

    cfg, ranks, device = model.config, model.ranks, model.device
    calls = 2 * cfg.num_layers
    one_shot = None  # the kernel at every batch here: its buffer holds the largest (the model's, ONE_SHOT_MAX_BYTES)
    if device.type == "cuda":
        one_shot = one_shot_all_reduce(ranks.group, device, model.dtype, max(batches) * cfg.hidden_size)
    rows = []
    for batch in batches:
        partial = torch.zeros(batch, cfg.hidden_size, dtype=model.dtype, device=device)
        chunk = torch.zeros(batch, cfg.vocab_size // ranks.world_size, dtype=torch.float32, device=device)

        def per_call(reduce) -> float:
            return _replay_us(lambda: [reduce(partial) for _ in range(calls)], device) / calls

        row = {"batch": batch, "all_reduces_per_step": calls, "all_reduce_us": per_call(ranks.all_reduce),
               "group_all_reduce_us": per_call(lambda t: dist.all_reduce(t, group=ranks.group)),
               "one_shot_all_reduce_us": per_call(one_shot) if one_shot else None,
               "one_shot_sums": one_shot_sums(one_shot, ranks.group, partial) if one_shot else None,
               "gather_logits_us": _replay_us(lambda: ranks.gather_columns(chunk), device)}
        row["step_all_reduce_ms"] = row["all_reduce_us"] * calls / 1e3
        rows.append(row)
    return rows


def one_shot_sums(one_shot, group, like: torch.Tensor) -> dict:
    """The one-shot kernel's sums against NCCL's over values shaped as `like`, each rank drawing its own: whole
    numbers (every partial sum exact in any of these dtypes, so the two must be equal) and normal draws (the
    largest |Δ|: sums in another order round differently)."""
    draw = torch.Generator(device=like.device).manual_seed(1 + dist.get_rank(group))
    whole = torch.randint(-8, 9, like.shape, generator=draw, device=like.device).to(like.dtype)
    drawn = torch.randn(like.shape, generator=draw, device=like.device).to(like.dtype)
    by_group = [t.clone() for t in (whole, drawn)]
    for t in by_group:
        dist.all_reduce(t, group=group)
    by_one_shot = [one_shot(t.clone()) for t in (whole, drawn)]
    torch.cuda.synchronize(like.device)
    return {"whole_numbers_equal": bool(torch.equal(by_group[0], by_one_shot[0])),
            "drawn_max_abs_diff": float((by_group[1].float() - by_one_shot[1].float()).abs().max())}


def step_message_us(joined, device: torch.device, batch: int) -> float:
    """Rank 0's host µs per decode step of `batch` sequences told to the followers (each rank calls it: rank 0
    sends, the others receive)."""
    from trtglm.runtime.distributed import DECODE, Step

    channel = joined.steps(device)
    step = Step(DECODE, list(range(batch)), [], torch.zeros(batch, dtype=torch.int64, device=device))
    tell = (lambda: channel.send(step)) if joined.info.rank == 0 else channel.receive
    tell()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(TIMED_REPLAYS):
        tell()
    took = time.perf_counter() - start  # the host's time: the tokens' broadcasts are only queued
    sync(device)
    return took * 1e6 / TIMED_REPLAYS


def _replay_us(body, device: torch.device) -> float:
    """Microseconds per call of `body`: a replayed CUDA graph of it on a GPU, else the eager call."""
    body()  # warm-up (every rank: the calls are collective)
    run = body
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as FastModel captures collectives
            body()
        run = graph.replay
        run()
    sync(device)
    start = time.perf_counter()
    for _ in range(TIMED_REPLAYS):
        run()
    sync(device)
    return (time.perf_counter() - start) * 1e6 / TIMED_REPLAYS


def one_shot_text(collectives: dict) -> str:
    us, sums = collectives["one_shot_all_reduce_us"], collectives["one_shot_sums"]
    if us is None:
        return ", no one-shot kernel here"
    equal = "equal" if sums["whole_numbers_equal"] else "NOT EQUAL"
    return (f", one-shot {us:.1f} µs, its sums of whole numbers {equal} to NCCL's, of normal draws within "
            f"{sums['drawn_max_abs_diff']:.3g}")


def one_shot_verdicts(runs: dict[int, dict]) -> dict[str, float]:
    """Each tp size's slowest one-shot all-reduce of up to TARGET_ONE_SHOT_ROWS rows (µs), where timed; printed
    against its target."""
    slowest = {}
    for size, run in runs.items():
        times = [c["one_shot_all_reduce_us"] for c in run["collectives"]
                 if c["batch"] <= TARGET_ONE_SHOT_ROWS and c["one_shot_all_reduce_us"] is not None]
        if times:
            slowest[str(size)] = max(times)
    for size, us in slowest.items():
        target = TARGET_ONE_SHOT_US.get(int(size))
        verdict = f" (target ≤ {target}: {'met' if us <= target else 'missed'})" if target else ""
        print(f"tp {size}: one-shot all-reduce of up to {TARGET_ONE_SHOT_ROWS} rows at most {us:.1f} µs{verdict}",
              flush=True)
    return slowest
