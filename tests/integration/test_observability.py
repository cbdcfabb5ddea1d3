"""Traces and metrics of the real stack: three service processes export spans over OTLP to a receiver
in this test, and serve /metrics over HTTP.

One stack serves every test here (a stack start costs seconds of CPU): a tiny primary whose steps are
slowed (so a test can hold it busy), a tiny fallback, tracing on at sampling 1.0, a 50 ms export delay.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from strata.cli.launcher import start_stack
from strata.otlp_receiver import OtlpReceiver, ReceivedSpan
from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.polling import wait_for
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from strata.cli.launcher import Stack

PRIMARY, FALLBACK = "tiny", "tiny-small"
STEP_DELAY_S = 0.02
WAIT_S = 30.0


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def stack(
    receiver: OtlpReceiver,
    tiny_serving_dir: Path,
    tiny_fallback_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("observed")
    engine = {"num_blocks": 128, "max_num_seqs": 8}
    config = {
        "telemetry": {"tracing": "on", "otlp_endpoint": receiver.endpoint, "sampling_ratio": 1.0},
        "tokenizer": {
            "listen": "127.0.0.1:0",
            "models": {PRIMARY: str(tiny_serving_dir), FALLBACK: str(tiny_fallback_dir)},
        },
        "workers": [
            {
                "model_name": PRIMARY,
                "model_path": str(tiny_serving_dir),
                "listen": "127.0.0.1:0",
                "device": "cpu",
                "threads": 1,
                "max_requests": 1,
                "engine": {**engine, "enable_fault_injection": True, "fault_step_delay_s": STEP_DELAY_S},
            },
            {
                "model_name": FALLBACK,
                "model_path": str(tiny_fallback_dir),
                "listen": "127.0.0.1:0",
                "device": "cpu",
                "threads": 1,
                "engine": engine,
            },
        ],
        "gateway": {
            "listen": "127.0.0.1:0",
            "default_model": PRIMARY,
            # No TTFT SLO: a request behind the 200-token holder must queue, not be refused on its forecast;
            # one queued request at most, so the next is refused (queue_full) or sent to the fallback.
            "routes": [
                harness_route(PRIMARY, fallback=FALLBACK, max_queued_requests=1),
                harness_route(FALLBACK),
            ],
        },
    }
    path = directory / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    with start_stack(path, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}, log_dir=directory / "logs") as running:
        yield running


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(stack.addresses.gateway) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _chat(
    max_new_tokens: int = 6, *, no_fallback: bool = False, allow_fallback: bool = False
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=PRIMARY,
        messages=[common_pb2.ChatMessage(role="user", content="hello there")],
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
        no_fallback=no_fallback,
        allow_fallback=allow_fallback,
    )


def _number(span: ReceivedSpan, key: str) -> float:
    value = span.attributes[key]
    assert isinstance(value, int | float), (key, value)
    return value


def _strings(span: ReceivedSpan, key: str) -> list[str]:
    value = span.attributes[key]
    assert isinstance(value, list | tuple), (key, value)
    return [str(item) for item in value]


def _trace(receiver: OtlpReceiver, trace_id: str, *names: str) -> list[ReceivedSpan]:
    """The trace's spans once every name in `names` arrived (a name may repeat to ask for several)."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = [span.name for span in spans if span.trace_id == trace_id]
        return all(mine.count(name) >= names.count(name) for name in names)

    return [span for span in receiver.wait_for(complete, WAIT_S) if span.trace_id == trace_id]


def test_one_trace_spans_the_three_services_and_agrees_with_the_timing(
    gateway: gateway_pb2_grpc.GatewayStub, receiver: OtlpReceiver
) -> None:
    traceparent, trace_id, caller_span = _traceparent()
    response = gateway.Generate(_chat(), metadata=[("traceparent", traceparent)], timeout=WAIT_S)
    assert response.trace_id == trace_id
    spans = _trace(
        receiver, trace_id, f"chat {PRIMARY}", "preprocess", "forward", "decode", "queue", "queue", "network"
    )
    by_id = {span.span_id: span for span in spans}

    def one(name: str, service: str) -> ReceivedSpan:
        found = [span for span in spans if span.name == name and span.service == service]
        assert len(found) == 1, f"{name} in {service}: {found}"
        return found[0]

    request = one(f"chat {PRIMARY}", "strata-gateway")
    assert request.parent_span_id == caller_span, "the request joins the caller's trace"
    tokenize = one("strata.v1.TokenizerService/Tokenize", "strata-gateway")
    connect = one("strata.v1.WorkerService/Connect", "strata-gateway")
    preprocess = one("preprocess", "strata-tokenizer")
    forward = one("forward", "strata-worker")
    decode = one("decode", "strata-gateway")
    assert tokenize.parent_span_id == connect.parent_span_id == decode.parent_span_id == request.span_id
    assert preprocess.parent_span_id == tokenize.span_id
    assert forward.parent_span_id == connect.span_id
    assert one("queue", "strata-worker").parent_span_id == connect.span_id
    gateway_queues = [span for span in spans if span.name == "queue" and span.service == "strata-gateway"]
    assert gateway_queues and all(span.parent_span_id == request.span_id for span in gateway_queues)
    networks = [span for span in spans if span.name == "network"]
    assert {by_id[span.parent_span_id].name for span in networks} >= {tokenize.name, connect.name}
    assert {span.attributes["strata.hop"] for span in networks} >= {"tokenize", "worker"}

    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == PRIMARY
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.usage.input_tokens"] == response.usage.input_tokens > 0
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert _strings(request, "gen_ai.response.finish_reasons") == ["length"]
    assert attributes["strata.fallback_reason"] == ""
    assert attributes["strata.time_to_first_token_ms"] == pytest.approx(
        response.timing.time_to_first_token_ms
    )

    # The engine steps: one span each, in their own traces, linked from the request's forward span.
    steps = receiver.wait_for(
        lambda seen: {link[1] for link in forward.links} <= {s.span_id for s in seen if s.name == "step"},
        WAIT_S,
    )
    step_spans = [span for span in steps if (span.trace_id, span.span_id) in set(forward.links)]
    assert len(step_spans) == len(forward.links) >= 6
    assert all(_number(span, "strata.batch_size") >= 1 for span in step_spans)
    assert sum(_number(span, "strata.decode_tokens") for span in step_spans) >= 5

    timing = response.timing
    parts = timing.network_ms + timing.preprocess_ms + timing.queue_ms + timing.forward_ms + timing.decode_ms
    assert parts == pytest.approx(request.duration_ms, abs=2.0)
    assert timing.total_ms == pytest.approx(request.duration_ms, abs=2.0)

    def total(name: str) -> float:
        return sum(span.duration_ms for span in spans if span.name == name)

    for stage in ("network", "preprocess", "queue", "forward", "decode"):
        assert total(stage) == pytest.approx(getattr(timing, f"{stage}_ms"), abs=2.0), stage
    assert timing.forward_ms >= 5 * STEP_DELAY_S * 1000.0


def test_each_finished_request_is_one_json_log_line(
    stack: Stack, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    traceparent, trace_id, _ = _traceparent()
    response = gateway.Generate(_chat(), metadata=[("traceparent", traceparent)], timeout=WAIT_S)
    assert stack.log_dir is not None
    log = stack.log_dir / "gateway.log"
    [line] = wait_for(
        lambda: [line for line in _json_lines(log) if line.get("request_id") == response.request_id],
        WAIT_S,
        "a log line for the request",
        interval_s=0.05,
    )
    assert line["event"] == "request_finished" and line["trace_id"] == trace_id and line["model"] == PRIMARY
    assert (line["input_tokens"], line["output_tokens"]) == (response.usage.input_tokens, 6)
    assert line["finish_reason"] == "length" and line["device_memory_bytes"] > 1e6
    timing = line["timing_ms"]
    assert timing["total_ms"] == pytest.approx(response.timing.total_ms, abs=0.01)
    parts = ("network_ms", "preprocess_ms", "queue_ms", "forward_ms", "decode_ms")
    assert sum(timing[part] for part in parts) == pytest.approx(timing["total_ms"], abs=0.05)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects among a log's lines (a child's stderr may hold other text too)."""
    lines = []
    for text in path.read_text().splitlines():
        if text.startswith("{"):
            lines.append(json.loads(text))
    return lines


def test_a_traced_stream_can_be_cancelled_and_the_worker_aborts_it(
    stack: Stack, gateway: gateway_pb2_grpc.GatewayStub, receiver: OtlpReceiver
) -> None:
    traceparent, trace_id, _ = _traceparent()
    stream = gateway.GenerateStream(_chat(max_new_tokens=200), metadata=[("traceparent", traceparent)])
    assert next(stream).token_ids
    stream.cancel()
    with pytest.raises(grpc.RpcError) as ended:
        next(stream)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    with grpc.insecure_channel(stack.addresses.workers[0]) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        wait_for(
            lambda: worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=5),
            WAIT_S,
            "the worker let go of the cancelled request",
            until=lambda stats: not (stats.open_requests or stats.running or stats.used_kv_blocks),
            interval_s=0.05,
        )
    spans = _trace(receiver, trace_id, "forward", f"chat {PRIMARY}")
    forward = next(span for span in spans if span.name == "forward")
    assert forward.status_code == 2 and _strings(forward, "gen_ai.response.finish_reasons") == ["aborted"]
    assert _number(forward, "gen_ai.usage.output_tokens") < 200
    request = next(span for span in spans if span.name == f"chat {PRIMARY}")
    assert request.attributes["error.type"] == "cancelled" and request.status_code == 2


def _scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, parsed as Prometheus text: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_pages_parse_and_count_requests_rejections_and_fallbacks(
    stack: Stack, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    endpoints = stack.metrics_addresses
    assert set(endpoints) == {"tokenizer", "worker 0", "worker 1", "gateway"}
    before = {name: _scrape(address) for name, address in endpoints.items()}

    # Hold the primary's one credit, fill its one queue slot, then: one refused, one sent to the fallback.
    holder = gateway.GenerateStream(_chat(max_new_tokens=200, no_fallback=True))
    assert next(holder).token_ids
    waiting = gateway.Generate.future(_chat(max_new_tokens=2, no_fallback=True))
    wait_for(
        lambda: gateway.ListModels(gateway_pb2.ListModelsRequest()).models[0].queued_requests >= 1,
        WAIT_S,
        "the second request queued",
        interval_s=0.01,
    )
    with pytest.raises(grpc.RpcError) as refused:
        gateway.Generate(_chat(no_fallback=True), timeout=WAIT_S)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detoured = gateway.Generate(_chat(allow_fallback=True), timeout=WAIT_S)
    assert detoured.model == FALLBACK and detoured.fallback_reason
    holder.cancel()
    assert waiting.result(timeout=WAIT_S).usage.output_tokens == 2

    after = {name: _scrape(address) for name, address in endpoints.items()}
    gw_before, gw = before["gateway"], after["gateway"]
    for name, labels in [
        ("strata_rejections_total", {"model": PRIMARY, "reason": "queue_full"}),
        ("strata_fallbacks_total", {"model": PRIMARY, "reason": "primary_saturated"}),
        ("strata_request_errors_total", {"model": PRIMARY, "code": "resource_exhausted"}),
        ("strata_generated_tokens_total", {"model": FALLBACK}),
        ("strata_time_to_first_token_seconds_count", {"model": PRIMARY}),
    ]:
        assert _value(gw, name, **labels) > _value(gw_before, name, **labels), (name, labels)
    assert (
        _value(gw, "strata_generated_tokens_total", model=FALLBACK)
        - _value(gw_before, "strata_generated_tokens_total", model=FALLBACK)
        == 6
    )
    assert _value(gw, "strata_gateway_queued_requests", model=PRIMARY) == 0
    worker_before, worker = before["worker 0"], after["worker 0"]
    assert _value(worker, "strata_engine_tokens_total", model=PRIMARY, phase="decode") > _value(
        worker_before, "strata_engine_tokens_total", model=PRIMARY, phase="decode"
    )
    assert _value(worker, "strata_device_memory_bytes", model=PRIMARY, device="cpu") > 1e6
    assert _value(worker, "strata_kv_cache_usage_ratio", model=PRIMARY) >= 0.0
    tokenizer_before, tokenizer = before["tokenizer"], after["tokenizer"]
    # The refused request never reached the tokenizer; the detoured one was tokenized for the fallback.
    for model, count in ((PRIMARY, 2), (FALLBACK, 1)):
        tokenized = {"model": model, "method": "tokenize"}
        added = _value(tokenizer, "strata_tokenizer_entries_total", **tokenized) - _value(
            tokenizer_before, "strata_tokenizer_entries_total", **tokenized
        )
        assert added == count, model
