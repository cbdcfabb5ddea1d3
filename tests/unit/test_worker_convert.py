"""The worker's pure parts: wire-to-engine parameters, finish reasons, credits and the status map."""

from __future__ import annotations

import grpc
import pytest

from services.worker.convert import engine_priority, sampling_params, token_update
from services.worker.credits import CreditPool
from services.worker.engine.async_engine import EngineDeadError
from services.worker.engine.sequence import FinishReason, StepOutput
from services.worker.errors import (
    DeadlinePassedError,
    DrainingError,
    HelloMismatchError,
    NoCreditError,
    rejection_code,
    status_of,
)
from strata.sampling import InvalidRequestError, SamplingParams
from strata.v1 import common_pb2, worker_pb2


def _submission(**sampling: object) -> worker_pb2.Submission:
    return worker_pb2.Submission(
        request_id="r",
        prompt_ids=[1, 2],
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
        stop_token_ids=[5, 6],
    )


def test_unset_optional_fields_take_the_engine_defaults() -> None:
    params = sampling_params(_submission(max_new_tokens=7))
    assert params == SamplingParams(max_new_tokens=7, stop_token_ids=(5, 6))


def test_set_fields_are_carried_over() -> None:
    wire = _submission(
        max_new_tokens=9,
        temperature=0.5,
        top_p=0.25,
        top_k=3,
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        seed=0,
        ignore_eos=True,
    )
    params = sampling_params(wire)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.5, 0.25, 3, 1.5)
    assert (params.no_repeat_ngram_size, params.seed, params.ignore_eos) == (2, 0, True)


def test_zero_max_new_tokens_is_refused_since_the_gateway_always_fills_it() -> None:
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        sampling_params(_submission())


def test_priorities_flip_and_finish_reasons_map() -> None:
    assert engine_priority(5) < engine_priority(0) < engine_priority(-5)
    expected = {
        FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
        FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
        FinishReason.ABORTED: common_pb2.FINISH_REASON_CANCELLED,
        FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
    }
    for reason, wire in expected.items():
        out = StepOutput("e/r", [4], True, reason, 3, 2)
        update = token_update("r", out, queue_ms=1.0, forward_ms=2.0)
        assert (update.request_id, update.finish_reason, update.prompt_tokens) == ("r", wire, 3)
    running = token_update("r", StepOutput("e/r", [4], False, None, 3, 1), queue_ms=0.0, forward_ms=1.0)
    assert running.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


def test_credits_are_counted_and_exhaustion_names_the_limit() -> None:
    pool = CreditPool(2)
    pool.acquire()
    pool.acquire()
    assert (pool.open, pool.available) == (2, 0)
    with pytest.raises(NoCreditError, match="limit of 2"):
        pool.acquire()
    pool.release()
    assert pool.available == 1
    with pytest.raises(ValueError, match=">= 1"):
        CreditPool(0)


def test_each_refusal_has_its_own_status_code() -> None:
    cases = {
        InvalidRequestError("top_p", 2.0, "must be in (0, 1]"): grpc.StatusCode.INVALID_ARGUMENT,
        NoCreditError("full"): grpc.StatusCode.RESOURCE_EXHAUSTED,
        DeadlinePassedError("late"): grpc.StatusCode.DEADLINE_EXCEEDED,
        DrainingError("bye"): grpc.StatusCode.UNAVAILABLE,
        EngineDeadError("dead"): grpc.StatusCode.UNAVAILABLE,
        HelloMismatchError("other model"): grpc.StatusCode.FAILED_PRECONDITION,
    }
    for error, code in cases.items():
        assert status_of(error) == (code, str(error))
    assert [rejection_code(e) for e in list(cases)[:4]] == [3, 8, 4, 14]
    assert status_of(KeyError("bug"))[0] == grpc.StatusCode.INTERNAL
