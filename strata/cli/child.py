"""One service process of a stack: how it is started (and started again), its output, the addresses it
announces, and whether it serves.

A child runs `python -m <module> --config FILE --announce-file P ...` in its own session (so a
terminal's Ctrl-C reaches only the launcher, and its process group can be killed whole), and on Linux
gets SIGTERM if the launcher dies without stopping it (the parent death signal follows the *thread*
that started it: start it from one that outlives it, e.g. the main thread). Its output goes through a
pump thread to its log file, or to this terminal, and the pump keeps the last lines for the messages
that say why it stopped. Once started, a child keeps the addresses it announced: a restart binds the
same ones (its listen, health and metrics addresses are pinned through its STRATA_<SERVICE>_
variables), so the services that know it need not learn anything new. This module must not decide
when a child starts or restarts (launcher.py and supervisor.py do).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

LOG_TAIL_LINES = 25

# Sets the parent death signal, then becomes the service: the exec keeps the pid and the setting.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"  # the launcher died before prctl
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def describe_exit(returncode: int) -> str:
    """`exited with code 3`, or `was killed by SIGKILL` for a negative return code."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class OutputPump:
    """Copies a child's output to its destination line by line and keeps the last lines."""

    def __init__(self, source: IO[bytes], destination: IO[bytes]) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._source = source
        self._destination = destination
        self._thread = threading.Thread(target=self._run, name="child-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in iter(self._source.readline, b""):
            self.tail.append(line.decode(errors="replace").rstrip("\n"))
            with contextlib.suppress(ValueError, OSError):  # a log closed by stop, a closed terminal
                self._destination.write(line)
                self._destination.flush()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass
class Child:
    """One service of the stack: what starts it, the running process, what it announced."""

    name: str
    module: str
    config_path: Path
    run_dir: Path
    env_prefix: str
    """Its settings' environment prefix (STRATA_WORKER_), used to pin its addresses on a restart."""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_file: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    health_address: str = ""
    """Its plaintext health-only port (health_listen); empty when it has none."""
    metrics_address: str = ""
    """host:port of its /metrics endpoint; empty when it has none."""
    http_address: str = ""
    """host:port of its HTTP API (the gateway's http_listen); empty when it has none."""
    _pump: OutputPump | None = None
    _log: IO[bytes] | None = None

    @property
    def announce_file(self) -> Path:
        return self.run_dir / f"{self.name.replace(' ', '-')}.addr"

    def start(self, base_env: Mapping[str, str]) -> None:
        """Start the process: the first time on the configured addresses, later on the announced ones."""
        for suffix in ("", ".health", ".metrics", ".http"):
            self.announce_file.with_name(self.announce_file.name + suffix).unlink(missing_ok=True)
        command = ["-m", self.module, "--config", str(self.config_path)]
        command += ["--announce-file", str(self.announce_file), *self.args]
        if sys.platform == "linux":
            command = ["-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
        if self._log is None and self.log_file is not None:
            self._log = self.log_file.open("wb")  # kept open across restarts: one log per run
        self.process = subprocess.Popen(
            [sys.executable, *command],
            env={**base_env, **self.env, **self._pinned()},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self._pump = OutputPump(self.process.stdout, self._log or sys.stdout.buffer)

    def _pinned(self) -> dict[str, str]:
        """The addresses a restarted child must bind: those it announced before."""
        pinned = {}
        if self.address:
            pinned[f"{self.env_prefix}LISTEN"] = self.address
        if self.health_address:
            pinned[f"{self.env_prefix}HEALTH_LISTEN"] = self.health_address
        if self.metrics_address:
            pinned[f"{self.env_prefix}TELEMETRY__METRICS_LISTEN"] = self.metrics_address
        if self.http_address:
            pinned[f"{self.env_prefix}HTTP_LISTEN"] = self.http_address
        return pinned

    def returncode(self) -> int | None:
        """Its exit code once it ended (negative: the signal), else None.

        Whatever is left of its process group is killed first, while the ended process is still a
        zombie: until it is reaped its pid, and so its group id, cannot be given to another process.
        """
        if self.process is None:
            return None
        if self.process.returncode is None:
            ended = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if ended is None:
                return None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.poll()

    def announced(self) -> bool:
        """Whether it wrote its address; reads its addresses when it did (the address comes last)."""
        if not self.announce_file.exists():
            return False
        self.address = self.announce_file.read_text().strip()
        for suffix in (".health", ".metrics", ".http"):
            path = self.announce_file.with_name(self.announce_file.name + suffix)
            if path.exists():
                setattr(self, f"{suffix[1:]}_address", path.read_text().strip())
        return True

    def serving(self, timeout_s: float = 1.0) -> bool:
        """One health check (its plaintext health port when it has one: the main port may want TLS)."""
        with grpc.insecure_channel(self.health_address or self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def drain_output(self, timeout_s: float = 1.0) -> None:
        """After the process ended: wait (a little) for the pump to copy its last lines."""
        if self._pump is not None:
            self._pump.join(timeout_s)

    def log_tail(self) -> str:
        lines = list(self._pump.tail) if self._pump is not None else []
        where = f"last lines of {self.log_file}" if self.log_file is not None else "its last lines"
        return f"{where}:\n" + "\n".join(f"  | {line}" for line in lines)

    def close_output(self) -> None:
        """After the process ended: let the pump drain, then close the log."""
        self.drain_output(2.0)
        if self._log is not None:
            self._log.close()
            self._log = None
