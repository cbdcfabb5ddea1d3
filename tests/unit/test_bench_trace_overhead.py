"""The tracing-overhead benchmark's pure parts: run checks, the reduction, the verdict, the table, the
options; and its two readers of the real world: the derived config and the CPU-time snapshot."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from bench.trace_overhead import cpu_seconds, parse_args, write_config
from bench.trace_overhead_report import (
    RunResult,
    build_record,
    format_report,
    judge,
    run_problems,
    summarize_mode,
)
from strata.settings import DEFAULT_CONFIG
from tests.polling import wait_for

if TYPE_CHECKING:
    from pathlib import Path

REQUESTS = 10


def _run(mode: str, index: int, gateway: float, worker: float, spans: int = 0, **overrides: Any) -> RunResult:
    fields: dict[str, Any] = {
        "mode": mode,
        "index": index,
        "requests": REQUESTS,
        "completed": REQUESTS,
        "failures": {},
        "token_mismatches": 0,
        "cpu_s": {"gateway": gateway, "worker 0": worker},
        "window_s": 8.0,
        "load_wall_s": 2.0,
        "spans": spans,
        "span_names": {"gateway/request": spans} if spans else {},
    }
    return RunResult(**{**fields, **overrides})


def _runs(count: int = 3) -> list[RunResult]:
    """Off: 1.0, 1.1, 1.2 CPU-s in all per run; on: 1.04, 1.2, 1.1 (medians 0.11 and 0.11 s/request)."""
    runs = []
    for index, (off, on) in enumerate([(1.0, 1.04), (1.1, 1.2), (1.2, 1.1)][:count]):
        runs.append(_run("off", index, 0.2 * off, 0.8 * off))
        runs.append(_run("on", index, 0.2 * on, 0.8 * on, spans=3 * REQUESTS))
    return runs


def test_a_run_reduces_to_cpu_seconds_and_spans_per_request() -> None:
    run = _run("on", 0, 0.5, 1.5, spans=25)
    assert run.cpu_s_total == pytest.approx(2.0)
    assert run.cpu_s_per_request == pytest.approx(0.2)
    assert run.spans_per_request == pytest.approx(2.5)
    assert run_problems(run, REQUESTS) == []


def test_run_problems_void_failed_miscounted_and_untraced_runs() -> None:
    assert run_problems(_run("off", 0, 1, 1), REQUESTS) == []
    failed = _run("off", 1, 1, 1, completed=8, failures={"UNAVAILABLE": 2})
    assert run_problems(failed, REQUESTS) == ["run 2 tracing off: 2 requests failed (UNAVAILABLE x2)"]
    assert "miscounted" in run_problems(_run("off", 0, 1, 1, token_mismatches=1), REQUESTS)[0]
    assert "sent 9 requests" in run_problems(_run("off", 0, 1, 1, requests=9, completed=9), REQUESTS)[0]
    # Tracing on with fewer spans than requests means the spans did not come: no overhead was measured.
    assert "got 9 spans for 10 requests" in run_problems(_run("on", 0, 1, 1, spans=9), REQUESTS)[0]
    assert run_problems(_run("on", 0, 1, 1, spans=10), REQUESTS) == []
    assert "tracing off, yet" in run_problems(_run("off", 0, 1, 1, spans=1), REQUESTS)[0]


def test_summarize_mode_takes_medians_and_spreads() -> None:
    summary = summarize_mode([run for run in _runs() if run.mode == "off"])
    assert summary["runs"] == 3
    assert summary["cpu_s_per_request"] == pytest.approx(0.11)
    assert summary["cpu_s_per_request_spread"] == pytest.approx([0.10, 0.12])
    assert summary["cpu_s_per_request_runs"] == pytest.approx([0.10, 0.11, 0.12])
    assert summary["per_process_cpu_s_per_request"] == pytest.approx({"gateway": 0.022, "worker 0": 0.088})
    assert summary["spans_per_request"] == 0
    with pytest.raises(ValueError, match="at least one run"):
        summarize_mode([])


def test_judge_compares_medians_against_the_target() -> None:
    off = summarize_mode([run for run in _runs() if run.mode == "off"])
    on = summarize_mode([run for run in _runs() if run.mode == "on"])
    verdict = judge(off, on)
    assert verdict["cpu_ratio_on_off"] == pytest.approx(1.0)
    assert verdict["cpu_ratio_on_off_pairs"] == pytest.approx([1.04, 1.2 / 1.1, 1.1 / 1.2])
    assert verdict["pass"] is True
    assert verdict["cpu_ratio_max"] == 1.05
    costly = {**on, "cpu_s_per_request": 0.11 * 1.06}
    assert judge(off, costly)["pass"] is False
    assert judge(off, {**on, "cpu_s_per_request": 0.11 * 1.049})["pass"] is True


def test_record_is_valid_only_with_enough_clean_runs_and_no_smoke() -> None:
    record = build_record(
        _runs(), expected_requests=REQUESTS, smoke=False, provenance={"commit": "x"}, config={}
    )
    assert record["valid"] is True and record["voided"] is False
    assert record["invalid_reasons"] == []
    assert record["modes"]["on"]["spans_per_request"] == pytest.approx(3.0)
    assert record["target"]["pass"] is True
    assert len(record["runs"]) == 6 and record["runs"][0]["cpu_s_per_request"] == pytest.approx(0.1)

    few = build_record(_runs(1), expected_requests=REQUESTS, smoke=True, provenance={}, config={})
    assert few["valid"] is False and few["voided"] is False
    assert "1 runs with tracing off: at least 3 count" in few["invalid_reasons"]
    assert "--smoke run" in few["invalid_reasons"]

    broken = [*_runs()[:-1], _run("on", 2, 0.2, 0.9, spans=0)]
    void = build_record(broken, expected_requests=REQUESTS, smoke=False, provenance={}, config={})
    assert void["valid"] is False and void["voided"] is True


def test_report_shows_each_mode_per_process_and_the_verdict() -> None:
    record = build_record(_runs(), expected_requests=REQUESTS, smoke=False, provenance={}, config={})
    lines = format_report(record).splitlines()
    assert lines[0].split() == [
        "tracing",
        "CPU",
        "ms/req",
        "(min-max)",
        "spans/req",
        "gateway",
        "worker",
        "0",
    ]
    assert lines[1].split() == ["off", "110.00", "100.00-120.00", "0.00", "22.00", "88.00"]
    assert lines[2].split()[:4] == ["on", "110.00", "104.00-120.00", "3.00"]
    assert lines[3].startswith("CPU per request on/off: 1.000 (target <= 1.05): PASS")
    assert len(lines) == 4
    late = [*_runs()[:-1], _run("on", 2, 0.22, 0.88, spans=30, late_spans=4)]
    report = format_report(
        build_record(late, expected_requests=REQUESTS, smoke=True, provenance={}, config={})
    )
    assert "4 spans came after their window closed" in report
    assert "not a valid result: --smoke run" in report


def test_options_take_defaults_smoke_sizes_and_refuse_too_few_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args([])
    assert (args.runs, args.requests, args.concurrency, args.prompt_tokens, args.new_tokens) == (
        5,
        64,
        16,
        32,
        32,
    )
    assert args.warmup_requests == 16
    assert str(args.json) == "bench/results/trace-overhead-cpu.json"
    smoke = parse_args(["--smoke", "--requests", "6"])
    assert (smoke.runs, smoke.requests, smoke.json) == (1, 6, None)
    with pytest.raises(SystemExit):
        parse_args(["--runs", "2"])
    assert "at least 3" in capsys.readouterr().err


def test_write_config_sets_telemetry_admits_the_whole_run_and_makes_paths_absolute(tmp_path: Path) -> None:
    from services.tokenizer.settings import TokenizerSettings
    from services.worker.settings import WorkerSettings

    telemetry = {"tracing": "on", "otlp_endpoint": "http://127.0.0.1:9", "sampling_ratio": 1.0}
    path = write_config(DEFAULT_CONFIG, telemetry, tmp_path, "on", 64)
    assert path.parent == tmp_path
    written = yaml.safe_load(path.read_text())
    # The source's own telemetry keys stay unless the run sets them.
    source_telemetry = yaml.safe_load(DEFAULT_CONFIG.read_text()).get("telemetry") or {}
    assert written["telemetry"] == {**source_telemetry, **telemetry}
    primary = WorkerSettings.load(path, index=0)
    assert primary.model_path == WorkerSettings.load(DEFAULT_CONFIG, index=0).model_path
    assert primary.model_path.is_absolute()
    assert primary.telemetry.tracing == "on" and primary.telemetry.sampling_ratio == 1.0
    assert primary.telemetry.otlp_endpoint == "http://127.0.0.1:9"
    tokenizer = TokenizerSettings.load(path)
    assert tokenizer.models == TokenizerSettings.load(DEFAULT_CONFIG).models
    # The routes as the source has them, but admitting all 64 requests: no SLO, a queue that long.
    source_routes = yaml.safe_load(DEFAULT_CONFIG.read_text())["gateway"]["routes"]
    admit_all = {"ttft_slo_ms": 0.0, "max_queued_requests": 64}
    assert written["gateway"]["routes"] == [{**route, **admit_all} for route in source_routes]
    off = write_config(DEFAULT_CONFIG, {"tracing": "off"}, tmp_path, "off", 64)
    assert WorkerSettings.load(off, index=1).telemetry.tracing == "off"


def test_cpu_seconds_counts_a_busy_process_and_refuses_a_dead_one() -> None:
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(30)"])
    try:
        wait_for(
            lambda: cpu_seconds({"busy": child.pid})["busy"],
            20.0,
            "the busy child showed 0.3 CPU-s",
            until=lambda seconds: seconds >= 0.3,
            interval_s=0.05,
        )
        before = cpu_seconds({"busy": child.pid, "me": os.getpid()})
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        after = cpu_seconds({"busy": child.pid, "me": os.getpid()})
        assert after["me"] - before["me"] >= 0.15
        assert after["busy"] - before["busy"] < 0.1  # it sleeps now
    finally:
        child.kill()
        child.wait()
    from bench.trace_overhead import BenchError

    with pytest.raises(BenchError, match="is gone"):
        cpu_seconds({"busy": child.pid})
