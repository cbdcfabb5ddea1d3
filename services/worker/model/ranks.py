"""One model over N tensor-parallel ranks: starting or joining the process group, rank 0's model, and
the other ranks' entry point.

Rank 0 is the worker process: it loads its shard and runs the engine. The other ranks are processes
that load theirs and follow rank 0's ops (rank_link.py). Rank 0 starts them itself (`python -m
services.worker.model.ranks`, with the variables torchrun sets), or, where those variables are set
already (torchrun, a Kubernetes LeaderWorkerSet), joins the group they describe. Backend: gloo on the
CPU, NCCL on CUDA. Forming the group and loading every rank's shard are bounded by `start_timeout_s`
(a rank's start, its imports and its load take seconds to minutes, more on a loaded machine); once
every rank has loaded, the step's collectives run in a group of their own bounded by `timeout_s`: a
rank that dies breaks the next collective at once, one that hangs makes it fail after the timeout;
either way the error ends rank 0's step loop, the worker reports NOT_SERVING and exits, and whatever
supervises it restarts the group as one. While rank 0 has no work it sends a heartbeat every quarter
of the timeout, so an idle follower never times out and a rank that died while nothing ran is
noticed within that quarter.

This module owns the group's processes and rank 0's view of the sharded model. It must not split
weights (tensor_parallel.py does) nor encode ops (rank_link.py does).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time, not in stubs

from services.worker.model.family import CausalLM
from services.worker.model.loader import load_model
from services.worker.model.rank_link import Leader, follow
from services.worker.model.tensor_parallel import CollectiveClock, Shard, reduce_rows, vocab_logits

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.model.attention import AttentionMetadata
    from services.worker.model.family import NativePaths, StackLayer
    from services.worker.model.kv_cache import KVCache
    from services.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)

# How long close() waits for the other ranks to exit after the stop op before killing them.
_EXIT_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank needs to load its shard the same way."""

    model_path: Path
    device: str
    dtype: torch.dtype
    kv_cache_dtype: str
    size: int
    timeout_s: float
    start_timeout_s: float
    threads: int | None = None


class TensorParallelLM(CausalLM):
    """Rank 0's shard, which sends each forward's plan to the other ranks before running its own."""

    def __init__(
        self,
        inner: CausalLM,
        leader: Leader,
        children: list[subprocess.Popen[bytes]],
        size: int,
        heartbeat_s: float,
    ) -> None:
        """`heartbeat_s`: the idle time after which `idle` sends the other ranks a heartbeat."""
        super().__init__()
        self.size = size
        self.inner = inner
        self.config = inner.config
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = inner.lm_head
        self.leader = leader
        self.rank_processes = children
        self.heartbeat_s = heartbeat_s
        self._cache: KVCache | None = None
        self._closed = False
        self._broken = False

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> Tensor:
        try:
            if cache is not self._cache:
                self.leader.cache(cache)
                self._cache = cache
            self.leader.step(input_ids, positions, meta)
            hidden: Tensor = self.inner(input_ids, positions, meta, cache)
        except BaseException:
            # A failed collective leaves the group unusable: close() must not wait on it again.
            self._broken = True
            raise
        return hidden

    def compute_logits(self, hidden: Tensor, vocab: slice | None = None) -> Tensor:
        if vocab is not None:
            raise ValueError(
                "a tensor-parallel model projects the whole vocabulary, shared out over its ranks"
            )
        try:
            self.leader.logits(hidden)
            return vocab_logits(self.inner, hidden, Shard(0, self.size), self.leader.clock, self.leader.group)
        except BaseException:
            self._broken = True
            raise

    @property
    def native_paths(self) -> NativePaths:
        return self.inner.native_paths

    def stack_layers(self) -> list[StackLayer] | None:
        return None

    @property
    def replayable(self) -> bool:
        return False

    def idle(self) -> None:
        if time.monotonic() - self.leader.last_sent >= self.heartbeat_s:
            try:
                self.leader.idle()
            except BaseException:
                self._broken = True
                raise

    def close(self) -> None:
        """Stop the other ranks (killed if they do not exit in time) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._broken:
            _reap(self.rank_processes, wait_s=0.0)
        else:
            self.leader.stop()
            _reap(self.rank_processes)
        dist.destroy_process_group()


def load_tensor_parallel(spec: RankSpec) -> LoadedModel:
    """Start (or join) the group, load rank 0's shard and return it as a model that drives the rest."""
    backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    start = timedelta(seconds=spec.start_timeout_s)
    children: list[subprocess.Popen[bytes]] = []
    if "WORLD_SIZE" in os.environ:
        _check_joined(spec.size)
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=spec.size, timeout=start)
    else:
        store = TCPStore("127.0.0.1", 0, spec.size, is_master=True, timeout=start, wait_for_workers=False)
        children = [_start_rank(spec, rank, store.port) for rank in range(1, spec.size)]
        try:
            dist.init_process_group(backend, store=store, rank=0, world_size=spec.size, timeout=start)
        except BaseException:
            _reap(children, wait_s=0.0)
            raise
    try:
        loaded = load_model(spec.model_path, _device(spec.device), spec.dtype, shard=Shard(0, spec.size))
        group = _step_group(spec)
    except BaseException:
        _reap(children, wait_s=0.0)
        dist.destroy_process_group()
        raise
    clock = CollectiveClock()
    reduce_rows(loaded.model, clock, group)
    leader = Leader(loaded.device, clock, group)
    model = TensorParallelLM(loaded.model, leader, children, spec.size, heartbeat_s=spec.timeout_s / 4)
    described = f"{loaded.weights_format}, tensor parallel over {spec.size} ranks"
    return replace(loaded, model=model, weights_format=described)


def _step_group(spec: RankSpec) -> dist.ProcessGroup:
    """Once this rank's shard is loaded: wait for every rank's (within the start bound), then the group
    of all ranks whose collectives the steps run, each bounded by `timeout_s`."""
    dist.barrier()
    group: dist.ProcessGroup = dist.new_group(timeout=timedelta(seconds=spec.timeout_s))
    return group


def collective_clock(model: CausalLM) -> CollectiveClock | None:
    """Rank 0's seconds in collectives, for a tensor-parallel model; None for any other."""
    return model.leader.clock if isinstance(model, TensorParallelLM) else None


def _check_joined(size: int) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    if world != size or rank != 0:
        raise ValueError(
            f"WORLD_SIZE={world}, RANK={rank} in the environment, tensor_parallel_size={size}: the worker "
            "is rank 0 of a group of exactly tensor_parallel_size ranks; set them to agree"
        )


def _device(setting: str) -> torch.device:
    if torch.device(setting).type != "cuda":
        return torch.device(setting)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _start_rank(spec: RankSpec, rank: int, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(spec.size),
    }
    return subprocess.Popen([sys.executable, "-m", __name__, *_arguments(spec), "--spawned"], env=env)


def _arguments(spec: RankSpec) -> list[str]:
    args = [
        "--model-path", str(spec.model_path),
        "--device", spec.device,
        "--dtype", str(spec.dtype).removeprefix("torch."),
        "--kv-cache-dtype", spec.kv_cache_dtype,
        "--timeout-s", str(spec.timeout_s),
        "--start-timeout-s", str(spec.start_timeout_s),
    ]  # fmt: skip
    return args + (["--threads", str(spec.threads)] if spec.threads is not None else [])


def _reap(children: list[subprocess.Popen[bytes]], wait_s: float = _EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank process %d did not exit in %.0f s: killing it", child.pid, wait_s)
            child.kill()
            child.wait()


def run_follower(spec: RankSpec, spawned: bool = False) -> int:
    """A rank above 0: join the group the environment describes, load this rank's shard, follow.
    `spawned`: started by rank 0 (which hosts the group's store), not by a launcher."""
    rank = int(os.environ["RANK"])
    # A launcher's SIGTERM (or a terminal's Ctrl-C) reaches every rank at once; rank 0 drains its
    # requests, which needs this rank, then sends stop. So this rank ends by rank 0's stop, a broken
    # group, or SIGKILL, never by those two.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    start = timedelta(seconds=spec.start_timeout_s)
    if spawned:
        # Rank 0 hosts the store itself (not a launcher's agent): join it as what it is.
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = TCPStore(address, port, spec.size, is_master=False, timeout=start)
        dist.init_process_group(backend, store=store, rank=rank, world_size=spec.size, timeout=start)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=spec.size, timeout=start)
    device = _device(spec.device)
    loaded = load_model(spec.model_path, device, spec.dtype, shard=Shard(rank, spec.size))
    group = _step_group(spec)
    reduce_rows(loaded.model, CollectiveClock(), group)
    follow(loaded.model, spec.kv_cache_dtype, loaded.device, Shard(rank, spec.size), group)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.worker.model.ranks --model-path P ...` with RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set: one rank above 0 of a tensor-parallel worker."""
    parser = argparse.ArgumentParser(prog="python -m services.worker.model.ranks", description=main.__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--start-timeout-s", type=float, required=True)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--spawned", action="store_true", help="started by rank 0, which hosts the store")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    spec = RankSpec(
        model_path=Path(args.model_path),
        device=args.device,
        dtype=getattr(torch, args.dtype),
        kv_cache_dtype=args.kv_cache_dtype,
        size=int(os.environ["WORLD_SIZE"]),
        timeout_s=args.timeout_s,
        start_timeout_s=args.start_timeout_s,
        threads=args.threads,
    )
    return run_follower(spec, spawned=args.spawned)


if __name__ == "__main__":
    sys.exit(main())
