"""Start a whole Strata stack (tokenizer, workers, gateway) as child processes, and stop it cleanly.

`start_stack` is what `strata up` and the integration tests use. Each service runs as
`python -m <module> --config FILE --announce-file P` and writes its bound address to P once listening;
the launcher then waits for grpc.health.v1 to report SERVING. The tokenizer and every worker start
together (workers load their models in parallel) and must all be ready before the gateway starts, so
the gateway connects to live services whose real addresses it receives through
STRATA_GATEWAY_TOKENIZER_ADDRESS and STRATA_GATEWAY_ROUTES: one route per worker model name, merged with
that model's entry in the config's `gateway.routes` (its fallback, queue limits, SLO). Each worker's
process gets its OpenMP wait policy as OMP_WAIT_POLICY, which OpenMP reads only when torch loads.
Stopping goes gateway first (it drains its clients), then workers and tokenizer: SIGTERM, a bounded
wait, then SIGKILL for stragglers.

Children run in their own session, so a terminal's Ctrl-C reaches only the launcher, which stops them
in order. On Linux each child also gets SIGTERM if the launcher dies without stopping it (the parent
death signal follows the *thread* that started the stack: start it from one that outlives it, e.g. the
main thread). This module must not know any service's settings beyond the workers' model names and
wait policies and the `model` and `workers` keys of the gateway's routes (the gateway validates the
rest), nor decide when a service is ready (the services' health does, and the gateway's ListModels
says when it has linked every worker).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
_LOG_TAIL_LINES = 25

# Sets the parent death signal, then becomes the service: the exec keeps the pid and the setting.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"  # the launcher died before prctl
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


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


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    announce_file: Path
    log_file: Path | None
    metrics_address: str = ""
    """host:port of its /metrics endpoint (from `<announce file>.metrics`); empty when it has none."""
    health_address: str = ""
    """host:port of its plaintext health-only port (from `<announce file>.health`); empty when it has none."""

    def log_tail(self) -> str:
        if self.log_file is None:
            return "(its output went to this terminal, above)"
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError as exc:
            return f"(its log {self.log_file} is unreadable: {exc})"
        return f"last lines of {self.log_file}:\n" + "\n".join(f"  | {line}" for line in lines)


class Stack:
    """A running stack's child processes; build it with start_stack, end it with stop (or `with`)."""

    def __init__(self, config_path: Path, env: Mapping[str, str] | None, log_dir: Path | None) -> None:
        self.config_path = config_path
        self.log_dir = log_dir
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._run_dir = Path(tempfile.mkdtemp(prefix="strata-stack-"))
        self._children: list[_Child] = []
        self._logs: list[IO[bytes]] = []
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
        return {child.name: child.metrics_address for child in self._children if child.metrics_address}

    @property
    def health_addresses(self) -> dict[str, str]:
        """host:port of each child's health-only port (its `health_listen`) by service name, where set."""
        return {child.name: child.health_address for child in self._children if child.health_address}

    @property
    def pids(self) -> dict[str, int]:
        """Process id of each child by service name ("tokenizer", "worker 0", ..., "gateway")."""
        return {child.name: child.process.pid for child in self._children}

    def poll(self) -> ChildExit | None:
        """The first child found ended, or None while all run."""
        for child in self._children:
            code = child.process.poll()
            if code is not None:
                return ChildExit(child.name, code)
        return None

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
        gateway = [child for child in self._children if child.name == "gateway"]
        rest = [child for child in self._children if child.name != "gateway"]
        # The gateway gets at most half the time to drain, so the others always get their SIGTERM.
        self._terminate(gateway, time.monotonic() + timeout / 2)
        self._terminate(rest, end)
        for log in self._logs:
            log.close()
        shutil.rmtree(self._run_dir, ignore_errors=True)
        return [ChildExit(child.name, child.process.wait()) for child in self._children]

    def _terminate(self, children: list[_Child], end: float) -> None:
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.process.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, args: list[str], env: Mapping[str, str] | None = None) -> _Child:
        slug = name.replace(" ", "-")
        announce = self._run_dir / f"{slug}.addr"
        command = ["-m", module, "--config", str(self.config_path), "--announce-file", str(announce), *args]
        if sys.platform == "linux":
            command = ["-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
        log_file = None if self.log_dir is None else self.log_dir / f"{slug}.log"
        output: IO[bytes] | None = None
        if log_file is not None:
            output = log_file.open("wb")
            self._logs.append(output)
        process = subprocess.Popen(
            [sys.executable, *command],
            env={**self._env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,
        )
        child = _Child(name, process, announce, log_file)
        self._children.append(child)
        return child

    def _fail_if_any_exited(self) -> None:
        ended = self.poll()
        if ended is not None:
            child = next(child for child in self._children if child.name == ended.name)
            raise StackError(f"{ended} while the stack was starting; {child.log_tail()}")

    def _wait_ready(self, child: _Child, end: float, timeout_s: float) -> str:
        """The child's announced address once its health says SERVING; fails fast if any child exits."""
        while not child.announce_file.exists():
            self._fail_if_any_exited()
            if time.monotonic() >= end:
                raise StackError(
                    f"{child.name} did not announce its address within {timeout_s:.0f} s; {child.log_tail()}"
                )
            time.sleep(_POLL_S)
        address = child.announce_file.read_text().strip()
        metrics_file = child.announce_file.with_name(child.announce_file.name + ".metrics")
        if metrics_file.exists():  # written before the address, so it is complete when present
            child.metrics_address = metrics_file.read_text().strip()
        # A service's plaintext health port answers even when its main port wants TLS.
        health_file = child.announce_file.with_name(child.announce_file.name + ".health")
        if health_file.exists():  # written before the address too
            child.health_address = health_file.read_text().strip()
        probe = child.health_address or address
        with grpc.insecure_channel(probe) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                self._fail_if_any_exited()
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return address
                except grpc.RpcError:
                    pass  # not serving yet: the loop's deadline bounds the wait
                if time.monotonic() >= end:
                    late = f"{child.name} at {address} was not SERVING within {timeout_s:.0f} s"
                    raise StackError(f"{late}; {child.log_tail()}")
                time.sleep(0.1)

    def _start(self, ready_timeout_s: float) -> None:
        settings = worker_settings(self.config_path)
        models = [worker.model_name for worker in settings]
        options = route_options(self.config_path)
        check_route_options(models, options)  # before anything starts
        self.worker_models = tuple(models)
        end = time.monotonic() + ready_timeout_s
        tokenizer = self._spawn("tokenizer", "services.tokenizer", [])
        workers = [
            self._spawn(f"worker {index}", "services.worker", ["--index", str(index)], worker_env(worker))
            for index, worker in enumerate(settings)
        ]
        tokenizer_address = self._wait_ready(tokenizer, end, ready_timeout_s)
        worker_addresses = [self._wait_ready(worker, end, ready_timeout_s) for worker in workers]
        gateway_env = {
            "STRATA_GATEWAY_TOKENIZER_ADDRESS": tokenizer_address,
            "STRATA_GATEWAY_ROUTES": routes_json(models, worker_addresses, options),
        }
        gateway = self._spawn("gateway", "gateway", [], gateway_env)
        gateway_address = self._wait_ready(gateway, end, ready_timeout_s)
        if gateway_is_open(self.config_path):
            self._wait_linked(gateway, gateway_address, end, ready_timeout_s)
        self._addresses = StackAddresses(gateway_address, tokenizer_address, tuple(worker_addresses))

    def _wait_linked(self, gateway: _Child, address: str, end: float, timeout_s: float) -> None:
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
