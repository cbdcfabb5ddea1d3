"""Tests of the tests' polling helper (tests/polling.py): what each form returns, when it gives up, and
what its failure says."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests.polling import (
    announced_address,
    poll,
    seconds_until,
    seconds_until_async,
    wait_for,
    wait_for_async,
)

if TYPE_CHECKING:
    from pathlib import Path


def test_wait_for_returns_the_first_good_value() -> None:
    counter = itertools.count()
    assert wait_for(lambda: next(counter), 5, "a count", until=lambda n: n >= 3, interval_s=0) == 3
    assert wait_for(lambda: [1], 5, "a non-empty list") == [1]


def test_wait_for_names_what_and_the_last_value_when_it_gives_up() -> None:
    with pytest.raises(AssertionError, match=r"^the answer: not within 0.05 s; last: 41$"):
        wait_for(lambda: 41, 0.05, "the answer", until=lambda n: n == 42)
    with pytest.raises(AssertionError, match=r"^a truth: not within 0.05 s$"):
        wait_for(lambda: False, 0.05, "a truth")
    with pytest.raises(AssertionError, match=r"^built late: not within 0 s$"):
        wait_for(lambda: None, 0, lambda: "built late")


def test_poll_returns_the_last_value_without_raising() -> None:
    assert poll(lambda: 7, 0.05, until=lambda n: n > 7) == 7
    assert poll(lambda: True, 0) is True


def test_the_probe_is_called_once_even_with_no_time_left() -> None:
    calls: list[int] = []
    assert poll(lambda: calls.append(1), -1.0) is None
    assert calls == [1]


def test_a_failing_probe_ends_the_wait_at_once() -> None:
    def dead() -> bool:
        raise AssertionError("the child died")

    with pytest.raises(AssertionError, match="the child died"):
        wait_for(dead, 60, "never reached")


def test_seconds_until_measures_the_wait() -> None:
    counter = itertools.count()
    waited = seconds_until(lambda: next(counter) >= 2, 5, "two polls", interval_s=0.05)
    assert 0.09 <= waited < 5


def test_the_async_forms_await_probes_and_let_the_loop_run() -> None:
    async def main() -> tuple[int, float]:
        ticks: list[int] = []

        async def ticker() -> None:
            while True:
                ticks.append(1)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())

        async def probe() -> int:
            await asyncio.sleep(0)
            return len(ticks)

        try:
            got = await wait_for_async(probe, 5, "ticks", until=lambda n: n >= 3)
            waited = await seconds_until_async(lambda: len(ticks) >= got + 2, 5, "two more ticks")
        finally:
            task.cancel()
        with pytest.raises(AssertionError, match=r"^never: not within 0.05 s$"):
            await wait_for_async(lambda: False, 0.05, "never")
        return got, waited

    got, waited = asyncio.run(main())
    assert got >= 3 and 0 < waited < 5


def test_announced_address_reads_the_file_and_reports_a_process_that_exits_first(tmp_path: Path) -> None:
    announce = tmp_path / "service.addr"
    tmp = announce.with_suffix(".tmp")  # written, then renamed: the services write it as atomically
    write = (
        f"import pathlib, time; time.sleep(0.2); pathlib.Path({str(tmp)!r}).write_text('127.0.0.1:9\\n');"
        f" pathlib.Path({str(tmp)!r}).rename({str(announce)!r}); time.sleep(30)"
    )
    process = subprocess.Popen([sys.executable, "-c", write], text=True)
    try:
        assert announced_address(process, announce, 30) == "127.0.0.1:9"
    finally:
        process.kill()
        process.wait()
    dies = [sys.executable, "-c", "import sys; sys.exit('no model')"]
    failed = subprocess.Popen(dies, stderr=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError, match=r"exited with code 1 before announcing: no model"):
        announced_address(failed, tmp_path / "never.addr", 30)
