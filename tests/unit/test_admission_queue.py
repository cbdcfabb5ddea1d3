"""Admission bookkeeping alone: the two-priority bounded queue, shedding, the wait model, the prompt
estimate, the credit ledger and the route settings. No I/O."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import pytest
from tokenizers import Tokenizer

from gateway.admission import (
    AdmissionQueue,
    Priority,
    Refused,
    Ticket,
    Waiter,
    deadline_from_unix_ms,
    estimate_prompt_tokens,
    predicted_wait_s,
    priority_of,
)
from gateway.credit_ledger import CreditLedger
from gateway.settings import GatewaySettings
from strata.settings import SettingsError
from strata.status import RETRY_PUSHBACK_KEY, STATUS_DETAILS_KEY, Unavailable, retry_delay_s, trailers
from strata.v1 import common_pb2, gateway_pb2, worker_pb2

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(autouse=True)
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Waiters hold futures, which need a loop (nothing runs on it)."""
    new_loop = asyncio.new_event_loop()
    asyncio.set_event_loop(new_loop)
    yield new_loop
    asyncio.set_event_loop(None)
    new_loop.close()


def waiter(name: str, tokens: int = 10, priority: Priority = Priority.INTERACTIVE) -> Waiter:
    ticket = Ticket(request_id=name, prompt_tokens=tokens, max_new_tokens=8, priority=priority)
    return Waiter(ticket, asyncio.get_event_loop().create_future(), tokens)


def order(queue: AdmissionQueue) -> list[str]:
    names = []
    while (next_waiter := queue.pop_next()) is not None:
        names.append(next_waiter.ticket.request_id)
    return names


def test_interactive_first_then_fifo_within_a_priority() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    for w in (
        waiter("b1", priority=Priority.BATCH),
        waiter("i1"),
        waiter("b2", priority=Priority.BATCH),
        waiter("i2"),
    ):
        queue.push(w)
    assert (queue.requests, queue.tokens) == (4, 40)
    assert queue.ahead(Priority.INTERACTIVE) == 2 and queue.ahead(Priority.BATCH) == 4
    assert order(queue) == ["i1", "i2", "b1", "b2"]
    assert (queue.requests, queue.tokens) == (0, 0)


def test_full_queue_sheds_the_newest_batch_for_an_interactive_arrival() -> None:
    queue = AdmissionQueue(max_requests=3, max_tokens=1000)
    old_batch, new_batch = waiter("b-old", priority=Priority.BATCH), waiter("b-new", priority=Priority.BATCH)
    for w in (old_batch, waiter("i1"), new_batch):
        queue.push(w)
    assert queue.victims(waiter("i2").ticket) == [new_batch]
    assert queue.victims(waiter("b3", priority=Priority.BATCH).ticket) == (
        "queue_full",
        "queue full: 3 requests waiting (max_queued_requests=3)",
    )
    only_interactive = AdmissionQueue(max_requests=1, max_tokens=1000)
    only_interactive.push(waiter("i1"))
    assert only_interactive.victims(waiter("i2").ticket)[0] == "queue_full"


def test_token_budget_counts_waiting_prompt_tokens_but_a_lone_ticket_always_fits() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=100)
    assert queue.victims(waiter("huge", tokens=5000).ticket) == []
    queue.push(waiter("a", tokens=60))
    assert queue.victims(waiter("fits", tokens=40).ticket) == []
    reason, text = queue.victims(waiter("over", tokens=41).ticket)  # type: ignore[misc]
    assert reason == "token_budget"
    assert text == "token budget: 60 prompt tokens waiting + 41 would exceed max_queued_tokens=100"
    batch = waiter("b", tokens=30, priority=Priority.BATCH)
    queue = AdmissionQueue(max_requests=10, max_tokens=100)
    queue.push(waiter("a", tokens=60))
    queue.push(batch)
    assert queue.victims(waiter("i", tokens=40).ticket) == [batch]


def test_exact_token_counts_replace_estimates_and_removal_is_exact() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    a, b = waiter("a", tokens=100), waiter("b", tokens=50)
    queue.push(a)
    queue.push(b)
    queue.set_tokens(a, 30)
    assert queue.tokens == 80
    assert queue.remove(a) and not queue.remove(a)
    assert (queue.requests, queue.tokens) == (1, 50)
    outside = waiter("c", tokens=7)
    queue.set_tokens(outside, 3)
    assert outside.tokens == 3 and queue.tokens == 50
    assert [w.ticket.request_id for w in queue.clear()] == ["b"]
    assert (queue.requests, queue.tokens) == (0, 0)


def test_predicted_wait() -> None:
    assert predicted_wait_s(ahead=0, free_credits=1, per_grant_s=None) == 0.0
    assert predicted_wait_s(ahead=3, free_credits=0, per_grant_s=None) is None
    assert predicted_wait_s(ahead=3, free_credits=0, per_grant_s=0.5) == pytest.approx(2.0)
    assert predicted_wait_s(ahead=3, free_credits=2, per_grant_s=0.5) == pytest.approx(1.0)


def test_priority_deadline_and_estimate_helpers(tiny_serving_dir: Path) -> None:
    assert priority_of(gateway_pb2.PRIORITY_UNSPECIFIED) is Priority.INTERACTIVE
    assert priority_of(gateway_pb2.PRIORITY_INTERACTIVE) is Priority.INTERACTIVE
    assert priority_of(gateway_pb2.PRIORITY_BATCH) is Priority.BATCH
    assert Priority.INTERACTIVE.worker_priority > Priority.BATCH.worker_priority
    assert deadline_from_unix_ms(0) is None
    tokenizer = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    for prompt in ("Hello world", "Ünïcødé — 東京 🚀 " * 20, "a" * 300, "  spaces\n\ttabs  "):
        request = gateway_pb2.GenerateRequest(prompt=prompt)
        assert estimate_prompt_tokens(request) >= len(tokenizer.encode(prompt).ids), prompt
    chat = gateway_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    assert estimate_prompt_tokens(chat) > len("hi")


LENGTH = common_pb2.FINISH_REASON_LENGTH


def _response(
    credits: int | None, updates: tuple[tuple[str, bool], ...] = (), rejected: tuple[str, ...] = ()
) -> worker_pb2.ConnectResponse:
    response = worker_pb2.ConnectResponse(
        updates=[
            worker_pb2.TokenUpdate(
                request_id=rid,
                finished=done,
                finish_reason=common_pb2.FINISH_REASON_LENGTH
                if done
                else common_pb2.FINISH_REASON_UNSPECIFIED,
            )
            for rid, done in updates
        ],
        rejections=[worker_pb2.Rejection(request_id=rid) for rid in rejected],
    )
    if credits is not None:
        response.credits.requests = credits
    return response


def test_ledger_counts_its_own_open_requests_and_learns_others_from_reports() -> None:
    ledger = CreditLedger()
    ledger.reset(limit=4, reported=4)
    ledger.reserve()
    ledger.reserve()
    assert ledger.available(open_requests=0) == 2
    ledger.release()  # a reservation turns into a submission (open request)
    ledger.release()
    assert ledger.available(open_requests=3) == 1
    # A report written before the worker read our three submissions still says 4: never more than 1.
    ledger.report(reported=4, open_requests=3)
    assert ledger.available(open_requests=3) == 1
    # Another gateway took one credit: the worker, holding our three, reports none left.
    ledger.report(reported=0, open_requests=3)
    assert (ledger.others, ledger.available(open_requests=3)) == (1, 0)
    ledger.report(reported=1, open_requests=2)  # one of ours finished
    assert ledger.available(open_requests=2) == 1
    ledger.release()  # more releases than reservations never go negative
    assert ledger.reserved == 0
    ledger.reset(limit=4, reported=1)  # a new stream to a worker where others hold 3
    assert ledger.available(open_requests=0) == 1


def test_ledger_times_first_and_last_updates_of_completed_requests() -> None:
    ledger = CreditLedger()
    ledger.reset(limit=4, reported=4)
    for name, now in (("r1", 0.0), ("r2", 0.0), ("r3", 0.1), ("cancelled", 0.1)):
        ledger.sent(name, now)
    ledger.time(_response(3, (("r2", False),)), now=0.5)
    assert ledger.first_token_s == pytest.approx(0.5)
    ledger.forget("cancelled")
    ledger.time(_response(1, (("r3", False), ("r2", True), ("cancelled", True)), rejected=("r1",)), now=1.0)
    assert ledger.first_token_s == pytest.approx(0.5 + 0.2 * (0.9 - 0.5))
    assert ledger.service_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ({"model": "a"}, "exactly one of workers"),
        ({"model": "a", "workers": ["h:1"], "dns": "w:1"}, "exactly one of workers"),
        ({"model": "a", "dns": "workers"}, "must be name:port"),
        ({"model": "a", "workers": ["h:1"], "fallback": "a"}, "names itself"),
        ({"model": "a", "workers": ["h:1"], "fallback": "zzz"}, "falls back to 'zzz'"),
        ({"model": "a", "workers": ["h:1"], "max_queued_requests": -1}, "max_queued_requests=-1"),
    ],
)
def test_route_settings_are_checked(route: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        GatewaySettings.build({"tokenizer_address": "t:1", "routes": [route]})


def test_route_settings_defaults_and_dns() -> None:
    settings = GatewaySettings.build(
        {
            "tokenizer_address": "t:1",
            "routes": [
                {"model": "big", "dns": "workers.default.svc:50053", "fallback": "small"},
                {"model": "small", "workers": ["h:2"], "fallback_enabled": False},
            ],
        }
    )
    big, small = settings.routes
    assert (big.dns, big.dns_refresh_s, big.fallback, big.fallback_enabled) == (
        "workers.default.svc:50053",
        5.0,
        "small",
        True,
    )
    assert (big.max_queued_requests, big.max_queued_tokens, big.ttft_slo_ms) == (64, 32768, 2000.0)
    assert not small.fallback_enabled
    assert (settings.max_batch_size, settings.max_batch_delay_ms) == (64, 2.0)


def test_a_refusal_carries_its_wait_as_retry_info_and_pushback() -> None:
    refusal = Refused("model 'x' is overloaded: queue full", 2.25, "queue_full")
    metadata = dict(trailers(refusal))
    assert retry_delay_s(metadata[STATUS_DETAILS_KEY]) == pytest.approx(2.25)  # type: ignore[arg-type]
    assert metadata[RETRY_PUSHBACK_KEY] == "2250"
    assert (refusal.code, refusal.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full")
    assert RETRY_PUSHBACK_KEY not in dict(trailers(Unavailable("down")))
