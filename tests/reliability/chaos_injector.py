"""The chaos soak's fault injector, which carries out a fault schedule (chaos_plan.py), and the
supervision it runs against (`run_supervised`: strata up's Supervisor over a started stack).

From its own thread it takes the faults one at a time: it waits the fault's pause, signals the
service's current process (kill -9, SIGTERM, or SIGSTOP and SIGCONT after the fault's stopped time),
then waits until the stack is fully serving again and records how long that took. After kill -9 and
SIGTERM a recovery counts only once the supervisor has started a new process for the service (its
pid changed) and the probe says the stack serves; after SIGSTOP the time runs from the SIGCONT. A
stack not back within the recovery bound ends the injection there (the record says so). Bounded in
count (the schedule) and time (each pause, stop and recovery, and an overall deadline).

`run_supervised` runs the test's work in a thread while the calling thread (the one that started
the stack: a child's parent death signal follows the thread that started it) ticks a Supervisor as
`strata up` does, recording each restart (service, cause) and each start's seconds from the new
process to SERVING. This module must not assert: the test judges the records.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from strata.cli.supervisor import State, Supervisor, cause
from tests.reliability.chaos_plan import FaultKind

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from strata.cli.child import Child
    from strata.cli.launcher import Stack
    from tests.reliability.chaos_plan import Fault

T = TypeVar("T")
TICK_S = 0.2
"""How often the supervisor looks, as strata up does."""


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """What one fault did: the process it hit, when, and how long the stack took to serve again."""

    fault: Fault
    service: str
    pid: int
    at: float
    """time.monotonic() when the fault took effect: the signal, or the SIGCONT after a SIGSTOP."""
    recovered_s: float | None
    """Seconds from `at` until fully serving; None when not within the recovery bound."""
    new_pid: int | None
    """The service's process once recovered (a new one after kill -9 and SIGTERM)."""


class Injector:
    """Runs a fault schedule in a thread; `records` holds one FaultRecord per fault carried out."""

    def __init__(
        self,
        services: Mapping[str, str],
        pids: Callable[[], Mapping[str, int]],
        serving: Callable[[], bool],
        *,
        recovery_bound_s: float,
        deadline_s: float,
        poll_s: float = 0.1,
    ) -> None:
        """`services` maps each plan target (primary, fallback, tokenizer, gateway) to its service name
        in `pids()`; `deadline_s` bounds the whole run from its start."""
        self._services = dict(services)
        self._pids = pids
        self._serving = serving
        self._recovery_bound_s = recovery_bound_s
        self._deadline_s = deadline_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.records: list[FaultRecord] = []
        self.last_fault_at: float | None = None

    def start(self, faults: list[Fault], begin_at: float) -> None:
        """Start the schedule's first pause at time.monotonic() == begin_at."""
        self._thread = threading.Thread(target=self._guarded, args=(faults, begin_at), name="chaos injector")
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait for the schedule's end, and raise what the injector's thread raised."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._stop.set()
                self._thread.join(timeout_s)
                raise TimeoutError(f"the fault injector did not finish within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stop.set()

    def _guarded(self, faults: list[Fault], begin_at: float) -> None:
        try:
            self._run(faults, begin_at)
        except BaseException as error:  # handed to join(), which raises it in the test's thread
            self._error = error

    def _run(self, faults: list[Fault], begin_at: float) -> None:
        end = time.monotonic() + self._deadline_s
        if self._stop.wait(max(0.0, begin_at - time.monotonic())):
            return
        for fault in faults:
            if self._stop.wait(fault.pause_s) or time.monotonic() >= end:
                return
            record = self._inject(fault)
            self.records.append(record)
            if record.recovered_s is None:
                return

    def _inject(self, fault: Fault) -> FaultRecord:
        service = self._services[fault.target]
        pid = self._pids()[service]
        if fault.kind is FaultKind.STOP:
            os.kill(pid, signal.SIGSTOP)
            self.last_fault_at = time.monotonic()
            try:
                self._stop.wait(fault.stopped_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            at = time.monotonic()
        else:
            os.kill(pid, signal.SIGKILL if fault.kind is FaultKind.KILL else signal.SIGTERM)
            at = time.monotonic()
        self.last_fault_at = at
        replaced = fault.kind is not FaultKind.STOP
        give_up = at + self._recovery_bound_s
        while time.monotonic() < give_up:
            current = self._pids().get(service)
            if (not replaced or current not in (None, pid)) and self._serving():
                return FaultRecord(fault, service, pid, at, time.monotonic() - at, current)
            time.sleep(self._poll_s)
        return FaultRecord(fault, service, pid, at, None, self._pids().get(service))


@dataclass
class Supervision:
    """What the supervisor did while the work ran."""

    restarts: list[tuple[str, str]] = field(default_factory=list)
    """(service, cause) of each restart, cause as strata_supervisor_restarts_total labels it."""
    starts: dict[str, list[float]] = field(default_factory=dict)
    """Per service, the seconds of each restart from its new process to SERVING."""
    serving_since: dict[int, float] = field(default_factory=dict)
    """time.monotonic() when each restarted process (by pid) was first seen SERVING."""
    reports: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)


def run_supervised(stack: Stack, work: Callable[[], T], timeout_s: float) -> tuple[T, Supervision]:
    """`work()`'s result, run in a thread while this thread supervises `stack`; raises what it raised."""
    log = Supervision()
    started: dict[str, float] = {}

    def restart(child: Child) -> None:
        code = child.returncode()
        log.restarts.append((child.name, cause(code) if code is not None else "unknown"))
        started[child.name] = time.monotonic()
        stack.restart(child)

    supervisor = Supervisor(stack.children, restart, report=log.reports.append)
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # raised again below, in the calling thread
            failure.append(error)

    thread = threading.Thread(target=run, name="chaos work")
    thread.start()
    end = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < end:
        before = {watched.child.name: watched.state for watched in supervisor.watched}
        supervisor.tick()
        for watched in supervisor.watched:
            name = watched.child.name
            if before[name] is State.STARTING and watched.state is State.SERVING:
                log.starts.setdefault(name, []).append(time.monotonic() - started[name])
                if watched.child.process is not None:
                    log.serving_since[watched.child.process.pid] = time.monotonic()
            if before[name] is not State.GIVEN_UP and watched.state is State.GIVEN_UP:
                log.given_up.append(name)
        thread.join(TICK_S)
    if thread.is_alive():
        raise TimeoutError(f"the supervised work did not end within {timeout_s:.0f} s")
    if failure:
        raise failure[0]
    return outcome[0], log
