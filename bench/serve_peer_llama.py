"""llama.cpp's `llama-server` as the server-level peer: its command, start, readiness, identity, stop.

The server is started on an OS-given port (`--port 0`; it logs the address it bound), with as many
parallel slots as the benchmark's largest concurrency, a context of slots x the largest request
(prompt + new tokens), so each slot holds one whole request, continuous batching on, and our
worker's thread count for both decode and prompt threads. It is ready when it has logged its address
and its GET /health answers 200 (it answers 503 while the model loads). `stop` sends SIGTERM, which
llama-server handles by finishing its loop, and kills it only if it has not exited within a bound.
Its identity for the record's provenance is `--version` (build number, commit, compiler) and the
`system_info` line (the instruction sets ggml was built with), which llama-server logs only at trace
verbosity: a short probe start at that verbosity reads it, so the timed server logs at its default.
This module owns the peer's process; it must not send benchmark requests nor time anything.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.session import BenchError

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

LISTENING = re.compile(r"listening on (http://[0-9.]+:\d+)")
SYSTEM_INFO = re.compile(r"system_info: (.*)")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.1
TRACE_VERBOSITY = "4"


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the peer serves and how: the binary, the GGUF file, threads, slots and slot size."""

    binary: Path
    model: Path
    threads: int
    slots: int
    slot_tokens: int
    """Tokens one slot holds: the largest shape's prompt plus new tokens."""

    def __post_init__(self) -> None:
        for name in ("threads", "slots", "slot_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerOptions.{name}={getattr(self, name)} must be >= 1")


def server_command(options: ServerOptions, extra: tuple[str, ...] = ()) -> list[str]:
    """The llama-server command line: free port, slots, context, continuous batching, threads."""
    threads = str(options.threads)
    return [
        str(options.binary),
        "-m",
        str(options.model),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "-t",
        threads,
        "-tb",
        threads,
        "-np",
        str(options.slots),
        "-c",
        str(options.slots * options.slot_tokens),
        "--cont-batching",
        *extra,
    ]


def listening_url(log_text: str) -> str | None:
    """The base URL the server logged it listens on; None before it has."""
    match = LISTENING.search(log_text)
    return match.group(1) if match else None


def system_info(log_text: str) -> str | None:
    """What follows `system_info: ` in a log (threads and ggml's instruction sets); None if absent."""
    match = SYSTEM_INFO.search(log_text)
    return match.group(1).strip() if match else None


def _health(url: str) -> int | None:
    """The status of GET `url`/health; None when nothing answers yet."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class LlamaServer:
    """One llama-server process, its output in `log_path`; a context manager that stops it on exit."""

    def __init__(self, options: ServerOptions, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        self.command = server_command(options, extra)
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def pid(self) -> int:
        if self._process is None:
            raise BenchError("llama-server is not running: call start() first")
        return self._process.pid

    def log_text(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    def start(self) -> None:
        with self._log_path.open("wb") as log:
            self._process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

    def wait_logged(self, pattern: re.Pattern[str], timeout_s: float = READY_TIMEOUT_S) -> str:
        """The first match of `pattern` in the log, waiting for it; raises if the server exits first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            match = pattern.search(self.log_text())
            if match:
                return match.group(1)
            self._fail_if_exited()
            time.sleep(POLL_S)
        raise BenchError(
            f"llama-server logged no {pattern.pattern!r} within {timeout_s:.0f} s: {self._tail()}"
        )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The base URL once GET /health answers 200."""
        end = time.monotonic() + timeout_s
        self.url = self.wait_logged(LISTENING, timeout_s)
        while time.monotonic() < end:
            if _health(self.url) == 200:
                return self.url
            self._fail_if_exited()
            time.sleep(POLL_S)
        raise BenchError(
            f"llama-server at {self.url} was not healthy within {timeout_s:.0f} s: {self._tail()}"
        )

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if it outlives `timeout_s`; its exit code."""
        process = self._process
        if process is None:
            return 0
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
        return process.returncode

    def _fail_if_exited(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise BenchError(f"llama-server exited with {self._process.returncode}: {self._tail()}")

    def _tail(self) -> str:
        return f"the end of {self._log_path}: {self.log_text()[-1500:]!r}"

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def version(binary: Path) -> str:
    """`llama-server --version`: build number, commit, compiler and target."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True, timeout=60)
    return (done.stdout + done.stderr).strip()


def probe_system_info(options: ServerOptions, log_path: Path) -> str:
    """The `system_info` line of a short start at trace verbosity (stopped once it has logged it)."""
    with LlamaServer(options, log_path, ("-lv", TRACE_VERBOSITY)) as probe:
        return probe.wait_logged(SYSTEM_INFO, 60.0).strip()
