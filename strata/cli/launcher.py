"""Start a whole Strata stack (tokenizer, workers, gateway) as child processes, and stop it cleanly.

`start_stack` is what `strata up` and the integration tests use. Each service runs as a Child
(child.py) and writes its bound address to its announce file once listening; the launcher then waits
for grpc.health.v1 to report SERVING. The tokenizer and every worker start
together (workers load their models in parallel) and must all be ready before the gateway starts, so
the gateway connects to live services whose real addresses it receives through
STRATA_GATEWAY_TOKENIZER_ADDRESS and STRATA_GATEWAY_ROUTES: one route per worker model name, merged with
that model's entry in the config's `gateway.routes` (its fallback, queue limits, SLO). Each worker's
process gets its OpenMP wait policy as OMP_WAIT_POLICY, which OpenMP reads only when torch loads.
Stopping goes gateway first (it drains its clients), then workers and tokenizer: SIGTERM, a bounded
wait, then SIGKILL for stragglers. `Stack.restart` starts a child that ended again on the addresses it
announced (supervisor.py decides when). This module must not know any service's settings beyond the
workers' model names and wait policies and the `model` and `workers` keys of the gateway's routes (the
gateway validates the rest), nor decide when a service is ready (the services' health does, and the
gateway's ListModels says when it has linked every worker).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import grpc

from strata.cli.child import Child
from strata.cli.stack_config import (
    check_route_options,
    gateway_is_open,
    route_options,
    routes_json,
    worker_env,
    worker_settings,
)
from strata.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import TracebackType


READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.05


class StackError(RuntimeError):
    """The stack could not start; the message names the service, its exit code and its last output."""


@dataclass(frozen=True)
class StackAddresses:
    """Where each service of a running stack listens (host:port)."""

    gateway: str
    tokenizer: str
    workers: tuple[str, ...]


@dataclass(frozen=True)
class ChildExit:
    """A child process that ended, and its exit code (negative: killed by that signal)."""

    name: str
    returncode: int

    def __str__(self) -> str:
        return f"{self.name} exited with code {self.returncode}"


class Stack:
    """A running stack's child processes; build it with start_stack, end it with stop (or `with`)."""

    def __init__(self, config_path: Path, env: Mapping[str, str] | None, log_dir: Path | None) -> None:
        self.config_path = config_path
        self.log_dir = log_dir
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._run_dir = Path(tempfile.mkdtemp(prefix="strata-stack-"))
        self.children: list[Child] = []
        """Every service in start order: tokenizer, workers, gateway."""
        self._addresses: StackAddresses | None = None
        self.worker_models: tuple[str, ...] = ()
        """The model name of each worker, in index order."""

    @property
    def addresses(self) -> StackAddresses:
        if self._addresses is None:
            raise StackError("the stack is not ready: start it with start_stack")
        return self._addresses

    @property
    def metrics_addresses(self) -> dict[str, str]:
        """host:port of each child's /metrics endpoint by service name (those that serve one)."""
        return {child.name: child.metrics_address for child in self.children if child.metrics_address}

    @property
    def health_addresses(self) -> dict[str, str]:
        """host:port of each child's health-only port (its `health_listen`) by service name, where set."""
        return {child.name: child.health_address for child in self.children if child.health_address}

    @property
    def http_addresses(self) -> dict[str, str]:
        """host:port of each child's HTTP API by service name (the gateway's, when http_listen is set)."""
        return {child.name: child.http_address for child in self.children if child.http_address}

    @property
    def pids(self) -> dict[str, int]:
        """Process id of each child by service name ("tokenizer", "worker 0", ..., "gateway")."""
        return {child.name: child.process.pid for child in self.children if child.process is not None}

    def poll(self) -> ChildExit | None:
        """The first child found ended, or None while all run."""
        for child in self.children:
            code = child.returncode()
            if code is not None:
                return ChildExit(child.name, code)
        return None

    def restart(self, child: Child) -> None:
        """Start a child that ended (its process group already killed) again, on its old addresses."""
        child.start(self._env)

    def wait(self, timeout: float | None = None) -> ChildExit | None:
        """Block until a child ends and return which one; None if `timeout` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while (ended := self.poll()) is None:
            if end is not None and time.monotonic() >= end:
                return None
            time.sleep(0.2)
        return ended

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[ChildExit]:
        """SIGTERM the gateway, then workers and tokenizer; SIGKILL what outlives `timeout`. Idempotent."""
        end = time.monotonic() + timeout
        gateway = [child for child in self.children if child.name == "gateway"]
        rest = [child for child in self.children if child.name != "gateway"]
        # The gateway gets at most half the time to drain, so the others always get their SIGTERM.
        self._terminate(gateway, time.monotonic() + timeout / 2)
        self._terminate(rest, end)
        for child in self.children:
            child.close_output()
        shutil.rmtree(self._run_dir, ignore_errors=True)
        ended = [child for child in self.children if child.process is not None]
        return [ChildExit(child.name, child.process.wait()) for child in ended if child.process is not None]

    def _terminate(self, children: list[Child], end: float) -> None:
        running = [child.process for child in children if child.process is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in running:
            try:
                process.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(
        self, name: str, module: str, env_prefix: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> Child:
        log_file = None if self.log_dir is None else self.log_dir / f"{name.replace(' ', '-')}.log"
        child = Child(
            name, module, self.config_path, self._run_dir, env_prefix, args, dict(env or {}), log_file
        )
        child.start(self._env)
        self.children.append(child)
        return child

    def _fail_if_any_exited(self) -> None:
        ended = self.poll()
        if ended is not None:
            child = next(child for child in self.children if child.name == ended.name)
            child.drain_output()  # its last lines are in the tail once its output is copied
            raise StackError(f"{ended} while the stack was starting; {child.log_tail()}")

    def _wait_ready(self, child: Child, end: float, timeout_s: float) -> str:
        """The child's announced address once its health says SERVING; fails fast if any child exits."""
        while not child.announced():
            self._fail_if_any_exited()
            if time.monotonic() >= end:
                raise StackError(
                    f"{child.name} did not announce its address within {timeout_s:.0f} s; {child.log_tail()}"
                )
            time.sleep(_POLL_S)
        while not child.serving():
            self._fail_if_any_exited()
            if time.monotonic() >= end:
                late = f"{child.name} at {child.address} was not SERVING within {timeout_s:.0f} s"
                raise StackError(f"{late}; {child.log_tail()}")
            time.sleep(0.1)
        return child.address

    def _start(self, ready_timeout_s: float) -> None:
        settings = worker_settings(self.config_path)
        models = [worker.model_name for worker in settings]
        options = route_options(self.config_path)
        check_route_options(models, options)  # before anything starts
        self.worker_models = tuple(models)
        end = time.monotonic() + ready_timeout_s
        tokenizer = self._spawn("tokenizer", "services.tokenizer", "STRATA_TOKENIZER_", [])
        workers = [
            self._spawn(f"worker {index}", "services.worker", "STRATA_WORKER_", ["--index", str(index)], env)
            for index, env in enumerate(worker_env(worker) for worker in settings)
        ]
        tokenizer_address = self._wait_ready(tokenizer, end, ready_timeout_s)
        worker_addresses = [self._wait_ready(worker, end, ready_timeout_s) for worker in workers]
        gateway_env = {
            "STRATA_GATEWAY_TOKENIZER_ADDRESS": tokenizer_address,
            "STRATA_GATEWAY_ROUTES": routes_json(models, worker_addresses, options),
        }
        gateway = self._spawn("gateway", "gateway", "STRATA_GATEWAY_", [], gateway_env)
        gateway_address = self._wait_ready(gateway, end, ready_timeout_s)
        if gateway_is_open(self.config_path):
            self._wait_linked(gateway, gateway_address, end, ready_timeout_s)
        self._addresses = StackAddresses(gateway_address, tokenizer_address, tuple(worker_addresses))

    def _wait_linked(self, gateway: Child, address: str, end: float, timeout_s: float) -> None:
        """Until the gateway has a live link to every worker it started with.

        A gateway whose route can be served by its fallback alone already reports SERVING; the stack
        is ready only once the primaries are linked too, so its first requests go where they should.
        """
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            while True:
                self._fail_if_any_exited()
                models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5.0).models
                if all(model.ready_workers >= model.configured_workers for model in models):
                    return
                if time.monotonic() >= end:
                    late = ", ".join(f"{m.name} {m.ready_workers}/{m.configured_workers}" for m in models)
                    raise StackError(
                        f"the gateway did not link every worker within {timeout_s:.0f} s ({late}); "
                        f"{gateway.log_tail()}"
                    )
                time.sleep(0.05)


def start_stack(
    config_path: Path | str,
    *,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Stack:
    """Start the tokenizer, the workers, then the gateway of `config_path`; return once all are SERVING.

    `env` is added to this process's environment for every child. With `log_dir`, each child's
    stdout and stderr go to `<log_dir>/<service>.log` (tokenizer, worker-0, ..., gateway); without it
    they share this process's. Raises StackError (a child exited, or was not ready within
    `ready_timeout_s`) or SettingsError (a config the launcher cannot read), after stopping every
    child it started.
    """
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(Path(config_path).resolve(), env, log_dir)
    try:
        stack._start(ready_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack
