"""The tensor-parallel all-reduce of the fast runtime (runtime/fast/parallel.py), one process per rank: on the CPU
(gloo) every rank agrees there is no one-shot kernel and sums through the process group; on a host with two or
four GPUs the one-shot kernel over symmetric memory gives NCCL's sums, exactly, in every compute dtype, eagerly
and replayed from a CUDA graph, and messages above ONE_SHOT_MAX_BYTES go to NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

ROWS = (1, 64, 128)  # decode-sized messages at the 6B's width
WIDTH = 4096

# One rank: join the others, set up the model's collectives, and check the sums; rank 0 writes what it found.
RANK_PROGRAM = '''
import json, os, sys, torch, torch.distributed as dist
from trtglm.runtime.distributed import RankInfo, join
from trtglm.runtime.fast.parallel import ONE_SHOT_MAX_BYTES, RankGroup, summed_in

rank, world, meeting, out, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rows, width = [int(r) for r in sys.argv[6].split(",")], int(sys.argv[7])
device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
joined = join(RankInfo(rank, world, rank, world), device, init_method=meeting)
found = {}
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    group = RankGroup(joined.collectives.group, device, dtype)
    summed_size = summed_in(dtype).itemsize
    for n in [*rows, ONE_SHOT_MAX_BYTES // summed_size // width + 1]:  # the last: just above the one-shot's size
        def whole_numbers(r):  # rank r's partial sums: whole numbers, so every sum of them is exact
            draw = torch.Generator(device=device).manual_seed(10 * r + n)
            return torch.randint(-8, 9, (n, width), generator=draw, device=device)

        mine = whole_numbers(rank).to(dtype)
        total = sum(whole_numbers(r) for r in range(world))
        by_group = mine.clone()
        dist.all_reduce(by_group, group=joined.collectives.group)
        eager = group.all_reduce(mine.clone())
        replayed = torch.zeros_like(mine)
        if device.type == "cuda":  # captured as FastModel captures its steps (warmed up on a side stream first)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                replayed.copy_(mine)
                group.all_reduce(replayed)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                replayed.copy_(mine)
                group.all_reduce(replayed)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize(device)
        else:
            replayed = group.all_reduce(mine.clone())
        found[f"{str(dtype)[6:]}x{n}"] = {
            "one_shot": group.one_shot is not None and group.one_shot.takes(mine),
            "fits": mine.numel() * summed_size <= ONE_SHOT_MAX_BYTES,
            "eager_equal": bool(torch.equal(eager, by_group)), "replayed_equal": bool(torch.equal(replayed, by_group)),
            "exact": bool(torch.equal(by_group.long(), total))}
if rank == 0:
    with open(out, "w") as f:
        json.dump(found, f)
joined.close()
os._exit(0)  # as a served rank's engine process ends (NCCL's teardown after captured graphs can hang)
'''


def run_ranks(tmp_path, world: int, kind: str, timeout: float = 300) -> dict:
    program, out = tmp_path / "rank.py", tmp_path / "found.json"
    program.write_text(RANK_PROGRAM)
    meeting = (tmp_path / "meeting").as_uri()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(program), str(rank), str(world), meeting, str(out), kind,
                               ",".join(map(str, ROWS)), str(WIDTH)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
    return json.loads(out.read_text())


def gpus(world: int):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs")


@pytest.mark.slow
def test_on_the_cpu_every_rank_sums_through_the_process_group(tmp_path):
    found = run_ranks(tmp_path, 2, "cpu")
    assert len(found) == 3 * (len(ROWS) + 1)
    assert sum(case["fits"] for case in found.values()) == 3 + 2 + 2  # bfloat16: 1, 64 and 128 rows; the others 1, 64
    for name, case in found.items():
        assert not case["one_shot"], name
        assert case["eager_equal"] and case["replayed_equal"] and case["exact"], name


@pytest.mark.slow
@pytest.mark.parametrize("world", [pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))])
def test_on_gpus_the_one_shot_kernel_gives_nccls_sums_and_large_messages_go_to_nccl(tmp_path, world):
    found = run_ranks(tmp_path, world, "cuda")
    for name, case in found.items():
        assert case["one_shot"] == case["fits"], name
        assert case["eager_equal"] and case["replayed_equal"] and case["exact"], name
