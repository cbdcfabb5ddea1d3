"""`strata bench --rate` end to end: the open-loop driver against an in-process gRPC gateway that answers
slowly and refuses some requests with a retry hint (and the closed loop against the same gateway, through
the same request driver), a list of rates run in turn against that gateway with its decision histogram
scraped, the SLO and worker read from a stack config, a smoke run against a spawned tiny stack with a
fallback, and the error when no gateway answers.

The schedule, accounting, verdict and options are tests/unit/test_bench_rate.py's, the admission rule
and the histogram tests/unit/test_bench_rate_admission.py's, the comparison and the plot
tests/unit/test_bench_rate_compare.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from bench.driver import send
from bench.gateway_metrics import DECISION_HISTOGRAM
from bench.load import run_level, summarize_level
from bench.rate import arrival_offsets, drain, rate_request, run_phase
from bench.stack import main
from bench.stack_prompts import Prompt
from strata.status import ResourceExhausted, abort
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway_thread import serving_in_a_thread
from tests.tiny_tokenizer import write_tiny_tokenizer
from tests.unit.bench_rate_helpers import FALLBACK, NEW, PRIMARY, phase_summary

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from bench.driver import RequestResult
    from bench.load import LevelRun


class _SlowGateway(gateway_pb2_grpc.GatewayServicer):
    """Holds every stream `hold_s` before its tokens; refuses requests whose id ends in an odd digit.

    With a `decisions` histogram it observes each decision as the gateway does (2 ms a refusal).
    """

    def __init__(self, hold_s: float, input_tokens: int = 2, decisions: Histogram | None = None) -> None:
        self.hold_s = hold_s
        self.input_tokens = input_tokens
        self.decisions = decisions
        self.in_flight = 0
        self.most_in_flight = 0
        self.list_calls = 0
        self.received: list[gateway_pb2.GenerateRequest] = []

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
            default_model=PRIMARY, models=[gateway_pb2.ModelInfo(name=PRIMARY, queued_requests=queued)]
        )

    async def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        self.received.append(request)
        refuse = int(request.request_id[-1]) % 2 == 1
        if self.decisions is not None:
            self.decisions.labels(PRIMARY, "refused" if refuse else "admitted").observe(
                0.002 if refuse else 0.0001
            )
        if refuse:
            await abort(context, ResourceExhausted("queue full: 2 requests waiting", 0.25))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        model = FALLBACK if request.allow_fallback else PRIMARY
        yield gateway_pb2.GenerateStreamResponse(token_ids=list(range(NEW)))
        usage = common_pb2.Usage(input_tokens=self.input_tokens, output_tokens=NEW)
        final = gateway_pb2.GenerateResponse(model=model, usage=usage, fallback_reason="primary saturated")
        yield gateway_pb2.GenerateStreamResponse(final=final)


@contextlib.asynccontextmanager
async def _serving(servicer: _SlowGateway) -> AsyncIterator[Any]:
    """A stub on a channel to `servicer`, served in this process on a free port."""
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        await server.stop(None)


def test_the_driver_sends_on_schedule_without_waiting_for_answers() -> None:
    async def drive() -> tuple[list[RequestResult], float, int]:
        servicer = _SlowGateway(hold_s=0.5)
        async with _serving(servicer) as stub:
            prompt = Prompt("x", (1, 2))
            requests = [rate_request(prompt, NEW, f"r{i}", PRIMARY, fallback=True) for i in range(10)]
            offsets = arrival_offsets(50.0, 10, "fixed", "s")
            results, wall = await run_phase(
                stub, requests, offsets, timeout_s=30.0, label="t", progress=False
            )
            await drain(stub, 0.0)
            # The client's own lateness against the schedule is kept, not folded into the latencies.
            late = await send(stub, 0, requests[0], 30.0, due=time.perf_counter() - 1.0)
        assert servicer.list_calls == 2  # drain polled until the queue read empty
        assert late.send_lag_s >= 1.0 and late.e2e_s < 1.0
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
    summary = phase_summary("on", results)
    assert summary["refusal_reasons"] == {"queue_full": 5} and summary["fallback_served"] == 5


def test_the_closed_loop_keeps_its_streams_busy_and_reads_refusals_the_same_way() -> None:
    async def drive() -> tuple[LevelRun, int]:
        servicer = _SlowGateway(hold_s=0.2)
        async with _serving(servicer) as stub:
            prompt = Prompt("x", (1, 2))
            requests = [rate_request(prompt, NEW, f"c{i}", PRIMARY, fallback=False) for i in range(8)]
            run = await run_level(stub, requests, 2, timeout_s=30.0, label="t", progress=False)
        return run, servicer.most_in_flight

    run, most_in_flight = asyncio.run(drive())
    # Closed loop: two streams, both busy at once, never more in flight than that.
    assert most_in_flight == 2
    assert [r.index for r in run.results] == list(range(8))
    accepted = [r for r in run.results if r.status == "OK"]
    refused = [r for r in run.results if r.status == "RESOURCE_EXHAUSTED"]
    assert [r.index for r in accepted] == [0, 2, 4, 6]
    assert all(r.ttft_s is not None and r.ttft_s >= 0.18 for r in accepted)
    assert all(r.send_lag_s == 0.0 for r in run.results)  # no schedule, so never late
    assert all(r.model == PRIMARY and r.usage_input_tokens == 2 for r in accepted)
    assert all(r.token_ids == list(range(NEW)) for r in accepted)
    # The request driver is the open loop's: a refusal keeps its message and retry hint here too.
    assert all(r.message == "queue full: 2 requests waiting" for r in refused)
    assert all(r.retry_hint_s == pytest.approx(0.25) for r in refused)
    assert 2 * 0.2 < run.wall_s < 8 * 0.2
    summary = summarize_level(run, [2] * 8, NEW)
    assert summary["refusals"] == {"RESOURCE_EXHAUSTED": 4} and summary["completed"] == 4
    assert summary["errors"] == {} and summary["token_mismatches"] == 0


def test_a_list_of_rates_runs_each_in_turn_with_the_gateway_histogram_scraped(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    buckets = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
    decisions = Histogram(DECISION_HISTOGRAM, "d", ["model", "outcome"], buckets=buckets, registry=registry)
    metrics, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    servicer = _SlowGateway(hold_s=0.05, input_tokens=16, decisions=decisions)
    worker = {"model_name": PRIMARY, "model_path": str(write_tiny_tokenizer(tmp_path)), "device": "cpu"}
    config = tmp_path / "stack.yaml"
    config.write_text(
        yaml.safe_dump(
            {"workers": [worker], "gateway": {"routes": [{"model": PRIMARY, "ttft_slo_ms": 5000}]}}
        )
    )
    out = tmp_path / "rates.json"
    try:
        with serving_in_a_thread(servicer) as address:
            argv = [
                "--address", address, "--gateway-metrics", f"127.0.0.1:{metrics.server_port}",
                "--config", str(config), "--smoke", "--rate", "40,20", "--arrival", "fixed",
                "--arrivals", "6", "--prompt-tokens", "16", "--new-tokens", str(NEW), "--gap", "0",
                "--warmup-requests", "0", "--json", str(out), "--no-progress",
            ]  # fmt: skip
            assert main(argv) == 0
    finally:
        metrics.shutdown()
        metrics.server_close()
        thread.join(5)
    record = json.loads(out.read_text())
    assert record["voided"] is False and record["capacity"] is None  # a fixed list: no capacity run
    assert record["stack"]["gateway_metrics"] == f"127.0.0.1:{metrics.server_port}"
    assert len(record["checkout"]["commit"]) == 40 and isinstance(record["checkout"]["dirty"], bool)
    assert [(e["rate_rps"], e["rate_source"]) for e in record["rates"]] == [
        (40.0, "--rate"),
        (20.0, "--rate"),
    ]
    for rate in record["rates"]:
        assert rate["arrivals_per_phase"] == 6 and rate["schedule_s"] == pytest.approx(5 / rate["rate_rps"])
        for name in ("off", "on"):
            phase = rate["phases"][name]
            # Odd request ids are refused at once: 3 refused, 3 admitted, and the gateway saw the same.
            assert (phase["offered"], phase["refused"], phase["admitted"]) == (6, 3, 3), name
            assert phase["gateway_decision"]["refused"]["count"] == 3
            assert phase["gateway_decision"]["refused"]["p99_ms"] == pytest.approx(2.5)
            assert phase["gateway_decision"]["admitted"]["count"] == 3
            route = "fallback" if name == "on" else "primary"
            assert phase["routes"][route]["admitted"] == 3 and phase["routes"][route]["met_slo"] == 3
        assert rate["target"]["gateway_refusal_p99"]["off"]["pass"] is True
    # Rates one after the other, each OFF then ON; every phase's prompts its own.
    order = [request.request_id.rsplit("-", 1)[0] for request in servicer.received]
    assert list(dict.fromkeys(order)) == [
        "bench-0-r0-off",
        "bench-0-r0-on",
        "bench-1-r0-off",
        "bench-1-r0-on",
    ]
    prompts = {
        prefix: {r.prompt for r in servicer.received if r.request_id.startswith(prefix)} for prefix in order
    }
    assert len(set.union(*prompts.values())) == sum(len(texts) for texts in prompts.values()) == 24
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_the_slo_and_the_primary_worker_come_from_the_config(tmp_path: Path) -> None:
    from bench.rate_target import DEFAULT_SLO_MS, primary_worker, route_slo_ms

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
    assert record["checkout"]["commit"] and record["stack"]["gateway_metrics"]  # the launcher's address
    capacity, workload = record["capacity"], record["workload"]
    assert capacity["concurrency"] == 2 and capacity["completed"] == capacity["requests"] == 4
    assert workload["fallback_model"] == FALLBACK and workload["ttft_slo_ms"] == 5000.0
    (rate,) = record["rates"]
    assert rate["rate_rps"] == pytest.approx(3 * capacity["requests_per_s"])
    assert rate["rate_source"] == "auto: 3 x capacity" and rate["arrivals_per_phase"] == 40
    off, on = rate["phases"]["off"], rate["phases"]["on"]
    for phase in (off, on):
        assert phase["offered"] == 40 and phase["errors"] == {} and phase["token_mismatches"] == 0
        assert phase["admitted"] + phase["refused"] == 40
        # An admitted request completed or was refused later (a shed, a refusal slower than 50 ms).
        late = sum(phase["admitted_failures"].values())
        assert phase["completed"] + late == phase["admitted"]
        assert all(key.startswith("RESOURCE_EXHAUSTED:") for key in phase["admitted_failures"])
        routes = phase["routes"]
        assert routes["primary"]["admitted"] + routes["fallback"]["admitted"] == phase["admitted"]
        assert phase["itl_ms"]["p99"] is not None
    # Fallback off: the primary alone, the overflow refused at once with a reason and a retry hint.
    assert off["served_by"] == {PRIMARY: off["completed"]} and off["refused"] > 0
    assert off["routes"]["fallback"]["admitted"] == 0
    assert set(off["refusal_reasons"]) <= {"queue_full", "ttft_slo", "predicted_wait"}
    assert off["runs"][0]["refusals_with_retry_hint"] == off["refused"]
    assert off["refusal_decision_ms"]["p99"] is not None
    # The gateway's own histogram saw at least the refusals the client saw within 50 ms.
    decision = off["gateway_decision"]
    assert decision["refused"]["count"] >= off["refused"] and decision["refused"]["p99_ms"] is not None
    assert decision["admitted"]["count"] >= off["completed"]
    # Fallback on: the fallback took some of the overflow, and said why.
    assert on["fallback_served"] > 0 and on["served_by"].get(FALLBACK) == on["fallback_served"]
    assert on["routes"]["fallback"]["admitted"] >= on["fallback_served"]
    assert all(key.startswith("primary_saturated") for key in on["fallback_reasons"])
    target = rate["target"]
    assert {"ttft_p99", "ttft_pass", "goodput_ratio", "gateway_refusal_p99", "pass"} <= set(target)
    assert target["gateway_refusal_p99"]["off"]["known"] is True
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_no_gateway_is_a_clear_error_for_the_open_loop_too(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 needs root to listen on: nothing answers there.
    assert main(["--rate", "5", "--address", "127.0.0.1:1", "--smoke", "--no-progress"]) == 1
    assert "no gateway answers at 127.0.0.1:1" in capsys.readouterr().err
