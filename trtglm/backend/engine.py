"""The engine as one rank of a server runs it: rank 0 an in-flight batching executor, the others a
follower thread (trtglm.runtime.distributed). Every rank loads only its own `rank{r}.safetensors`. At load
rank 0 runs one short request (prefill and decode) so that the first real one is not slow.

The `tensorrt_llm` model runs a `ServedEngine` in a process of its own (backend/engine_process.py); the
benchmarks run one in theirs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trtglm.conventions import FREE_GPU_MEM_FRACTION, TOKENS_PER_BLOCK
from trtglm.engine.manifest import read_manifest
from trtglm.errors import TrtglmError, UsageError
from trtglm.files import report_phase
from trtglm.runtime.distributed import (Collectives, Distributed, LeaderSlotModel, RankInfo, StepChannel, follow,
                                        join, rank_info)
from trtglm.runtime.executor import Executor, Output, Request
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.slots import SlotModel

log = logging.getLogger(__name__)

QUEUE_PER_SLOT = 8  # waiting requests per slot when the config sets no max_queue_size
WARM_UP_PROMPT = (1, 2, 3, 4)


@dataclass(frozen=True)
class EngineInfo:
    engine_dir: Path  # on GPUs, its kernels/ folder keeps what the start compiles and tunes (kernel_cache.py)
    checkpoint_dir: Path
    world_size: int  # tp × pp
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokenizer_size: int  # ids the tokenizer can decode; the engine's vocabulary may be padded past them
    tokens_per_block: int = TOKENS_PER_BLOCK  # KV-cache block: the unit of admission and prefix reuse
    max_beam_width: int = 1


def engine_info(engine_dir: str | Path) -> EngineInfo:
    manifest = read_manifest(engine_dir)
    if manifest.engine != "torch":
        raise UsageError(f"{engine_dir} holds a {manifest.engine} engine; the python backend serves torch engines "
                         "(NVIDIA's tensorrtllm backend serves TensorRT ones)")
    limits, build = manifest.limits, manifest.profile.get("build")
    block = build.get("tokens_per_block", TOKENS_PER_BLOCK) if isinstance(build, dict) else TOKENS_PER_BLOCK
    return EngineInfo(Path(engine_dir), manifest.checkpoint_dir, manifest.mapping.world_size, limits.max_batch_size,
                      limits.max_seq_len, limits.max_num_tokens, manifest.tokenizer.vocab_size, int(block),
                      limits.max_beam_width)


def pick_device(info: RankInfo, requested: str | None = None) -> torch.device:
    """$TRTGLM_DEVICE or `requested` if given; else this rank's GPU when there are GPUs, else the CPU."""
    requested = requested or os.environ.get("TRTGLM_DEVICE")
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


RUNTIMES = ("auto", "fast", "portable")  # $TRTGLM_RUNTIME: auto is the fast runtime on GPUs, the portable one on CPU


def slot_model(engine: EngineInfo, info: RankInfo, device: torch.device, group: Collectives | None = None,
               kv_fraction: float = FREE_GPU_MEM_FRACTION) -> SlotModel:
    """This rank's SlotModel: the fast one on GPUs when it loads (one GPU per rank), else the portable one
    ($TRTGLM_RUNTIME: see RUNTIMES). Its slots are max_batch_size × max_beam_width (a beam takes a slot), the
    sequences TensorRT-LLM sizes its KV cache for; the fast one's paged KV cache takes `kv_fraction` of the GPU
    memory left after the weights (at most what those slots can hold)."""
    slots = engine.max_batch_size * engine.max_beam_width
    from trtglm.runtime.model import load_model
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    runtime = os.environ.get("TRTGLM_RUNTIME") or "auto"
    if runtime not in RUNTIMES:
        raise UsageError(f"$TRTGLM_RUNTIME must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    rank = info.rank if info.world_size > 1 else None
    if runtime == "fast" or (runtime == "auto" and device.type == "cuda"):
        try:
            from trtglm.runtime.fast import kernel_cache, load_fast_model

            if device.type == "cuda":  # what the start compiles and tunes is kept with the engine
                kernel_cache.use(engine.engine_dir, device)
            return load_fast_model(engine.checkpoint_dir, rank=rank, process_group=group.group if group else None,
                                   num_slots=slots, max_seq_len=engine.max_seq_len, device=device,
                                   block_size=engine.tokens_per_block, kv_fraction=kv_fraction)
        except ImportError as e:
            log.warning("the fast GPU runtime is not available (%s); using the portable one", e)
    model = load_model(engine.checkpoint_dir, device=device, rank=rank, group=group)
    return ShardedSlotModel(model, slots, engine.max_seq_len)


class ServedEngine:
    """The engine as one rank of a server runs it: rank 0 an executor, the others a follower thread."""

    def __init__(self, engine_dir: str | Path, max_queue: int | None = None, info: RankInfo | None = None,
                 device: str | None = None, warm_up: bool = True, kv_cache_reuse: bool = False,
                 kv_fraction: float = FREE_GPU_MEM_FRACTION):
        started = time.monotonic()
        self.engine = engine_info(engine_dir)
        self.info = info or rank_info()
        if self.info.world_size != self.engine.world_size:
            raise UsageError(f"{self.info.world_size} rank(s) serve an engine of tp × pp = {self.engine.world_size} "
                             f"({engine_dir}); launch with --world-size {self.engine.world_size}")
        self.device = pick_device(self.info, device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.info.local_size)))
        self.distributed: Distributed | None = None
        if self.info.world_size > 1:
            self.distributed = join(self.info, self.device)
            log.info("rank %d: joined %d ranks in %.2f s", self.info.rank, self.info.world_size,
                     time.monotonic() - started)
        group = self.distributed.collectives if self.distributed else None
        log.info("rank %d: loading the model on %s", self.info.rank, self.device)
        report_phase("weights")
        loading = time.monotonic()
        model = slot_model(self.engine, self.info, self.device, group, kv_fraction)
        log.info("rank %d: model loaded in %.2f s (weights; on GPUs also kernel tuning and CUDA graphs)",
                 self.info.rank, time.monotonic() - loading)
        self.executor: Executor | None = None
        self.follower: threading.Thread | None = None
        if self.info.rank == 0:
            if self.distributed:
                model = LeaderSlotModel(model, self.distributed.steps(self.device))
            self.model = model
            self.executor = Executor(model, max_queue or QUEUE_PER_SLOT * self.engine.max_batch_size,
                                     max_num_tokens=self.engine.max_num_tokens, device=self.device,
                                     vocab_limit=self.engine.tokenizer_size, max_beam_width=self.engine.max_beam_width,
                                     tokens_per_block=self.engine.tokens_per_block, kv_cache_reuse=kv_cache_reuse)
            log.info("rank 0: up to %d tokens a step; KV-cache reuse %s (blocks of %d tokens)",
                     self.engine.max_num_tokens, "on" if kv_cache_reuse else "off", self.engine.tokens_per_block)
            self.executor.start()
            if warm_up:
                report_phase("warm-up requests")
                warming = time.monotonic()
                self.warm_up()
                log.info("rank 0: warm-up request in %.2f s", time.monotonic() - warming)
        else:
            self.model = model
            self.follower = threading.Thread(target=_follow_on, args=(self.device, model,
                                                                      self.distributed.steps(self.device)),
                                             name="trtglm-follower", daemon=True)
            self.follower.start()
        report_phase("engine ready; Triton loads the other models")
        log.info("rank %d of %d ready on %s: %s", self.info.rank, self.info.world_size, self.device,
                 self.engine.checkpoint_dir)
        log.info("rank %d: engine set up in %.2f s", self.info.rank, time.monotonic() - started)

    def warm_up(self) -> None:
        """Requests of each way to choose a token (greedy; sampled by temperature alone; by top-p with log
        probabilities), so that what a step compiles on first use (the sampler's GPU kernel) is ready first."""
        prompt = [t % self.model.vocab_size for t in WARM_UP_PROMPT]
        requests = [Request(prompt, 2), Request(prompt, 2, sampling=SamplingConfig(temperature=1.0, seed=0)),
                    Request(prompt, 2, sampling=SamplingConfig(temperature=0.8, top_p=0.8, seed=0),
                            output=OutputConfig(return_log_probs=True))]
        for request in requests:  # one at a time: the queue may hold only one
            outputs: list[Output] = []
            self.executor.submit(request, outputs.append).done.wait()
            if outputs and outputs[-1].error:
                raise TrtglmError(f"warm-up failed: {outputs[-1].error}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests; rank 0 tells the followers to stop; leave the process groups."""
        if self.executor is not None:
            self.executor.stop(timeout)
            if isinstance(self.model, LeaderSlotModel):
                _with_deadline(self.model.stop_followers, timeout)
        elif self.follower is not None:
            self.follower.join(timeout)
        if self.distributed is not None and (self.follower is None or not self.follower.is_alive()):
            # The ranks leave together (a barrier), so allow for the slowest one on a busy host.
            _with_deadline(self.distributed.close, max(timeout, LEAVE_TIMEOUT_S))


LEAVE_TIMEOUT_S = 60.0


def _follow_on(device: torch.device, model: SlotModel, channel: StepChannel) -> None:
    """`follow` on this thread with the rank's GPU current (a new thread starts on GPU 0, and the fast runtime's
    kernels launch on the current one)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    follow(model, channel)


def _with_deadline(call: Callable[[], None], timeout: float) -> None:
    """Run `call` on a daemon thread; give up waiting after `timeout` (a peer that is gone may block it)."""
    thread = threading.Thread(target=_quietly, args=(call,), daemon=True)
    thread.start()
    thread.join(timeout)


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as e:
        log.warning("while shutting down: %s", e)


def log_to_stderr() -> None:
    """trtglm's INFO lines reach the server's log (the python backend configures no logging)."""
    logger = logging.getLogger("trtglm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("trtglm %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
