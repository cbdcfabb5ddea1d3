"""Test-mode fault switches for the engine: a delay per step and simulated out-of-memory steps.

They exist so that tests and the reliability suite can make overload and failure happen on purpose.
The switches refuse to arm unless the engine was built with `enable_fault_injection=True`, so a
production engine can never be slowed or failed through them.
"""

from __future__ import annotations

import threading
import time


class SimulatedOutOfMemoryError(RuntimeError):
    """Raised inside a step in place of a device out-of-memory error."""


class FaultInjectionDisabledError(RuntimeError):
    """A fault switch was used on an engine built without enable_fault_injection."""


class FaultInjector:
    """Switches read by the step loop. Thread-safe: tests flip them from another thread."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._step_delay_s = 0.0
        self._oom_steps = 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _require_enabled(self) -> None:
        if not self._enabled:
            raise FaultInjectionDisabledError(
                "fault injection is off: build the engine with EngineConfig(enable_fault_injection=True)"
            )

    def set_step_delay(self, seconds: float) -> None:
        """Sleep this long before every step's forward pass (0 turns it off)."""
        self._require_enabled()
        if seconds < 0:
            raise ValueError(f"step delay {seconds} is invalid: must be >= 0 seconds")
        with self._lock:
            self._step_delay_s = seconds

    def fail_next_steps(self, count: int) -> None:
        """Make the next `count` steps raise SimulatedOutOfMemoryError before their forward pass."""
        self._require_enabled()
        with self._lock:
            self._oom_steps = count

    def before_forward(self) -> None:
        """Called by the engine before each forward pass; a no-op unless a switch is armed."""
        if not self._enabled:
            return
        with self._lock:
            delay = self._step_delay_s
            fail = self._oom_steps > 0
            if fail:
                self._oom_steps -= 1
        if delay:
            time.sleep(delay)
        if fail:
            raise SimulatedOutOfMemoryError("simulated out of memory (test-mode fault switch)")
