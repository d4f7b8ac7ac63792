"""Tensor parallelism across processes: one rank per process, combined through torch.distributed.

Under `trtglm launch --world-size N` (mpirun) every rank's tritonserver loads `tensorrt_llm`;
each learns its rank from Open MPI's environment (`OMPI_COMM_WORLD_RANK` / `_SIZE` /
`_LOCAL_RANK`, or PMIx's `PMIX_RANK`), holds only its own `rank{r}.safetensors` and joins two
process groups:

- compute (NCCL on GPUs, gloo on CPU): the all-reduce after `dense` and `proj` and the
  all-gather of the lm_head chunks in every forward (`Collectives`, the `Group` that
  `ShardedModel` combines its partial results with);
- control (gloo, CPU tensors): the meeting of the step link (step_link.py) and the leaving together.

Rank 0, which takes the requests, tells each call it makes on its `SlotModel` (prefill, prefill_all
and mixed step: slots, starts and pieces; decode: slots; reuse: slot, source and length; copy: source
and target slots; release: a slot; stop) over the step link before making it (`LeaderSlotModel`),
without waiting for the followers; they make the same calls (`follow`), so every collective meets its
partners. Followers wait for the next message without a deadline (an idle server is fine) and stop
when rank 0 says so or goes away (its end of the link closes). The ids of a step's decode tokens are
the token choice's output, on the device: rank 0 broadcasts them over the compute group, queued
behind that choice, so it never waits for the device to tell the followers a step (the executor
prepares the next step while the GPU runs); on the CPU they go in the step's message.

The ranks meet through `MASTER_ADDR` / `MASTER_PORT` (env://) when both are set, otherwise
through a file in the temporary folder named after the launch (`TRTGLM_LAUNCH_ID`, which
`trtglm launch` exports to every rank) and mpirun's job (`PMIX_NAMESPACE` /
`OMPI_MCA_ess_base_jobid`): all ranks of one launch find the same file, no port is needed,
and no two launches share one.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trtglm.conventions import keep_multicast_off
from trtglm.errors import UsageError
from trtglm.runtime.slots import SlotModel, prefill_starts
from trtglm.runtime.step_link import StepLink, connect

log = logging.getLogger(__name__)

COMPUTE_TIMEOUT = timedelta(minutes=30)  # a collective whose partner never comes (torch's default)
CONTROL_TIMEOUT = timedelta(days=365)  # a follower waits for rank 0's next step for as long as the server runs


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_size: int


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's place among the ranks, from Open MPI's (or PMIx's) environment; rank 0 of 1 alone."""
    env = os.environ if environ is None else environ

    def number(*names: str, default: int) -> int:
        for name in names:
            if env.get(name, "").strip():
                try:
                    return int(env[name])
                except ValueError:
                    raise UsageError(f"${name} must be a whole number, not {env[name]!r}") from None
        return default

    world = number("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "WORLD_SIZE", default=1)
    rank = number("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", default=0)
    local_rank = number("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", default=rank)
    local_size = number("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=world)
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside the world size {world}")
    return RankInfo(rank, world, local_rank, local_size)


def rendezvous(environ: Mapping[str, str] | None = None) -> str:
    """torch.distributed's init_method for the ranks of this launch (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return "env://"
    parts = [env.get("TRTGLM_LAUNCH_ID", ""), env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid", "")]
    key = "-".join(re.sub(r"[^A-Za-z0-9_.]", "_", p) for p in parts if p)
    if not key:
        raise UsageError("the ranks cannot find each other: start them with `trtglm launch` (or mpirun), or set "
                         "MASTER_ADDR and MASTER_PORT")
    return (Path(tempfile.gettempdir()) / f"trtglm-ranks-{key}").as_uri()


class Collectives:
    """`ShardedModel`'s group over processes: this process holds one rank's partial results."""

    def __init__(self, group: dist.ProcessGroup, world_size: int):
        self.group, self.world_size = group, world_size

    def all_reduce(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        (part,) = parts
        total = part.float()  # summed in float32, as LocalGroup sums
        dist.all_reduce(total, group=self.group)
        return total.to(part.dtype)

    def all_gather(self, parts: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
        (part,) = parts
        part = part.contiguous()
        chunks = [torch.empty_like(part) for _ in range(self.world_size)]
        dist.all_gather(chunks, part, group=self.group)
        return torch.cat(chunks, dim=dim)


@dataclass
class Distributed:
    """This process's membership: its rank, the compute collectives and the control group."""

    info: RankInfo
    collectives: Collectives
    control: dist.ProcessGroup
    init_method: str = ""
    link: StepLink | None = None

    def steps(self, device: torch.device) -> StepChannel:
        """The channel of rank 0's steps (the decode tokens' ids on `device`, this rank's). The first call is
        collective: every rank makes it, and the step link is made then."""
        if self.link is None:
            self.link = connect(self.info.rank, self.info.world_size, self.control, step_link_host(self.info))
        return StepChannel(self.link, self.collectives.group, device)

    def close(self) -> None:
        """Leave the groups together: a rank tearing gloo down while a peer still talks to it can abort."""
        if not dist.is_initialized():
            return
        try:
            dist.barrier(group=self.control)
        except RuntimeError as e:  # a peer is gone already: nothing to wait for
            log.debug("leaving without the others: %s", str(e).splitlines()[0])
        if self.link is not None:  # every rank past its last step, or gone
            self.link.close()
        if dist.get_backend(self.collectives.group) != "nccl":
            # NCCL's communicators stay: their teardown can wait without end on collectives that captured CUDA graphs
            # still hold, and every caller ends its process next (os._exit: no teardown at exit either).
            dist.destroy_process_group()
        if self.init_method.startswith("file://"):
            # gloo's file store removes its file only when its last user is collected, which
            # interpreter exit does not promise; every rank is past the barrier, so it is unused.
            Path(self.init_method[len("file://"):]).unlink(missing_ok=True)


def step_link_host(info: RankInfo, environ: Mapping[str, str] | None = None) -> str | None:
    """Rank 0's host for a step link over TCP, where the ranks span hosts (fewer on this host than in the world:
    MASTER_ADDR, where they met); None on one host."""
    env = os.environ if environ is None else environ
    if info.local_size >= info.world_size:
        return None
    if not env.get("MASTER_ADDR"):
        raise UsageError(f"the {info.world_size} ranks span hosts ({info.local_size} on this one) and need "
                         "MASTER_ADDR and MASTER_PORT to meet: start them with `trtglm launch --hostfile`")
    return env["MASTER_ADDR"]


def join(info: RankInfo, device: torch.device, init_method: str | None = None,
         timeout: timedelta = COMPUTE_TIMEOUT) -> Distributed:
    """Join the launch's process groups (blocks until every rank has joined)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        keep_multicast_off(os.environ)  # read when NCCL first starts, below
    init_method = init_method or rendezvous()
    log.info("rank %d of %d joining (%s, %s)", info.rank, info.world_size, backend, init_method)
    dist.init_process_group(backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Distributed(info, Collectives(dist.group.WORLD, info.world_size), control, init_method)


# --- rank 0's steps, told to the followers -------------------------------------------------------------

PREFILL, DECODE, RELEASE, STOP, MIXED, REUSE, COPY, PREFILL_ALL = 1, 2, 3, 4, 5, 6, 7, 8
DECODE_TOKEN = -1  # a mixed step's piece length for a decode token (its id is in `Step.tokens`)


@dataclass(frozen=True)
class Step:
    """One SlotModel call: `op`, its slots, and `data` (prefill and mixed step: starts, lengths (-1: a decode
    token), then all prompt ids; reuse: the slot, then [source, length]; copy: the targets, then the sources);
    `tokens`: the ids of its decode tokens (decode, mixed step), a tensor on the compute group's device."""

    op: int
    slots: list[int]
    data: list[int]
    tokens: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def prefill(cls, slots: Sequence[int], prompts: Sequence[Sequence[int] | None],
                starts: Sequence[int] | None = None, op: int = PREFILL, tokens: torch.Tensor | None = None) -> Step:
        starts = prefill_starts(starts, len(prompts))
        lengths = [DECODE_TOKEN if p is None else len(p) for p in prompts]
        return cls(op, list(slots), starts + lengths + [int(t) for p in prompts if p is not None for t in p], tokens)

    def starts(self) -> list[int]:
        return self.data[:len(self.slots)]

    def prompts(self) -> list[list[int] | None]:
        n = len(self.slots)
        lengths, ids = self.data[n:2 * n], self.data[2 * n:]
        out, start = [], 0
        for length in lengths:
            out.append(None if length == DECODE_TOKEN else ids[start:start + length])
            start += max(length, 0)
        return out


class StepChannel:
    """Rank 0 tells `Step`s: the numbers [op, slots, data, tokens] + slots + data over the step link, in one
    message; the decode tokens' ids over the compute group (`compute`, whose collectives run on `device`), or,
    on the CPU, in the same message."""

    def __init__(self, link: StepLink, compute: dist.ProcessGroup, device: torch.device, source: int = 0):
        self.link, self.compute, self.device, self.source = link, compute, device, source
        self.tokens_in_message = device.type == "cpu"  # host ids: no device to wait for, and one send fewer

    def send(self, step: Step) -> None:
        tokens = 0 if step.tokens is None else len(step.tokens)
        numbers = [step.op, len(step.slots), len(step.data), tokens] + step.slots + step.data
        if tokens and self.tokens_in_message:
            numbers += step.tokens.tolist()
        self.link.send(np.array(numbers, dtype=np.int64))
        if tokens and not self.tokens_in_message:  # queued on the device behind the choice that wrote them
            dist.broadcast(step.tokens.to(self.device, torch.int64), self.source, group=self.compute)

    def receive(self) -> Step:
        numbers = self.link.receive().tolist()
        op, n_slots, n_data, n_tokens = numbers[:4]
        body = numbers[4:4 + n_slots + n_data]
        if not n_tokens:
            tokens = None
        elif self.tokens_in_message:
            tokens = torch.tensor(numbers[4 + n_slots + n_data:], dtype=torch.int64)
        else:
            tokens = torch.empty(n_tokens, dtype=torch.int64, device=self.device)
            dist.broadcast(tokens, self.source, group=self.compute)
        return Step(op, body[:n_slots], body[n_slots:], tokens)


class LeaderSlotModel:
    """Rank 0's `SlotModel`: tells the followers each call, then makes it on its own shard."""

    def __init__(self, inner: SlotModel, channel: StepChannel):
        self.inner, self.channel = inner, channel
        self.vocab_size, self.num_slots, self.max_seq_len = inner.vocab_size, inner.num_slots, inner.max_seq_len
        self.kv_tokens = inner.kv_tokens

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                starts: Sequence[int] | None = None) -> torch.Tensor:
        step = Step.prefill(slots, prompts, starts)
        self.channel.send(step)
        return self.inner.prefill(slots, prompts, step.starts())

    def prefill_all(self, slot: int, chunk: Sequence[int], start: int = 0) -> torch.Tensor:
        self.channel.send(Step.prefill([slot], [chunk], [start], op=PREFILL_ALL))
        return self.inner.prefill_all(slot, chunk, start)

    def decode(self, slots: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=self.channel.device)
        self.channel.send(Step(DECODE, list(slots), [], tokens))
        return self.inner.decode(slots, tokens)

    def step(self, slots: Sequence[int], pieces: Sequence[Sequence[int] | None], starts: Sequence[int],
             decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        step = Step.prefill(slots, pieces, starts, op=MIXED, tokens=decode_ids)
        self.channel.send(step)
        return self.inner.step(slots, pieces, step.starts(), decode_ids=decode_ids)

    def reuse(self, slot: int, source: int, length: int) -> None:
        self.channel.send(Step(REUSE, [slot], [source, length]))
        self.inner.reuse(slot, source, length)

    def release(self, slot: int, keep: int = 0) -> None:
        self.channel.send(Step(RELEASE, [slot], [keep]))
        self.inner.release(slot, keep)

    def copy(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        self.channel.send(Step(COPY, list(targets), [int(s) for s in sources]))
        self.inner.copy(sources, targets)

    def stop_followers(self) -> None:
        self.channel.send(Step(STOP, [], []))


def follow(model: SlotModel, channel: StepChannel) -> None:
    """A follower's loop: make rank 0's calls on this rank's shard until rank 0 stops (or goes away).

    A call that fails here failed the same way on rank 0, which made it too (a request the model
    refuses), so the follower goes on with the next one, as rank 0's executor does.
    """
    steps = 0
    while True:
        try:
            step = channel.receive()
        except RuntimeError as e:  # gloo: the connection to rank 0 closed
            log.warning("rank 0 went away after %d step(s): %s", steps, str(e).splitlines()[0])
            return
        if step.op == STOP:
            log.info("rank 0 stopped after %d step(s)", steps)
            return
        try:
            _make(model, step)
        except Exception as e:
            log.warning("step %d (%s) failed: %s", steps, STEP_NAMES.get(step.op, step.op), e)
        steps += 1


STEP_NAMES = {PREFILL: "prefill", DECODE: "decode", RELEASE: "release", STOP: "stop", MIXED: "step", REUSE: "reuse",
              COPY: "copy", PREFILL_ALL: "prefill_all"}


def _make(model: SlotModel, step: Step) -> None:
    if step.op == PREFILL:
        model.prefill(step.slots, step.prompts(), step.starts())
    elif step.op == MIXED:
        model.step(step.slots, step.prompts(), step.starts(), decode_ids=step.tokens)
    elif step.op == PREFILL_ALL:
        model.prefill_all(step.slots[0], step.prompts()[0], step.starts()[0])
    elif step.op == DECODE:
        model.decode(step.slots, step.tokens)
    elif step.op == REUSE:
        model.reuse(step.slots[0], *step.data)
    elif step.op == RELEASE:
        model.release(step.slots[0], *step.data)
    elif step.op == COPY:
        model.copy(step.data, step.slots)
    else:
        raise UsageError(f"unknown step {step.op} from rank 0")
