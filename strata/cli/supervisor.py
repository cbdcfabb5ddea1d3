"""Keeps a started stack serving: a service that exits without being asked to is started again.

`strata up` runs a Supervisor over its Stack. A child that ends (a crash, kill -9, an unplanned exit)
is started again after a backoff (0.5 s, doubling per restart up to 30 s) on the addresses it
announced before, so the gateway and the other services find it where they knew it; once it reports
SERVING it is back, and the gateway's links and tokenizer client reconnect on their own. A service
that ends `crash_loop_restarts` times within `crash_loop_window_s` is given up and reported, and the
rest keep serving. Each exit is reported with its code or signal and the child's last lines of
output, and counted in `strata_supervisor_restarts_total`; `strata_supervisor_service_up` says which
services serve now. `tick` never blocks for long (one health check per starting service), so one
slow start does not delay noticing another exit. This module must not start a stack nor know any
service's settings (launcher.py does); it only decides when a child starts again.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, start_http_server

from strata.cli.child import describe_exit

if TYPE_CHECKING:
    from collections.abc import Callable

    from strata.cli.child import Child

RESTARTS = Counter(
    "strata_supervisor_restarts_total",
    "Services strata up started again after they ended without being asked, by service and cause.",
    ["service", "cause"],
)
SERVICE_UP = Gauge(
    "strata_supervisor_service_up", "1 while a service of strata up is serving, else 0.", ["service"]
)


@dataclass(frozen=True)
class RestartPolicy:
    """How soon a service that ended starts again, and when it is given up."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    crash_loop_restarts: int = 5
    """A service that ends this many times within crash_loop_window_s is given up."""
    crash_loop_window_s: float = 60.0

    def delay_s(self, recent_exits: int) -> float:
        """The wait before the restart that follows the `recent_exits`-th exit within the window."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** max(0, recent_exits - 1))


class State(enum.Enum):
    SERVING = "serving"
    WAITING = "waiting"
    """Ended; starts again at `due`."""
    STARTING = "starting"
    GIVEN_UP = "given up"


@dataclass
class Watched:
    """One supervised child and what the supervisor knows of it."""

    child: Child
    state: State = State.SERVING
    exits: deque[float] = field(default_factory=deque)
    """When it ended, within the crash-loop window."""
    due: float = 0.0
    down_since: float = 0.0


def cause(returncode: int) -> str:
    """The restarts metric's `cause` label: `exit_<code>` or the signal's name."""
    return describe_exit(returncode).removeprefix("was killed by ").replace("exited with code ", "exit_")


class Supervisor:
    """Restarts the children of one stack. Used from one thread (strata up's main thread)."""

    def __init__(
        self,
        children: list[Child],
        restart: Callable[[Child], None],
        policy: RestartPolicy | None = None,
        report: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`restart(child)` starts an ended child again (Stack.restart); `report` prints one message."""
        self._restart = restart
        self.policy = policy or RestartPolicy()
        self._report = report
        self._clock = clock
        self.watched = [Watched(child) for child in children]
        for watched in self.watched:
            SERVICE_UP.labels(watched.child.name).set(1)

    @property
    def all_given_up(self) -> bool:
        return all(watched.state is State.GIVEN_UP for watched in self.watched)

    def tick(self) -> None:
        """Notice exits, start what is due, and mark what serves again."""
        for watched in self.watched:
            now = self._clock()
            if watched.state in (State.SERVING, State.STARTING):
                code = watched.child.returncode()
                if code is not None:
                    self._ended(watched, code, now)
                elif (
                    watched.state is State.STARTING and watched.child.announced() and watched.child.serving()
                ):
                    watched.state = State.SERVING
                    SERVICE_UP.labels(watched.child.name).set(1)
                    self._report(
                        f"strata up: {watched.child.name} is back at {watched.child.address}, SERVING "
                        f"{now - watched.down_since:.1f} s after it went down"
                    )
            elif watched.state is State.WAITING and now >= watched.due:
                watched.state = State.STARTING
                self._restart(watched.child)

    @staticmethod
    def _serving(child: Child) -> bool:
        return child.announced() and child.serving()

    def _ended(self, watched: Watched, code: int, now: float) -> None:
        name = watched.child.name
        if watched.state is State.SERVING:
            watched.down_since = now
        SERVICE_UP.labels(name).set(0)
        watched.exits.append(now)
        while watched.exits and now - watched.exits[0] > self.policy.crash_loop_window_s:
            watched.exits.popleft()
        how = describe_exit(code) + (f" (code {code})" if code < 0 else "")
        watched.child.drain_output()
        if len(watched.exits) >= self.policy.crash_loop_restarts:
            watched.state = State.GIVEN_UP
            self._report(
                f"strata up: {name} {how}: it ended {len(watched.exits)} times within "
                f"{self.policy.crash_loop_window_s:.0f} s, so it is given up; the rest keep serving\n"
                f"{watched.child.log_tail()}"
            )
            return
        delay = self.policy.delay_s(len(watched.exits))
        watched.state = State.WAITING
        watched.due = now + delay
        RESTARTS.labels(name, cause(code)).inc()
        self._report(
            f"strata up: {name} {how}; starting it again in {delay:.1f} s on {watched.child.address}\n"
            f"{watched.child.log_tail()}"
        )


def serve_metrics(listen: str) -> str:
    """Serve this process's Prometheus metrics at host:port (port 0: a free one); the bound address."""
    host, _, port = listen.rpartition(":")
    server, _ = start_http_server(int(port), addr=host)
    return f"{host}:{server.server_port}"
