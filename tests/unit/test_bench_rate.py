"""`strata bench --rate`: the arrival schedule, the goodput accounting, refusal reasons, the verdict, the
options and the plot; the open-loop driver against an in-process gRPC gateway that answers slowly and
refuses some requests with a retry hint."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from bench.plots import write_rate_plot
from bench.rate import arrival_offsets, arrivals_per_phase, drain, rate_request, run_phase
from bench.rate_report import (
    RateResult,
    aggregate_phase,
    build_rate_record,
    fallback_key,
    format_rate_report,
    judge_rate,
    refusal_reason,
    summarize_phase,
)
from bench.stack import add_arguments, main, resolve
from bench.stack_prompts import Prompt
from strata.status import ResourceExhausted, abort
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

PRIMARY, FALLBACK = "primary", "fallback"
NEW = 4
SLO_MS = 1000.0
SATURATED = "primary saturated: queue full: 4 requests waiting"


def test_fixed_arrivals_are_evenly_spaced_from_zero() -> None:
    assert arrival_offsets(4.0, 5, "fixed", "s") == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_arrivals_are_seeded_with_the_asked_mean_rate() -> None:
    offsets = arrival_offsets(10.0, 20_000, "poisson", "seed")
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed interval would have none).
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.05)
    assert arrival_offsets(10.0, 50, "poisson", "seed") == offsets[:50]
    assert arrival_offsets(10.0, 50, "poisson", "other") != offsets[:50]
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(0.0, 5, "poisson", "s")
    with pytest.raises(ValueError, match="poisson or fixed"):
        arrival_offsets(1.0, 5, "bursty", "s")


def test_arrivals_per_phase_come_from_rate_and_duration_unless_given() -> None:
    assert arrivals_per_phase(7.5, 20.0, None) == 150
    assert arrivals_per_phase(0.01, 3.0, None) == 1
    assert arrivals_per_phase(7.5, 20.0, 12) == 12


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("queue full: 64 requests waiting", "queue_full"),
        ("route 'x': token budget: 40000 prompt tokens queued, limit 32768", "token_budget"),
        ("predicted time to first token 3.1 s exceeds the SLO 2.0 s", "ttft_slo"),
        ("predicted wait 4.0 s exceeds the deadline's 1.2 s", "predicted_wait"),
        ("batch request shed under overload", "shed"),
        ("every worker for model 'x' is at capacity; retry shortly", "no_credit"),
        ("reason=queue_full", "queue_full"),
        ("something else entirely", "other"),
    ],
)
def test_refusal_reasons_are_read_from_the_message(message: str, reason: str) -> None:
    assert refusal_reason(message) == reason


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        (
            "primary saturated: predicted time to first token 3.1 s exceeds the SLO 2.0 s",
            "primary_saturated:ttft_slo",
        ),
        ("primary tiny unavailable: worker 127.0.0.1:5 is NOT_SERVING", "primary_unavailable"),
        ("primary failed before the first token: worker died", "primary_failed"),
        ("primary tiny failed mid-stream after 5 tokens: connection lost", "failover"),
        ("", "none given"),
    ],
)
def test_fallback_reasons_are_keyed_by_trigger(reason: str, key: str) -> None:
    assert fallback_key(reason) == key


def _ok(index: int, ttft_s: float, model: str = PRIMARY, tokens: int = NEW, **extra: Any) -> RateResult:
    return RateResult(
        index=index, send_lag_s=0.001 * index, status="OK", ttft_s=ttft_s, e2e_s=ttft_s + 0.1,
        token_ids=list(range(tokens)), model=model, usage_input_tokens=8, usage_output_tokens=NEW, **extra,
    )  # fmt: skip


def _refused(index: int, message: str, decision_s: float, hint: float | None = 1.0) -> RateResult:
    return RateResult(
        index=index, send_lag_s=0.0, status="RESOURCE_EXHAUSTED", ttft_s=None, e2e_s=decision_s,
        message=message, retry_hint_s=hint,
    )  # fmt: skip


def _phase(name: str, results: list[RateResult], wall_s: float = 2.0) -> dict[str, Any]:
    return summarize_phase(
        results, phase=name, wall_s=wall_s, input_tokens=[8] * len(results), new_tokens=NEW,
        slo_ms=SLO_MS, primary=PRIMARY,
    )  # fmt: skip


def test_goodput_counts_only_completed_requests_within_the_slo() -> None:
    results = [
        _ok(0, 0.2),
        _ok(1, 1.0),  # exactly at the SLO: met
        _ok(2, 1.5),  # late: completed, but not goodput
        _ok(3, 0.3, model=FALLBACK, fallback_reason=SATURATED),
        _ok(4, 0.4, model=FALLBACK, fallback_reason=SATURATED, failover_at_token=2),
        _ok(5, 0.5, tokens=NEW - 1),  # miscounted: completed, counted, flagged
        _refused(6, "queue full: 8 requests waiting", 0.002),
        _refused(7, "predicted time to first token 3.0 s exceeds the SLO 1.0 s", 0.004, hint=None),
        RateResult(index=8, send_lag_s=0.0, status="UNAVAILABLE", ttft_s=None, e2e_s=0.1, message="gone"),
    ]
    summary = _phase("on", results)
    assert summary["offered"] == 9 and summary["completed"] == 6 and summary["refused"] == 2
    assert summary["good_requests"] == 5
    assert summary["good_tokens"] == 4 * NEW + NEW - 1
    assert summary["goodput_tok_s"] == pytest.approx((5 * NEW - 1) / 2.0)
    assert summary["output_tok_s"] == pytest.approx((6 * NEW - 1) / 2.0)
    assert summary["refusals"] == {"RESOURCE_EXHAUSTED": 2}
    assert summary["refusal_reasons"] == {"queue_full": 1, "ttft_slo": 1}
    assert summary["refusals_with_retry_hint"] == 1
    assert summary["refusal_decision_ms"]["p50"] == pytest.approx(3.0)
    assert summary["refusal_decision_ms"]["p99"] == pytest.approx(3.98)
    assert summary["ttft_ms"]["p99"] == pytest.approx(1000 * (1.0 + 0.95 * 0.5))
    assert summary["served_by"] == {PRIMARY: 4, FALLBACK: 2}
    assert summary["fallback_served"] == 2
    assert summary["fallback_share"] == pytest.approx(2 / 6)
    assert summary["fallback_reasons"] == {"primary_saturated:queue_full": 2}
    assert summary["fallback_reason_examples"] == ["primary saturated: queue full: 4 requests waiting"]
    assert summary["failovers"] == 1
    assert summary["errors"] == {"UNAVAILABLE": 1}
    assert summary["error_examples"] == ["UNAVAILABLE: gone"]
    assert summary["token_mismatches"] == 1
    assert summary["send_lag_ms"]["max"] == pytest.approx(5.0)


def _round(off_tokens: int, on_tokens: int, on_ttft_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    off = [_ok(i, 0.1) for i in range(off_tokens)] + [_refused(99, "queue full", 0.001)]
    on = [_ok(i, on_ttft_s) for i in range(on_tokens)]
    return _phase("off", off, 1.0), _phase("on", on, 1.0)


def test_rounds_reduce_to_medians_and_the_verdict_judges_ratio_and_slo() -> None:
    rounds = [_round(4, 8, 0.2), _round(5, 6, 0.3), _round(4, 7, 0.25)]
    off = aggregate_phase([r[0] for r in rounds])
    on = aggregate_phase([r[1] for r in rounds])
    assert off["goodput_tok_s"] == pytest.approx(4 * NEW)
    assert off["goodput_tok_s_spread"] == pytest.approx([4 * NEW, 5 * NEW])
    assert on["goodput_tok_s"] == pytest.approx(7 * NEW)
    assert off["refused"] == 3 and off["refusal_reasons"] == {"queue_full": 3}
    assert on["ttft_ms"]["p99"] == pytest.approx(250.0)
    assert len(on["runs"]) == 3
    verdict = judge_rate(off, on, SLO_MS)
    assert verdict["goodput_ratio"] == pytest.approx(7 / 4)
    assert verdict["goodput_ratio_runs"] == pytest.approx([2.0, 6 / 5, 7 / 4])
    assert verdict["goodput_pass"] is True and verdict["ttft_pass"] is True and verdict["pass"] is True

    late = aggregate_phase([_round(4, 8, 1.2)[1]])
    failed = judge_rate(aggregate_phase([rounds[0][0]]), late, SLO_MS)
    # Late requests are no goodput at all: the ratio drops to 0 and TTFT p99 breaks the SLO.
    assert failed["goodput_ratio"] == 0.0 and failed["ttft_pass"] is False and failed["pass"] is False

    nothing = aggregate_phase([_phase("off", [_refused(0, "queue full", 0.001)])])
    unbounded = judge_rate(nothing, aggregate_phase([rounds[0][1]]), SLO_MS)
    assert unbounded["goodput_ratio"] is None and unbounded["goodput_pass"] is True


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _record(tmp_path: Path, off: list[RateResult], on: list[RateResult]) -> dict[str, Any]:
    args = _args("--rate", "4", "--smoke", "--json", str(tmp_path / "r.json"))
    assert resolve(args) is None
    workload = {
        "model": PRIMARY, "fallback_model": FALLBACK, "prompt_tokens": 8, "new_tokens": NEW, "rate_rps": 4.0,
        "rate_source": "--rate", "arrival": "poisson", "arrivals_per_phase": len(off), "ttft_slo_ms": SLO_MS,
    }  # fmt: skip
    phases = {"off": aggregate_phase([_phase("off", off)]), "on": aggregate_phase([_phase("on", on)])}
    return build_rate_record(
        args, stack={}, machine={"cpu_model": "test cpu"}, workload=workload, capacity=None, phases=phases
    )


def test_the_record_is_voided_by_errors_and_by_the_fallback_serving_with_fallback_off(tmp_path: Path) -> None:
    clean = _record(tmp_path, [_ok(0, 0.1), _refused(1, "queue full", 0.001)], [_ok(0, 0.1), _ok(1, 0.2)])
    assert clean["voided"] is False and clean["invalid_reasons"] == ["--smoke run"]
    assert clean["target"]["goodput_ratio"] == pytest.approx(2.0)
    assert "network hop" in clean["notes"]["refusal_decision_ms"]
    text = format_rate_report(clean)
    assert "goodput on/off: 2.00" in text and "PASS" in text and "queue_full:1" in text

    leaked = _record(
        tmp_path, [_ok(0, 0.1, model=FALLBACK, fallback_reason="primary unavailable")], [_ok(0, 0.1)]
    )
    assert leaked["voided"] is True
    assert any("fallback off" in reason for reason in leaked["invalid_reasons"])
    failed = RateResult(index=1, send_lag_s=0.0, status="INTERNAL", ttft_s=None, e2e_s=0.1)
    broken = _record(tmp_path, [_ok(0, 0.1)], [_ok(0, 0.1), failed])
    assert broken["voided"] is True and "errors {'INTERNAL': 1}" in broken["invalid_reasons"][0]


def test_the_rate_plot_is_a_png(tmp_path: Path) -> None:
    record = _record(
        tmp_path,
        [_ok(0, 0.1), _refused(1, "queue full", 0.001), _refused(2, "token budget", 0.002)],
        [_ok(0, 0.1), _ok(1, 0.9, model=FALLBACK, fallback_reason="primary saturated")],
    )
    path = tmp_path / "plots" / "rate.png"
    write_rate_plot(record, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_rate_options_take_open_loop_defaults_and_refuse_closed_loop_ones(tmp_path: Path) -> None:
    args = _args("--rate", "auto")
    assert resolve(args) is None
    assert args.rate == "auto"
    assert (args.prompt_tokens, args.new_tokens, args.runs, args.duration, args.gap) == (32, 32, 3, 20.0, 3.0)
    assert args.arrival == "poisson" and args.rate_factor == 2.0 and args.ttft_slo_ms is None
    args = _args("--rate", "12.5", "--smoke", "--arrival", "fixed", "--json", str(tmp_path / "x.json"))
    assert resolve(args) is None
    assert args.rate == 12.5 and args.runs == 1 and args.plot == tmp_path / "x.png"
    for argv in (("--engine-baseline",), ("--concurrency", "1,8"), ("--runs", "2"), ("--ttft-slo-ms", "0")):
        assert resolve(_args("--rate", "3", *argv)) is not None, argv
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            _args("--rate", bad)
    assert main(["--rate", "3", "--engine-baseline"]) == 2


def test_requests_say_whether_the_fallback_may_serve_them() -> None:
    prompt = Prompt("some words", (1, 2))
    off = rate_request(prompt, NEW, "r-off", PRIMARY, fallback=False)
    on = rate_request(prompt, NEW, "r-on", PRIMARY, fallback=True)
    assert (off.no_fallback, off.allow_fallback) == (True, False)
    assert (on.no_fallback, on.allow_fallback) == (False, True)
    for request in (off, on):
        assert request.priority == gateway_pb2.PRIORITY_INTERACTIVE
        assert request.sampling.ignore_eos and request.sampling.temperature == 0.0
        assert request.sampling.max_new_tokens == NEW and request.model == PRIMARY


class _SlowGateway(gateway_pb2_grpc.GatewayServicer):
    """Holds every stream `hold_s` before its tokens; refuses requests whose id ends in an odd digit."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.in_flight = 0
        self.most_in_flight = 0
        self.list_calls = 0

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.GenerateResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the driver streams")
        raise AssertionError("abort returned")

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.ListModelsResponse:
        self.list_calls += 1
        queued = max(0, 2 - self.list_calls)  # the queue reads empty from the second call on
        return gateway_pb2.ListModelsResponse(
            models=[gateway_pb2.ModelInfo(name=PRIMARY, queued_requests=queued)]
        )

    async def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        if int(request.request_id[-1]) % 2:
            await abort(context, ResourceExhausted("queue full: 2 requests waiting", 0.25))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        model = FALLBACK if request.allow_fallback else PRIMARY
        yield gateway_pb2.GenerateStreamResponse(token_ids=list(range(NEW)))
        usage = common_pb2.Usage(input_tokens=2, output_tokens=NEW)
        final = gateway_pb2.GenerateResponse(model=model, usage=usage, fallback_reason="primary saturated")
        yield gateway_pb2.GenerateStreamResponse(final=final)


def test_the_driver_sends_on_schedule_without_waiting_for_answers() -> None:
    async def drive() -> tuple[list[RateResult], float, int]:
        server = grpc.aio.server()
        servicer = _SlowGateway(hold_s=0.5)
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub: Any = gateway_pb2_grpc.GatewayStub(channel)
                prompt = Prompt("x", (1, 2))
                requests = [rate_request(prompt, NEW, f"r{i}", PRIMARY, fallback=True) for i in range(10)]
                offsets = arrival_offsets(50.0, 10, "fixed", "s")
                results, wall = await run_phase(
                    stub, requests, offsets, timeout_s=30.0, label="t", progress=False
                )
                await drain(stub, 0.0)
        finally:
            await server.stop(None)
        assert servicer.list_calls == 2  # drain polled until the queue read empty
        return results, wall, servicer.most_in_flight

    started = time.perf_counter()
    results, wall, most_in_flight = asyncio.run(drive())
    assert [r.index for r in results] == list(range(10))
    # Open loop: the five accepted streams overlapped instead of running one after another.
    assert most_in_flight == 5
    assert wall < 5 * (0.18 + 0.5) and time.perf_counter() - started < 10.0
    accepted = [r for r in results if r.status == "OK"]
    refused = [r for r in results if r.status == "RESOURCE_EXHAUSTED"]
    assert [r.index for r in accepted] == [0, 2, 4, 6, 8]
    assert all(r.ttft_s is not None and r.ttft_s >= 0.45 for r in accepted)
    assert all(r.model == FALLBACK and r.usage_output_tokens == NEW for r in accepted)
    assert all(r.message == "queue full: 2 requests waiting" for r in refused)
    assert all(r.retry_hint_s == pytest.approx(0.25) for r in refused)
    assert all(r.e2e_s < 0.45 for r in refused)  # answered at once, not after the hold
    summary = _phase("on", results)
    assert summary["refusal_reasons"] == {"queue_full": 5} and summary["fallback_served"] == 5


def test_the_slo_and_the_primary_worker_come_from_the_config(tmp_path: Path) -> None:
    import yaml

    from bench.rate_run import DEFAULT_SLO_MS, primary_worker, route_slo_ms

    def config(routes: list[dict[str, Any]]) -> Path:
        workers = [
            {
                "model_name": name,
                "model_path": str(tmp_path),
                "threads": threads,
                "engine": {"max_num_seqs": seqs},
            }
            for name, threads, seqs in ((PRIMARY, 1, 12), (FALLBACK, 2, 6))
        ]
        path = tmp_path / "stack.yaml"
        path.write_text(yaml.safe_dump({"workers": workers, "gateway": {"routes": routes}}))
        return path

    path = config([{"model": PRIMARY, "ttft_slo_ms": 750}])
    assert route_slo_ms(path, PRIMARY) == (750.0, f"{path}: gateway.routes[{PRIMARY}].ttft_slo_ms")
    fallback = primary_worker(path, FALLBACK)
    assert fallback is not None and (fallback.threads, fallback.engine.max_num_seqs) == (2, 6)
    assert primary_worker(path, "absent") is None
    # No SLO for the route: the gateway's own default; the check turned off: the bench's default.
    assert route_slo_ms(config([]), PRIMARY)[0] == 2000.0
    slo, source = route_slo_ms(config([{"model": PRIMARY, "ttft_slo_ms": 0}]), PRIMARY)
    assert slo == DEFAULT_SLO_MS and "off" in source


@pytest.mark.slow
def test_smoke_run_against_a_spawned_tiny_stack_with_a_fallback(
    tmp_path: Path, tiny_serving_dir: Path, tiny_fallback_dir: Path
) -> None:
    import json

    import yaml

    def worker(name: str, path: Path) -> dict[str, Any]:
        # Two sequences, two credits: the primary saturates at a few times its capacity.
        engine = {"num_blocks": 32, "max_num_seqs": 2, "max_num_batched_tokens": 64}
        return {"model_name": name, "model_path": str(path), "device": "cpu", "threads": 1, "engine": engine,
                "max_requests": 2}  # fmt: skip

    route = {"model": PRIMARY, "fallback": FALLBACK, "max_queued_requests": 2, "ttft_slo_ms": 5000}
    models = {PRIMARY: str(tiny_serving_dir), FALLBACK: str(tiny_fallback_dir)}
    config = {
        "tokenizer": {"listen": "127.0.0.1:0", "models": models},
        "workers": [worker(PRIMARY, tiny_serving_dir), worker(FALLBACK, tiny_fallback_dir)],
        "gateway": {"listen": "127.0.0.1:0", "default_model": PRIMARY, "routes": [route]},
    }
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "rate.json"
    argv = [
        "--spawn", "--config", str(path), "--smoke", "--rate", "auto", "--rate-factor", "3",
        "--arrival", "fixed", "--arrivals", "40", "--json", str(out), "--no-progress",
        "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["smoke"] is True and record["voided"] is False
    capacity, workload = record["capacity"], record["workload"]
    assert capacity["concurrency"] == 2 and capacity["completed"] == capacity["requests"] == 4
    assert workload["rate_rps"] == pytest.approx(3 * capacity["requests_per_s"])
    assert workload["fallback_model"] == FALLBACK and workload["ttft_slo_ms"] == 5000.0
    off, on = record["phases"]["off"], record["phases"]["on"]
    for phase in (off, on):
        assert phase["offered"] == 40 and phase["errors"] == {} and phase["token_mismatches"] == 0
        assert phase["completed"] + phase["refused"] == 40
    # Fallback off: the primary alone, the overflow refused at once with a reason and a retry hint.
    assert off["served_by"] == {PRIMARY: off["completed"]} and off["refused"] > 0
    assert set(off["refusal_reasons"]) <= {"queue_full", "ttft_slo", "predicted_wait"}
    assert off["runs"][0]["refusals_with_retry_hint"] == off["refused"]
    assert off["refusal_decision_ms"]["p99"] is not None
    # Fallback on: the fallback took some of the overflow, and said why.
    assert on["fallback_served"] > 0 and on["served_by"].get(FALLBACK) == on["fallback_served"]
    assert all(key.startswith("primary_saturated") for key in on["fallback_reasons"])
    assert {"goodput_ratio", "ttft_pass", "pass"} <= set(record["target"])
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_no_gateway_is_a_clear_error_for_the_open_loop_too(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 needs root to listen on: nothing answers there.
    assert main(["--rate", "5", "--address", "127.0.0.1:1", "--smoke", "--no-progress"]) == 1
    assert "no gateway answers at 127.0.0.1:1" in capsys.readouterr().err
