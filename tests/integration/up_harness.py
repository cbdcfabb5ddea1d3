"""`strata up` as a subprocess for tests: its ready message parsed, its output drained, its children
found, and everything it started killed however the test ends.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psutil
import yaml

from strata.settings import DEFAULT_CONFIG
from tests.integration.launcher_harness import write_tiny_config
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from pathlib import Path

READY_LINE = re.compile(r"^\s+gateway\s+(\S+)\s*$")
HTTP_LINE = re.compile(r"^\s+http\s+(\S+)")


class Up:
    """A `strata up` subprocess whose output is drained by a thread (its children share the pipe)."""

    def __init__(
        self, config: Path, stderr: Path, args: tuple[str, ...] = (), env: Mapping[str, str] | None = None
    ) -> None:
        self._stderr_path = stderr
        self._stderr = stderr.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "up", "--config", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=None if env is None else dict(env),
        )
        self.lines: list[str] = []
        self.gateway: str | None = None
        self.http: str | None = None
        """The HTTP API's base URL (http://host:port/v1) when the gateway serves one."""
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = READY_LINE.match(line)
            if match:
                self.gateway = match.group(1)
            http = HTTP_LINE.match(line)
            if http:
                self.http = http.group(1)
            if line.startswith("Ctrl-C stops the stack"):  # the last line of the ready message
                self._ready.set()

    def wait_ready(self, timeout: float = 300) -> str:
        def ready() -> bool:
            assert self.process.poll() is None, f"strata up exited early: {self.stderr()}"
            return self._ready.wait(0.2)

        wait_for(ready, timeout, lambda: f"strata up ready (its stderr: {self.stderr()})", interval_s=0)
        assert self.gateway is not None
        return self.gateway

    def children(self) -> list[psutil.Process]:
        children: list[psutil.Process] = psutil.Process(self.process.pid).children(recursive=True)
        return children

    def stderr(self) -> str:
        self._stderr.flush()
        return self._stderr_path.read_text()

    def close(self, pids: list[int]) -> None:
        for pid in [self.process.pid, *pids]:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                continue
        self.process.wait(30)
        self._stderr.close()


def default_config(
    tmp_path: Path, workers: Mapping[int, Mapping[str, object]] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The default config as `make run` starts it, its folders absolute, the gateway and its HTTP API
    on free ports, each worker's entry updated with `workers[index]`; written to tmp_path. Returns the
    file and the config."""
    config: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for index, worker in enumerate(config["workers"]):
        worker["model_path"] = str((DEFAULT_CONFIG.parent / worker["model_path"]).resolve())
        worker.update((workers or {}).get(index, {}))
    models = config["tokenizer"]["models"]
    config["tokenizer"]["models"] = {
        name: str((DEFAULT_CONFIG.parent / folder).resolve()) for name, folder in models.items()
    }
    config["gateway"]["listen"] = "127.0.0.1:0"
    config["gateway"]["http_listen"] = "127.0.0.1:0"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


@contextmanager
def running_up(
    config: Path, stderr: Path, *args: str, env: Mapping[str, str] | None = None, ready_s: float = 300
) -> Iterator[tuple[Up, list[psutil.Process]]]:
    """`strata up --config config *args`, ready; its children at that moment. Killed on the way out,
    with every process it ever started (restarted children included)."""
    up = Up(config, stderr, args, env)
    children: list[psutil.Process] = []
    try:
        up.wait_ready(ready_s)
        children = up.children()
        yield up, children
    finally:
        later = [child.pid for child in up.children()] if up.process.poll() is None else []
        up.close([child.pid for child in children] + later)


@contextmanager
def strata_up(
    tmp_path: Path, tiny_serving_dir: Path, *args: str
) -> Iterator[tuple[Up, list[psutil.Process]]]:
    """`strata up` of a tiny stack (tokenizer, one worker, gateway on a free port)."""
    config = write_tiny_config(tmp_path / "up.yaml", tiny_serving_dir)
    with running_up(config, tmp_path / "up.stderr", *args) as (up, children):
        yield up, children
