"""The answer a request builds from its deltas: chunks, worker failures that end an attempt, the final."""

from __future__ import annotations

import time

import pytest

from gateway.errors import InvalidArgument, Unavailable
from gateway.request_state import Delta
from gateway.summary import ENGINE_ERROR, Failure, Summary
from gateway.validation import ValidRequest
from strata.v1 import common_pb2, gateway_pb2


def _summary() -> Summary:
    request = gateway_pb2.GenerateRequest(prompt="hi")
    valid = ValidRequest(request, "big", "rid", common_pb2.SamplingParams(max_new_tokens=8))
    summary = Summary(valid, time.perf_counter())
    summary.serve("big", 3, time.perf_counter())
    return summary


def test_tokens_before_a_broken_stream_still_reach_the_client() -> None:
    summary = _summary()
    chunk, failure = summary.add(
        [
            Delta("He", [5]),
            Delta("llo", [6, 7]),
            Delta(error=Unavailable("worker w is gone")),
            Delta("x", [9]),
        ]
    )
    assert chunk is not None and (chunk.text, chunk.token_ids, chunk.final) == ("Hello", [5, 6, 7], None)
    assert failure == Failure("worker w is gone", worker_lost=True)
    assert summary.token_ids == [5, 6, 7]


def test_an_engine_error_ends_the_attempt_after_its_tokens() -> None:
    summary = _summary()
    chunk, failure = summary.add([Delta("a", [1]), Delta("b", [2], common_pb2.FINISH_REASON_ERROR)])
    assert chunk is not None and chunk.token_ids == [1, 2] and chunk.final is None
    assert failure == Failure(ENGINE_ERROR)
    empty, failure = _summary().add([Delta(error=Unavailable("refused"))])
    assert empty is None and failure == Failure("refused", worker_lost=True)


def test_other_errors_end_the_request() -> None:
    with pytest.raises(InvalidArgument):
        _summary().add([Delta("a", [1]), Delta(error=InvalidArgument("prompt: too long"))])


def test_the_final_names_the_serving_model_the_reason_and_the_failover_point() -> None:
    summary = _summary()
    summary.add([Delta("ab", [1, 2])])
    summary.end_attempt()
    submitted = time.perf_counter()
    summary.serve("small", 3, submitted, "primary big failed mid-stream after 2 tokens: gone")
    summary.failover_at_token = 2
    time.sleep(0.02)
    received = time.perf_counter()
    last = Delta("c", [3], common_pb2.FINISH_REASON_LENGTH, queue_ms=2.0, forward_ms=5.0, received=received)
    chunk, failure = summary.add([last])
    assert failure is None and chunk is not None and chunk.final is not None
    final = chunk.final
    assert (final.text, list(final.token_ids), final.model) == ("abc", [1, 2, 3], "small")
    assert final.fallback_reason == "primary big failed mid-stream after 2 tokens: gone"
    assert (final.failover_at_token, final.usage.input_tokens, final.usage.output_tokens) == (2, 3, 3)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and final.request_id == "rid"
    timing = final.timing
    parts = timing.network_ms + timing.preprocess_ms + timing.queue_ms + timing.forward_ms + timing.decode_ms
    assert timing.total_ms > 20.0 and parts == pytest.approx(timing.total_ms, abs=1e-6)
    # The fallback's attempt: its worker's own queue and forward time, the rest of the wait network.
    assert timing.forward_ms == pytest.approx(5.0) and timing.queue_ms >= 2.0
    assert timing.network_ms == pytest.approx((received - submitted) * 1000.0 - 7.0, abs=1e-6)
