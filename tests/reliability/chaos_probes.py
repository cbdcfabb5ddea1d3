"""What the chaos soak reads from a running stack: whether it is fully serving, its idle state, and
the resident memory of every process that served in it.

`fully_serving` asks every service's health and the gateway's ListModels (every configured worker
linked). `idle_state` is what must return exactly to its value before the load: per worker its
running, waiting and open requests, used KV blocks and free KV tokens (GetWorkerStats) and the credits
it offers a new Connect stream (the first ConnectResponse), per route the gateway's queued requests.
`RssSampler` samples each service's current process every interval from a thread, keyed by pid, so a
restarted service's new process is a new series, judged from a warm baseline after it began
serving. Every call is bounded by a timeout. This module must not signal a process nor assert
anything.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import psutil

from strata.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.reliability.harness import SERVING, health, worker_stats

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from strata.cli.launcher import StackAddresses

PROBE_TIMEOUT_S = 2.0


def linked(gateway: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the gateway has every configured worker of every route linked and ready."""
    with grpc.insecure_channel(gateway) as channel:
        try:
            models = gateway_pb2_grpc.GatewayStub(channel).ListModels(
                gateway_pb2.ListModelsRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return all(model.ready_workers >= model.configured_workers for model in models.models)


def fully_serving(addresses: StackAddresses) -> bool:
    """Every service SERVING on its address and the gateway linked to every worker."""
    services = (addresses.tokenizer, *addresses.workers, addresses.gateway)
    return all(health(address, timeout=PROBE_TIMEOUT_S) == SERVING for address in services) and linked(
        addresses.gateway
    )


def offered_credits(worker: str, timeout: float = 10.0) -> int:
    """The request credits the worker offers a new Connect stream, as its first ConnectResponse says."""
    with grpc.insecure_channel(worker) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=timeout)
        hello = worker_pb2.ConnectHello(
            model=info.model, tokenizer_fingerprint=info.tokenizer_fingerprint, client_name="chaos probe"
        )
        answered = threading.Event()

        def requests() -> Iterator[worker_pb2.ConnectRequest]:
            yield worker_pb2.ConnectRequest(hello=hello)
            answered.wait(timeout)

        call = stub.Connect(requests(), timeout=timeout)
        try:
            first = next(call)
        finally:
            answered.set()
            call.cancel()
    return int(first.credits.requests)


def idle_state(addresses: StackAddresses, models: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Per worker (running, waiting, open, used KV blocks, free KV tokens, offered credits) and per
    route the gateway's queued requests: the values that must return exactly after the load."""
    state: dict[str, tuple[int, ...]] = {}
    for index, worker in enumerate(addresses.workers):
        stats = worker_stats(worker)
        state[f"worker {index}"] = (
            stats.running,
            stats.waiting,
            stats.open_requests,
            stats.used_kv_blocks,
            stats.free_kv_tokens,
            offered_credits(worker),
        )
    with grpc.insecure_channel(addresses.gateway) as channel:
        listed = gateway_pb2_grpc.GatewayStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
    queued = {model.name: int(model.queued_requests) for model in listed.models}
    for model in models:
        state[f"gateway queue {model}"] = (queued[model],)
    return state


@dataclass
class RssSeries:
    """The resident memory samples of one process: (time.monotonic(), bytes)."""

    service: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def baseline(self, warm_s: float, since: float | None = None) -> int | None:
        """The first sample taken at least `warm_s` after `since` (by default this process's first
        sample: pass when it began serving); None if none was."""
        if not self.samples:
            return None
        start = self.samples[0][0] if since is None else since
        return next((rss for at, rss in self.samples if at - start >= warm_s), None)

    def growth(self, warm_s: float, since: float | None = None) -> float | None:
        """(last sample - baseline) / baseline; None when the process did not live past its warm-up."""
        base = self.baseline(warm_s, since)
        return None if base is None else (self.samples[-1][1] - base) / base


class RssSampler:
    """Samples the RSS of every service's current process from a thread until stopped."""

    def __init__(self, pids: Callable[[], Mapping[str, int]], interval_s: float = 1.0) -> None:
        self._pids = pids
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)
        self.series: dict[int, RssSeries] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample(self) -> None:
        now = time.monotonic()
        for service, pid in dict(self._pids()).items():
            try:
                rss = int(psutil.Process(pid).memory_info().rss)
            except psutil.NoSuchProcess:
                continue  # it died between the listing and the read; its restart is sampled next time
            self.series.setdefault(pid, RssSeries(service, pid)).samples.append((now, rss))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval_s)
