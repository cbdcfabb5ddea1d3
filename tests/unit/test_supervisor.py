"""The supervisor's restart policy, and a real process that keeps ending: restarted after a growing
backoff, counted, reported with its exit and its last lines, and given up at the crash-loop limit.

The supervised child is a real process (`python -m strata.probe` with arguments it refuses, so it exits
with code 2 at once, printing its usage); nothing is mocked. tests/integration/test_supervision.py
covers services that come back and serve.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY

from strata.cli.child import Child, describe_exit
from strata.cli.supervisor import RestartPolicy, State, Supervisor, cause
from tests.polling import wait_for

if TYPE_CHECKING:
    from pathlib import Path


def test_the_backoff_doubles_from_half_a_second_to_thirty() -> None:
    policy = RestartPolicy()
    assert [policy.delay_s(n) for n in range(1, 10)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_exits_are_described_by_signal_or_code() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL" and cause(-9) == "SIGKILL"
    assert describe_exit(3) == "exited with code 3" and cause(3) == "exit_3"
    assert describe_exit(0) == "exited with code 0" and cause(0) == "exit_0"


def test_a_service_that_keeps_ending_is_restarted_then_given_up(tmp_path: Path) -> None:
    config = tmp_path / "unused.yaml"
    config.write_text("{}\n")
    child = Child("flaky", "strata.probe", config, tmp_path, "STRATA_FLAKY_", log_file=tmp_path / "flaky.log")
    before = REGISTRY.get_sample_value(
        "strata_supervisor_restarts_total", {"service": "flaky", "cause": "exit_2"}
    )
    reports: list[str] = []
    restarts: list[float] = []

    def restart(again: Child) -> None:
        restarts.append(1.0)
        again.start(os.environ)

    policy = RestartPolicy(
        initial_backoff_s=0.05, max_backoff_s=0.1, crash_loop_restarts=3, crash_loop_window_s=60
    )
    child.start(os.environ)
    supervisor = Supervisor([child], restart, policy, report=reports.append)

    def given_up() -> bool:
        supervisor.tick()
        return supervisor.all_given_up

    wait_for(given_up, 60, lambda: f"the flaky service given up (reports so far: {reports})")
    assert len(restarts) == 2 and supervisor.watched[0].state is State.GIVEN_UP
    assert "flaky exited with code 2; starting it again in 0.1 s" in reports[1]
    assert "usage:" in reports[0]  # its own last lines of output
    assert "it ended 3 times within 60 s, so it is given up; the rest keep serving" in reports[-1]
    after = REGISTRY.get_sample_value(
        "strata_supervisor_restarts_total", {"service": "flaky", "cause": "exit_2"}
    )
    assert (after or 0.0) - (before or 0.0) == 2
    assert REGISTRY.get_sample_value("strata_supervisor_service_up", {"service": "flaky"}) == 0
    child.close_output()
