"""The tests' one way to wait for a condition: call a probe until its value is good, within a bound.

Every form calls `probe()` at once, then every `interval_s` seconds, until `until(value)` holds (by
default: until the value is truthy, so `wait_for` on a probe of `X | None` gives an `X`). `poll`
returns the last value whether or not it is good, for tests that record a figure before they assert.
`wait_for` returns the good value, and `seconds_until` the seconds it took; both raise AssertionError
naming `what` (and the last value, when it says more than true or false) once `timeout_s` has passed.
The async forms sleep with asyncio, so the event loop runs while they wait, and take probes that
return a value or an awaitable. An AssertionError raised by the probe itself (a child process that
died, say) ends the wait at once. `announced_address` is the one wait every test of a service process
needs: for its announce file.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Awaitable, Callable
    from pathlib import Path

T = TypeVar("T")

INTERVAL_S = 0.02


def poll(
    probe: Callable[[], T],
    timeout_s: float,
    *,
    until: Callable[[T], object] = bool,
    interval_s: float = INTERVAL_S,
) -> T:
    """The first value of `probe()` that `until` accepts, or the last one once `timeout_s` has passed."""
    return _poll(probe, timeout_s, until, interval_s)[0]


@overload
def wait_for(
    probe: Callable[[], T | None], timeout_s: float, what: str | Callable[[], str], *, interval_s: float = ...
) -> T: ...
@overload
def wait_for(
    probe: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[T], object],
    interval_s: float = ...,
) -> T: ...
def wait_for(
    probe: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[Any], object] = bool,
    interval_s: float = INTERVAL_S,
) -> Any:
    """The first value of `probe()` that `until` accepts; AssertionError naming `what` after `timeout_s`."""
    value, good = _poll(probe, timeout_s, until, interval_s)
    if not good:
        raise AssertionError(_late(what, timeout_s, value))
    return value


def seconds_until(
    probe: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[T], object] = bool,
    interval_s: float = INTERVAL_S,
) -> float:
    """Seconds from this call until `until(probe())` holds; AssertionError naming `what` after `timeout_s`."""
    started = time.monotonic()
    wait_for(probe, timeout_s, what, until=until, interval_s=interval_s)
    return time.monotonic() - started


@overload
async def wait_for_async(
    probe: Callable[[], Awaitable[T]],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[T], object] = ...,
    interval_s: float = ...,
) -> T: ...
@overload
async def wait_for_async(
    probe: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[T], object] = ...,
    interval_s: float = ...,
) -> T: ...
async def wait_for_async(
    probe: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[Any], object] = bool,
    interval_s: float = INTERVAL_S,
) -> Any:
    """`wait_for` on an event loop: it sleeps with asyncio, and awaits the probe's value when that is
    awaitable (an async stub's call)."""
    end = time.monotonic() + timeout_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value
        if time.monotonic() >= end:
            raise AssertionError(_late(what, timeout_s, value))
        await asyncio.sleep(interval_s)


async def seconds_until_async(
    probe: Callable[[], Any],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    until: Callable[[Any], object] = bool,
    interval_s: float = INTERVAL_S,
) -> float:
    """`seconds_until` on an event loop."""
    started = time.monotonic()
    await wait_for_async(probe, timeout_s, what, until=until, interval_s=interval_s)
    return time.monotonic() - started


def announced_address(process: subprocess.Popen[Any], announce: Path, timeout_s: float) -> str:
    """The address a service process started with `--announce-file` writes once it listens.

    AssertionError with the process's exit code and stderr (when piped) if it exits first."""

    def announced() -> bool:
        if process.poll() is not None:
            stderr = process.stderr.read() if process.stderr else ""
            raise AssertionError(f"exited with code {process.returncode} before announcing: {stderr}")
        return announce.exists()

    wait_for(announced, timeout_s, f"an address in {announce}", interval_s=0.05)
    return announce.read_text().strip()


def _poll(
    probe: Callable[[], T], timeout_s: float, until: Callable[[T], object], interval_s: float
) -> tuple[T, bool]:
    end = time.monotonic() + timeout_s
    while True:
        value = probe()
        if until(value):
            return value, True
        if time.monotonic() >= end:
            return value, False
        time.sleep(interval_s)


def _late(what: str | Callable[[], str], timeout_s: float, value: object) -> str:
    message = f"{what() if callable(what) else what}: not within {timeout_s:g} s"
    if value is None or isinstance(value, bool):
        return message
    return f"{message}; last: {value!r}"
