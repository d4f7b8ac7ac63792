"""The fast runtime tensor-parallel on the CPU: tp 2 and tp 4 checkpoints of the fixture, one process per rank
joined over gloo (the KV heads repeated across ranks at tp 4), each holding only its own rank file, run
one series of slot calls (prefill, greedy decode steps, a mixed step, score); rank 0's logits must be those
of transformers' `GlmForCausalLM` and of the tp-1 `FastModel`, token for token. The torch ops stand for the
Triton kernels here, and where Triton is installed the kernels run too, in its interpreter; on a host with
enough GPUs the same ranks run there too (NCCL, Triton kernels, the
collectives inside CUDA graphs), and scripts/bench_gpu.sh (PARTS=tp) checks the 6B shapes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from support.cli_calls import convert_checkpoint
from support.slot_calls import MIXED_CHUNK, prompts, run_calls

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.weights import HFWeights
from trtglm.errors import UsageError
from trtglm.runtime.fast import load_fast_model

TOL = {"cpu": 1e-4, "cpu-triton": 1e-4, "cuda": 1e-3}  # float32; on GPUs IEEE dot products in other orders
HAS_TRITON = importlib.util.find_spec("triton") is not None
STEPS = 6
MAX_BATCH, MAX_SEQ_LEN = 4, 64

# One rank: join the others (gloo on the CPU, NCCL on GPUs), load only this rank's file, make the calls; rank 0
# writes the logits.
RANK_PROGRAM = '''
import os, sys, torch
from safetensors.torch import save_file
from support.slot_calls import prompts, run_calls
from trtglm.runtime.distributed import RankInfo, join
from trtglm.runtime.fast import load_fast_model

checkpoint, rank, world, meeting, out, steps, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
    *sys.argv[4:6], int(sys.argv[6]), sys.argv[7]
torch.set_num_threads(1)
device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
ranks = join(RankInfo(rank, world, rank, world), device, init_method=meeting)
model = load_fast_model(checkpoint, rank=rank, process_group=ranks.collectives.group, device=device, num_slots=4,
                        max_seq_len=64, kernels="triton" if kind == "cpu-triton" else "auto")
results = run_calls(model, prompts(model.vocab_size), steps)
if rank == 0:
    save_file(results, out)
ranks.close()
os._exit(0)  # as a served rank's engine process ends (trtglm.runtime.distributed.Distributed.close)
'''


@pytest.fixture(scope="module")
def hf_cfg(fixture_dir) -> ChatGLMConfig:
    return ChatGLMConfig.from_model_dir(fixture_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, fixture_dir) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("fast-tp")
    return {tp: convert_checkpoint(fixture_dir, root / f"tp{tp}", dtype="float32", tp_size=tp) for tp in (1, 2, 4)}


@pytest.fixture(scope="module")
def tp1(checkpoints, hf_cfg) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = load_fast_model(checkpoints[1], device="cpu", num_slots=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    return run_calls(model, prompts(hf_cfg.vocab_size), STEPS)


def run_ranks(tmp_path: Path, checkpoint: Path, world: int, device: str, timeout: float = 300
              ) -> dict[str, torch.Tensor]:
    program, out = tmp_path / "rank.py", tmp_path / "rank0.safetensors"
    program.write_text(RANK_PROGRAM)
    meeting = (tmp_path / "meeting").as_uri()
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1",
           **({"TRITON_INTERPRET": "1"} if device == "cpu-triton" else {})}
    procs = [subprocess.Popen([sys.executable, str(program), str(checkpoint), str(rank), str(world), meeting, str(out),
                               str(STEPS), device], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
    return load_file(str(out))


def reference_logits(fixture_dir, hf_cfg, calls: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers gives for the same calls, teacher-forced on the tokens the calls generated."""
    model = load_reference(hf_cfg, HFWeights(fixture_dir).get, torch.float32)

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float()

    prompt_ids, ids = prompts(hf_cfg.vocab_size), calls["ids"].tolist()
    full = [logits(p + row[:STEPS + 1]) for p, row in zip(prompt_ids, ids)]
    spans = [f[len(p) - 1:len(p) + STEPS] for f, p in zip(full, prompt_ids)]  # prefill's position, then the steps'
    return {"prefill": torch.stack([s[0] for s in spans]),
            "decode": torch.stack([s[1:] for s in spans], dim=1),
            "mixed": torch.stack([full[0][len(prompt_ids[0]) + STEPS],
                                  logits(prompt_ids[1][:MIXED_CHUNK])[-1]]),
            "score": logits(prompt_ids[0]),
            "every_position": logits(prompt_ids[1])}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def gpus(world: int):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs")


@pytest.mark.slow
@pytest.mark.parametrize("world, device", [
    (2, "cpu"), (4, "cpu"),
    pytest.param(2, "cpu-triton", marks=pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason=(
        "Triton is not installed, or a GPU runs its kernels compiled (the cuda variants; Triton 3.6's interpreter, "
        "on the GPU machines' image, cannot run them)"))),
    pytest.param(2, "cuda", marks=gpus(2)), pytest.param(4, "cuda", marks=gpus(4))])
def test_tp_ranks_in_processes_give_the_logits_of_tp1_and_of_transformers(tmp_path, checkpoints, tp1, fixture_dir,
                                                                          hf_cfg, world, device):
    split = run_ranks(tmp_path, checkpoints[world], world, device)
    assert torch.equal(split["ids"], tp1["ids"])  # greedy tokens of every step
    reference = reference_logits(fixture_dir, hf_cfg, split)
    for name, expected in reference.items():
        assert split[name].shape == expected.shape, name
        assert max_diff(split[name], expected) <= TOL[device], name
        assert max_diff(split[name], tp1[name]) <= TOL[device], name
    assert len(set(split["ids"][:, -1].tolist())) > 1  # the slots' sequences differ: each attends to its own


def test_a_tp_checkpoint_without_its_ranks_is_refused(checkpoints):
    with pytest.raises(UsageError, match="tp_size 2 checkpoint runs one rank per process"):
        load_fast_model(checkpoints[2], device="cpu", max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(UsageError, match="rank 2 is outside the checkpoint's world size 2"):
        load_fast_model(checkpoints[2], rank=2, device="cpu", max_seq_len=MAX_SEQ_LEN)


@pytest.mark.parametrize("runtime, expected", [("", "ShardedSlotModel"), ("auto", "ShardedSlotModel"),
                                               ("portable", "ShardedSlotModel"), ("fast", "FastModel")])
def test_the_served_runtime_is_the_portable_one_on_cpu_unless_the_fast_one_is_asked_for(checkpoints, monkeypatch,
                                                                                         runtime, expected):
    from trtglm.backend.engine import EngineInfo, slot_model
    from trtglm.runtime.distributed import RankInfo

    monkeypatch.setenv("TRTGLM_RUNTIME", runtime)
    engine = EngineInfo(checkpoints[1].parent, checkpoints[1], 1, MAX_BATCH, MAX_SEQ_LEN, MAX_SEQ_LEN, 576)
    model = slot_model(engine, RankInfo(0, 1, 0, 1), torch.device("cpu"))
    assert type(model).__name__ == expected and model.num_slots == MAX_BATCH


def test_an_unknown_runtime_is_refused(checkpoints, monkeypatch):
    from trtglm.backend.engine import EngineInfo, slot_model
    from trtglm.runtime.distributed import RankInfo

    monkeypatch.setenv("TRTGLM_RUNTIME", "turbo")
    engine = EngineInfo(checkpoints[1].parent, checkpoints[1], 1, MAX_BATCH, MAX_SEQ_LEN, MAX_SEQ_LEN, 576)
    with pytest.raises(UsageError, match=r"\$TRTGLM_RUNTIME must be one of auto, fast, portable, not 'turbo'"):
        slot_model(engine, RankInfo(0, 1, 0, 1), torch.device("cpu"))
