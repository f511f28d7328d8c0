"""One validated topology object (tensor x pipeline x data) and its process groups.

Rank order follows Megatron's default (tp fastest, then dp, then pp): tensor-parallel ranks are
adjacent, so a tensor-parallel group shares a node and its fast links.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fp8train import device as devices
from parallel.pipeline.engine import PipelineGroups

__all__ = [
    "Topology",
    "TopologyError",
    "init_distributed",
    "destroy_distributed",
    "gather_texts",
]


class TopologyError(ValueError):
    """An impossible parallel layout; the message names the config keys involved."""


@dataclass(frozen=True)
class Topology:
    """Sizes and this rank's coordinates; groups are attached by ``init_distributed``."""

    world_size: int
    rank: int
    tensor: int = 1
    pipeline: int = 1
    data: int = field(default=0)

    def __post_init__(self):
        for name in ("tensor", "pipeline"):
            value = getattr(self, name)
            if value < 1:
                raise TopologyError(f"parallel.{name}={value}: must be >= 1")
        model_parallel = self.tensor * self.pipeline
        if self.world_size % model_parallel:
            raise TopologyError(
                f"parallel.tensor={self.tensor} x parallel.pipeline={self.pipeline} = "
                f"{model_parallel} does not divide the world size {self.world_size}"
            )
        data = self.world_size // model_parallel
        if self.data not in (0, data):
            raise TopologyError(
                f"tensor {self.tensor} x pipeline {self.pipeline} x data {self.data} != "
                f"world size {self.world_size}"
            )
        object.__setattr__(self, "data", data)
        if not 0 <= self.rank < self.world_size:
            raise TopologyError(f"rank {self.rank} outside world size {self.world_size}")

    # Coordinates: rank = tp + tensor * (dp + data * pp)
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tensor) % self.data

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tensor * self.data)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline - 1

    def data_parallel_ranks(self) -> list[list[int]]:
        """Every data-parallel group: ranks that differ only in their dp coordinate."""
        groups = []
        for pp in range(self.pipeline):
            for tp in range(self.tensor):
                base = tp + self.tensor * self.data * pp
                groups.append([base + self.tensor * dp for dp in range(self.data)])
        return groups

    def tensor_parallel_ranks(self) -> list[list[int]]:
        """Every tensor-parallel group: adjacent ranks that differ only in their tp coordinate."""
        return [list(range(b, b + self.tensor)) for b in range(0, self.world_size, self.tensor)]

    def pipeline_ranks(self) -> list[list[int]]:
        """Every pipeline: ranks that differ only in their pp coordinate, in stage order."""
        stride = self.tensor * self.data
        return [list(range(b, self.world_size, stride)) for b in range(stride)]

    def embedding_ranks(self) -> list[list[int]]:
        """First and last stage of every pipeline: the two holders of a tied embedding."""
        return [[ranks[0], ranks[-1]] for ranks in self.pipeline_ranks()]


@dataclass
class ProcessGroups:
    """Process groups of one rank; a group is None where its dimension has one rank."""

    topology: Topology
    data: dist.ProcessGroup | None = None
    tensor: dist.ProcessGroup | None = None
    world: dist.ProcessGroup | None = None
    pipeline: PipelineGroups | None = None
    embedding: dist.ProcessGroup | None = None  # first + last stage (tied embedding copies)


def _attempt_store(backend: str) -> dist.Store | None:
    """The store this start of the workers' process groups rendezvous through, when the
    launcher's agent shares its own with them (``TORCHELASTIC_USE_AGENT_STORE=True``: plain
    torchrun); else None, and ``init_process_group`` makes its usual one (rank 0 hosts it at
    MASTER_ADDR:MASTER_PORT, new for every start of the workers).

    The agent's store outlives the workers: after a rank dies and torchrun restarts them
    (``--max-restarts``), the dead attempt's keys are still in it, among them every gloo rank's
    address (nccl's unique id likewise). A restarted rank that reads its peer's key before the
    peer has written its new one gets the dead process's address: it fails to connect, or
    waits for a connection that never comes (gloo's timeout: 30 minutes). Each start therefore
    gets keys of its own, under an id its ranks agree on (``_attempt_id``).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    timeout = (default_pg_nccl_timeout if backend == "nccl" else None) or default_pg_timeout
    # env:// as init_process_group reads it (MASTER_ADDR/PORT, RANK, WORLD_SIZE): with the
    # agent's store every rank connects to it as a client.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    attempt = _attempt_id(store, rank, world_size, timeout.total_seconds())
    return dist.PrefixStore(f"fp8train/attempt/{attempt}", store)


def _attempt_id(store: dist.Store, rank: int, world_size: int, timeout: float) -> str:
    """An id that every rank of this start of the workers gets and no earlier start had: rank
    0's random token. ``TORCHELASTIC_RESTART_COUNT`` is not one: each node's agent counts only
    the restarts its own workers caused, and one restarted because another node's rank died
    keeps its count.

    What a dead attempt left in the store may still be there, so every key read here is new
    to this start or a rank's latest: each rank posts its own token under its rank; rank 0
    answers the token it reads there (a dead predecessor's, until the live rank has posted)
    with its own, under that token; the rank confirms under rank 0's token. Rank 0 reads and
    answers again until every rank has confirmed.
    """
    token = uuid.uuid4().hex
    store.set(f"fp8train/rank/{rank}", token)
    if rank != 0:
        answer = f"fp8train/answer/{token}"
        store.wait([answer])
        attempt = store.get(answer).decode()
        store.set(f"fp8train/attempt/{attempt}/joined/{rank}", "1")
        return attempt
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + timeout
    while waiting:
        for peer in sorted(waiting):
            if store.check([f"fp8train/attempt/{token}/joined/{peer}"]):
                waiting.discard(peer)
            elif store.check([f"fp8train/rank/{peer}"]):
                theirs = store.get(f"fp8train/rank/{peer}").decode()
                if answered.get(peer) != theirs:
                    store.set(f"fp8train/answer/{theirs}", token)
                    answered[peer] = theirs
        if not waiting:
            return token
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank(s) {sorted(waiting)} did not join within {timeout:.0f} s "
                "(torch.distributed rendezvous through the agent's store)"
            )
        time.sleep(0.01)
    return token


def init_distributed(tensor: int = 1, pipeline: int = 1, backend: str = "auto"):
    """Initialise torch.distributed from torchrun's environment and build the groups.

    Works without torchrun too (a single process: world size 1, no process group).
    Returns ``(ProcessGroups, torch.device)``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    topology = Topology(world_size=world_size, rank=rank, tensor=tensor, pipeline=pipeline)
    if devices.is_cuda() and local_rank >= devices.device_count():
        raise TopologyError(
            f"LOCAL_RANK={local_rank} (rank {rank}) but this node has {devices.device_count()} "
            "CUDA device(s): start at most that many processes per node (--nproc_per_node), "
            "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU with gloo"
        )
    device = devices.get_device(local_rank)
    if backend == "auto":
        backend = devices.dist_backend()
    if backend == "nccl" and device.type != "cuda":
        raise TopologyError("parallel.backend=nccl needs CUDA; this machine has none (use gloo)")
    groups = ProcessGroups(topology)
    if world_size > 1:
        if not dist.is_initialized():
            kwargs = {"device_id": device} if backend == "nccl" else {}
            store = _attempt_store(backend)
            if store is not None:
                kwargs.update(store=store, rank=rank, world_size=world_size)
            dist.init_process_group(backend=backend, **kwargs)
        groups.world = dist.group.WORLD
        # new_group is collective: every rank creates every group, in the same order.
        for ranks in topology.data_parallel_ranks():
            group = dist.new_group(ranks) if len(ranks) < world_size else dist.group.WORLD
            if rank in ranks and len(ranks) > 1:
                groups.data = group
        for ranks in topology.tensor_parallel_ranks():
            group = dist.new_group(ranks) if len(ranks) < world_size else dist.group.WORLD
            if rank in ranks and len(ranks) > 1:
                groups.tensor = group
        if pipeline > 1:
            for ranks in topology.pipeline_ranks():
                # Three groups over the same ranks: activations and gradients each get their
                # own point-to-point stream (parallel/pipeline/engine.py), sums a third.
                made = [dist.new_group(ranks) for _ in range(3)]
                if rank in ranks:
                    groups.pipeline = PipelineGroups(ranks, *made)
            for ranks in topology.embedding_ranks():
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups.embedding = group
    return groups, device


def gather_texts(text: str, device: torch.device, limit: int = 512) -> list[str]:
    """Every rank's ``text`` (UTF-8, at most ``limit`` bytes), in rank order, over the default
    group; ``[text]`` without one. Collective: for the rare messages ranks must agree on (an
    error's cause), sent as bytes so that nothing is pickled."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [text]
    raw = text.encode()[:limit]
    code = torch.zeros(limit, dtype=torch.uint8)
    code[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    code = code.to(device)
    every = [torch.empty_like(code) for _ in range(dist.get_world_size())]
    dist.all_gather(every, code)
    return [bytes(x.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for x in every]


def destroy_distributed(together: bool = True) -> None:
    """Tear the process groups down. ``together``: a barrier first, so no rank closes its
    connections while a peer still has traffic on them; off after an error, which may have
    stopped only some ranks (a barrier would then wait for ones that never come)."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
