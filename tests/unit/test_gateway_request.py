"""The answer a request builds from its attempts' deltas: chunks, the worker failures that end an
attempt, the final response, and the slot each attempt gives back however it ends.

A Request and its Attempts run here without I/O: the route is real (its queue and dispatcher, with no
worker link), and the worker link an attempt is sent on is a stand-in that records the submission,
since sending is the link's job and tests/integration cover it over real workers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from gateway.attempt import Attempt
from gateway.credits import StreamCredits
from gateway.errors import InvalidArgument, Unavailable
from gateway.fallback import Detour, Trigger
from gateway.forecast import LinkLoad
from gateway.request import ENGINE_ERROR, Request
from gateway.request_trace import RequestTrace
from gateway.request_values import Chunk, Delta, Failure, Incoming
from gateway.route import Route
from gateway.settings import GatewaySettings
from gateway.validation import ValidRequest
from strata.tracing import Tracing
from strata.v1 import common_pb2, gateway_pb2, worker_pb2

if TYPE_CHECKING:
    from gateway.delta_sink import DeltaSink


@dataclass
class RecordingLink:
    """Stands in for a WorkerLink: keeps what the attempt submitted."""

    address: str = "w:1"
    sent: list[worker_pb2.Submission] = field(default_factory=list)
    load: LinkLoad = field(default_factory=LinkLoad)
    """What fair queuing's worker priority reads of the link."""

    def submit(self, slot: Any, submission: worker_pb2.Submission, sink: DeltaSink) -> None:
        self.sent.append(submission)


class _ReadyLink:
    """A link the route sees as ready with no credit, so a placed slot waits in its queue."""

    ready, leaving, info, free_credits, open_requests, not_ready_reason = True, False, None, 0, 0, ""
    address, open_load = "127.0.0.1:1", 0

    def __init__(self) -> None:
        self.load = LinkLoad()
        self.credits = StreamCredits()

    def start(self) -> None:
        """Nothing to connect to."""


def _route(model: str, **extra: Any) -> Route:
    """A started route of one `_ReadyLink`; `extra` adds to its settings."""
    settings = GatewaySettings.build(
        # No SLO: a link that never reports a step still queues the slots placed on it.
        {
            "tokenizer_address": "127.0.0.1:1",
            "routes": [{"model": model, "workers": ["127.0.0.1:1"], "ttft_slo_ms": 0, **extra}],
        }
    )
    route = Route(settings.routes[0], settings, lambda *args: _ReadyLink(), lambda: None)  # type: ignore[arg-type,return-value]
    route.start()
    return route


def _request(model: str = "big", adapter: str = "", **route: Any) -> Request:
    incoming = Incoming(gateway_pb2.GenerateRequest(prompt="hi"))
    valid = ValidRequest(incoming.request, model, "rid", common_pb2.SamplingParams(max_new_tokens=8), adapter)
    arrival = time.perf_counter()
    primary = _route(model, **route)
    request = Request(incoming, valid, primary, RequestTrace(Tracing.off(), incoming, arrival), arrival)
    request.prompt_ids = [4, 5, 6]
    return request


def _sent(request: Request, route: Route, detour: Detour | None = None) -> tuple[Attempt, RecordingLink]:
    """An attempt queued on `route` (no worker: it waits) and sent on a recording link, as the
    pipeline sends one."""
    attempt = Attempt.place(request, route, detour, 0)
    attempt.__enter__()
    link = RecordingLink()
    request.sent_to(route, detour)
    attempt.send(link)  # type: ignore[arg-type]
    return attempt, link


def _add(request: Request, attempt: Attempt, deltas: list[Delta]) -> tuple[Chunk | None, Failure | None]:
    """The pipeline's turn on a batch of deltas: the attempt records its part, the request answers."""
    attempt.record(deltas)
    return request.add(deltas)


def run(coroutine_function: Any) -> Any:
    return asyncio.run(coroutine_function())


def test_tokens_before_a_broken_stream_still_reach_the_client() -> None:
    async def main() -> None:
        request = _request()
        attempt, _ = _sent(request, request.primary)
        chunk, failure = _add(
            request,
            attempt,
            [
                Delta("He", [5]),
                Delta("llo", [6, 7]),
                Delta(error=Unavailable("worker w is gone")),
                Delta("x", [9]),
            ],
        )
        assert chunk is not None and (chunk.text, chunk.token_ids, chunk.final) == ("Hello", [5, 6, 7], None)
        assert failure == Failure("worker w is gone", worker_lost=True)
        assert request.token_ids == [5, 6, 7] and attempt.ended is not None

    run(main)


def test_an_engine_error_ends_the_attempt_after_its_tokens() -> None:
    async def main() -> None:
        request = _request()
        attempt, _ = _sent(request, request.primary)
        chunk, failure = _add(
            request, attempt, [Delta("a", [1]), Delta("b", [2], common_pb2.FINISH_REASON_ERROR)]
        )
        assert chunk is not None and chunk.token_ids == [1, 2] and chunk.final is None
        assert failure == Failure(ENGINE_ERROR)
        other = _request()
        other_attempt, _ = _sent(other, other.primary)
        empty, failure = _add(other, other_attempt, [Delta(error=Unavailable("refused"))])
        assert empty is None and failure == Failure("refused", worker_lost=True)

    run(main)


def test_other_errors_end_the_request() -> None:
    async def main() -> None:
        request = _request()
        attempt, _ = _sent(request, request.primary)
        with pytest.raises(InvalidArgument):
            _add(request, attempt, [Delta("a", [1]), Delta(error=InvalidArgument("prompt: too long"))])

    run(main)


def test_a_failover_submission_carries_the_tokens_sent_and_the_final_names_the_fallback() -> None:
    async def main() -> None:
        request = _request()
        first, _ = _sent(request, request.primary)
        _add(request, first, [Delta("ab", [1, 2]), Delta(error=Unavailable("gone"))])
        first.__exit__(None, None, None)
        small = _route("small")
        detour = Detour("small", Trigger.FAILOVER, "primary big failed mid-stream after 2 tokens: gone")
        second, link = _sent(request, small, detour)
        (submission,) = link.sent
        assert list(submission.prior_output_ids) == [1, 2] and list(submission.prompt_ids) == [4, 5, 6]
        assert submission.sampling.max_new_tokens == 8 and not submission.sampling.stop
        assert request.ticket().prompt_tokens == 5 and request.ticket().max_new_tokens == 6
        time.sleep(0.02)  # the time under test: 20 ms the final's timing must account for
        received = time.perf_counter()
        last = Delta(
            "c", [3], common_pb2.FINISH_REASON_LENGTH, queue_ms=2.0, forward_ms=5.0, received=received
        )
        chunk, failure = _add(request, second, [last])
        assert failure is None and chunk is not None and chunk.final is not None
        final = chunk.final
        assert (final.text, list(final.token_ids), final.model) == ("abc", [1, 2, 3], "small")
        assert final.fallback_reason == "primary big failed mid-stream after 2 tokens: gone"
        assert (final.failover_at_token, final.usage.input_tokens, final.usage.output_tokens) == (2, 3, 3)
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and final.request_id == "rid"
        timing = final.timing
        parts = (
            timing.network_ms + timing.preprocess_ms + timing.queue_ms + timing.forward_ms + timing.decode_ms
        )
        assert timing.total_ms > 20.0 and parts == pytest.approx(timing.total_ms, abs=1e-6)
        # The fallback's attempt: its worker's own queue and forward time, the rest of the wait network.
        assert timing.forward_ms == pytest.approx(5.0) and timing.queue_ms >= 2.0
        assert second.submitted is not None
        assert timing.network_ms == pytest.approx((received - second.submitted) * 1000.0 - 7.0, abs=1e-6)

    run(main)


@pytest.mark.parametrize(("to_base", "on_fallback"), [(False, "a"), (True, "")])
def test_a_request_through_an_adapter_fails_over_through_it_or_to_the_base_as_its_route_says(
    to_base: bool, on_fallback: str
) -> None:
    """The submission names the adapter on the primary; on the fallback too, unless the primary's route
    sets adapter_fallback_to_base. The response names what served it."""

    async def main() -> None:
        request = _request(adapter="a", adapter_fallback_to_base=to_base)
        first, link = _sent(request, request.primary)
        assert (link.sent[0].adapter, request.model) == ("a", "big:a")
        _add(request, first, [Delta(error=Unavailable("gone"))])
        first.__exit__(None, None, None)
        detour = Detour("small", Trigger.FAILOVER, "primary big failed: gone")
        _, fallback = _sent(request, _route("small"), detour)
        assert fallback.sent[0].adapter == on_fallback
        assert request.model == ("small:a" if on_fallback else "small")

    run(main)


def test_the_final_names_the_stop_string_of_the_delta_that_ended_the_text() -> None:
    async def main() -> None:
        request = _request()
        first, _ = _sent(request, request.primary)
        _add(request, first, [Delta("ab", [1, 2]), Delta(error=Unavailable("gone"))])
        first.__exit__(None, None, None)
        detour = Detour("small", Trigger.FAILOVER, "primary big failed mid-stream after 2 tokens: gone")
        second, _ = _sent(request, _route("small"), detour)
        ended = Delta("", [4], common_pb2.FINISH_REASON_STOP, stop_sequence="END")
        chunk, failure = _add(request, second, [Delta("c", [3]), ended])
        assert failure is None and chunk is not None and chunk.final is not None
        assert (chunk.final.text, chunk.final.stop_sequence) == ("abc", "END")
        # The model's own end (EOS, a stop token id) is FINISH_REASON_STOP with no stop string.
        other = _request()
        attempt, _ = _sent(other, other.primary)
        chunk, _ = _add(other, attempt, [Delta("x", [1], common_pb2.FINISH_REASON_STOP)])
        assert chunk is not None and chunk.final is not None
        assert (chunk.final.finish_reason, chunk.final.stop_sequence) == (common_pb2.FINISH_REASON_STOP, "")

    run(main)


def test_leaving_an_attempt_gives_its_place_back_however_it_ends() -> None:
    async def main() -> None:
        request = _request()
        route = request.primary
        with Attempt.place(request, route, None, 0):
            assert route.queued_requests == 1
        assert route.queued_requests == 0
        with pytest.raises(RuntimeError), Attempt.place(request, route, None, 0):
            raise RuntimeError("the tokenizer failed")
        assert route.queued_requests == 0

    run(main)
