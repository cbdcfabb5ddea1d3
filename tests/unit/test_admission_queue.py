"""Admission bookkeeping alone: the two-priority bounded queue, shedding, the tickets ahead, the prompt
estimate, a stream's credits and the slots that hold them, and the route settings. No I/O. The
forecast is tests/unit/test_forecast.py's."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from tokenizers import Tokenizer

from gateway.admission import (
    Priority,
    PromptEstimate,
    Refused,
    Ticket,
    deadline_from_unix_ms,
    estimate_prompt_tokens,
    priority_of,
)
from gateway.admission_queue import AdmissionQueue
from gateway.credits import Slot, StreamCredits
from gateway.fair_share import FairShare
from gateway.settings import GatewaySettings
from strata.settings import SettingsError
from strata.status import RETRY_PUSHBACK_KEY, STATUS_DETAILS_KEY, Unavailable, retry_delay_s, trailers
from strata.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(autouse=True)
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Slots hold futures, which need a loop (nothing runs on it)."""
    new_loop = asyncio.new_event_loop()
    asyncio.set_event_loop(new_loop)
    yield new_loop
    asyncio.set_event_loop(None)
    new_loop.close()


class RecordingLink:
    """What a granted Slot reads of its link: its credits."""

    def __init__(self) -> None:
        self.credits = StreamCredits()


def slot(
    name: str,
    tokens: int = 10,
    priority: Priority = Priority.INTERACTIVE,
    tenant: str = "default",
    new_tokens: int = 8,
) -> Slot[Any]:
    ticket = Ticket(
        request_id=name, prompt_tokens=tokens, max_new_tokens=new_tokens, priority=priority, tenant=tenant
    )

    async def make() -> Slot[Any]:  # a slot belongs to the running loop, as on a route
        return Slot(ticket)

    return asyncio.get_event_loop().run_until_complete(make())


def order(queue: AdmissionQueue) -> list[str]:
    names = []
    while (next_slot := queue.pop_next()) is not None:
        names.append(next_slot.ticket.request_id)
    return names


def test_interactive_first_then_fifo_within_a_priority() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    for w in (
        slot("b1", priority=Priority.BATCH),
        slot("i1"),
        slot("b2", priority=Priority.BATCH),
        slot("i2"),
    ):
        queue.push(w)
    assert (queue.requests, queue.tokens) == (4, 40)
    interactive, batch = slot("i3").ticket, slot("b3", priority=Priority.BATCH).ticket
    assert queue.ahead(interactive) == 2 and queue.ahead(batch) == 4
    assert [s.ticket.request_id for s in queue.ahead_slots(interactive)] == ["i1", "i2"]
    assert [s.ticket.request_id for s in queue.ahead_slots(batch)] == ["i1", "i2", "b1", "b2"]
    assert order(queue) == ["i1", "i2", "b1", "b2"]
    assert (queue.requests, queue.tokens) == (0, 0)


def test_fair_queuing_serves_tenants_by_token_cost_over_weight() -> None:
    """A flood of long prompts from one tenant and a trickle of short ones from another, equal weight:
    each tenant is served in the order of its token cost, so the short ones pass the flood; with
    weight 2 a tenant gets twice the cost; a newcomer is tagged from the virtual time, not behind."""
    queue = AdmissionQueue(max_requests=20, max_tokens=100_000, share=FairShare({}, 0.0, on=True))
    for i in range(4):
        queue.push(slot(f"n{i}", tokens=512, tenant="noisy", new_tokens=32))  # cost 544 each
    for i in range(4):
        queue.push(slot(f"q{i}", tokens=32, tenant="quiet", new_tokens=32))  # cost 64 each
    # The quiet tenant's next request (tag 5 x 64 = 320) waits behind its own four only, not the flood.
    quiet = slot("q-next", tokens=32, tenant="quiet", new_tokens=32).ticket
    assert [s.ticket.request_id for s in queue.ahead_slots(quiet)] == ["q0", "q1", "q2", "q3"]
    noisy = slot("n-next", tokens=512, tenant="noisy", new_tokens=32).ticket
    assert queue.ahead(noisy) == 8
    assert order(queue) == ["q0", "q1", "q2", "q3", "n0", "n1", "n2", "n3"]
    # After the queue drained, a tenant idle since is tagged from the virtual time, not from zero.
    queue.push(slot("n4", tokens=512, tenant="noisy", new_tokens=32))
    queue.push(slot("q4", tokens=32, tenant="quiet", new_tokens=32))
    assert order(queue) == ["q4", "n4"]
    # Weight 2 halves a tenant's charge: two of its requests per one of an equal cost.
    fresh = AdmissionQueue(max_requests=20, max_tokens=100_000, share=FairShare({"quiet": 2.0}, 0.0, on=True))
    for i in range(3):
        fresh.push(slot(f"n{i}", tokens=96, tenant="noisy", new_tokens=32))
        fresh.push(slot(f"q{i}", tokens=96, tenant="quiet", new_tokens=32))
    assert order(fresh) == ["q0", "n0", "q1", "q2", "n1", "n2"]
    assert fresh.queued_by_tenant() == {}


def test_without_fair_queuing_tenants_share_one_fifo() -> None:
    queue = AdmissionQueue(max_requests=20, max_tokens=100_000)
    for name, tenant, tokens in (("n0", "noisy", 512), ("q0", "quiet", 32), ("n1", "noisy", 512)):
        queue.push(slot(name, tokens=tokens, tenant=tenant))
    assert queue.queued_by_tenant() == {"noisy": 2, "quiet": 1}
    assert queue.ahead(slot("q1", tenant="quiet").ticket) == 3
    assert order(queue) == ["n0", "q0", "n1"]


def test_full_queue_sheds_the_newest_batch_for_an_interactive_arrival() -> None:
    queue = AdmissionQueue(max_requests=3, max_tokens=1000)
    old_batch, new_batch = slot("b-old", priority=Priority.BATCH), slot("b-new", priority=Priority.BATCH)
    for w in (old_batch, slot("i1"), new_batch):
        queue.push(w)
    assert queue.victims(slot("i2").ticket) == [new_batch]
    assert queue.victims(slot("b3", priority=Priority.BATCH).ticket) == (
        "queue_full",
        "queue full: 3 requests waiting (max_queued_requests=3)",
    )
    only_interactive = AdmissionQueue(max_requests=1, max_tokens=1000)
    only_interactive.push(slot("i1"))
    assert only_interactive.victims(slot("i2").ticket)[0] == "queue_full"


def test_token_budget_counts_waiting_prompt_tokens_but_a_lone_ticket_always_fits() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=100)
    assert queue.victims(slot("huge", tokens=5000).ticket) == []
    queue.push(slot("a", tokens=60))
    assert queue.victims(slot("fits", tokens=40).ticket) == []
    reason, text = queue.victims(slot("over", tokens=41).ticket)  # type: ignore[misc]
    assert reason == "token_budget"
    assert text == "token budget: 60 prompt tokens waiting + 41 would exceed max_queued_tokens=100"
    batch = slot("b", tokens=30, priority=Priority.BATCH)
    queue = AdmissionQueue(max_requests=10, max_tokens=100)
    queue.push(slot("a", tokens=60))
    queue.push(batch)
    assert queue.victims(slot("i", tokens=40).ticket) == [batch]


def test_exact_token_counts_replace_estimates_and_removal_is_exact() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    a, b = slot("a", tokens=100), slot("b", tokens=50)
    queue.push(a)
    queue.push(b)
    queue.set_tokens(a, 30)
    assert queue.tokens == 80
    assert queue.remove(a) and not queue.remove(a)
    assert (queue.requests, queue.tokens) == (1, 50)
    outside = slot("c", tokens=7)
    queue.set_tokens(outside, 3)
    assert outside.tokens == 3 and queue.tokens == 50
    assert [w.ticket.request_id for w in queue.clear()] == ["b"]
    assert (queue.requests, queue.tokens) == (0, 0)


def test_priority_deadline_and_estimate_helpers(tiny_serving_dir: Path) -> None:
    assert priority_of(gateway_pb2.PRIORITY_UNSPECIFIED) is Priority.INTERACTIVE
    assert priority_of(gateway_pb2.PRIORITY_INTERACTIVE) is Priority.INTERACTIVE
    assert priority_of(gateway_pb2.PRIORITY_BATCH) is Priority.BATCH
    assert Priority.INTERACTIVE.worker_priority() > Priority.BATCH.worker_priority(favoured=True)
    assert Priority.BATCH.worker_priority(favoured=True) > Priority.BATCH.worker_priority()
    assert deadline_from_unix_ms(0) is None
    tokenizer = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    for prompt in ("Hello world", "Ünïcødé — 東京 🚀 " * 20, "a" * 300, "  spaces\n\ttabs  "):
        request = gateway_pb2.GenerateRequest(prompt=prompt)
        assert estimate_prompt_tokens(request) >= len(tokenizer.encode(prompt).ids), prompt
    chat = gateway_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    assert estimate_prompt_tokens(chat) > len("hi")


def test_stream_credits_count_held_slots_and_learn_others_from_reports() -> None:
    credits = StreamCredits()
    credits.reset(limit=4, reported=4)
    credits.held = 3  # three slots granted, not sent yet
    assert credits.available() == 1
    # A report written before the worker read any of our submissions still says 4: never more than 1.
    credits.report(reported=4, open_on_worker=0)
    assert credits.available() == 1
    # All three sent, and another gateway took one credit: the worker, holding our three, reports none.
    credits.report(reported=0, open_on_worker=3)
    assert (credits.others, credits.available()) == (1, 0)
    credits.held = 2  # one of ours finished and its slot was released
    credits.report(reported=1, open_on_worker=2)
    assert credits.available() == 1
    credits.held = 0
    credits.reset(limit=4, reported=1)  # a new stream to a worker where others hold 3
    assert credits.available() == 1


def test_a_slot_takes_one_credit_when_granted_and_gives_it_back_exactly_once() -> None:
    """The first release of a slot gives its credit back and says so (its route then cancels or
    withdraws it); a second does nothing. A waiting slot's release decides it without a credit."""
    link = RecordingLink()
    link.credits.reset(limit=2, reported=2)
    granted = slot("g")
    granted.grant(link)  # type: ignore[arg-type]
    assert granted.decided and link.credits.available() == 1
    assert granted.release() and not granted.release()
    assert link.credits.held == 0 and link.credits.available() == 2
    waiting = slot("w")
    assert waiting.release() and not waiting.release()
    assert waiting.decided and waiting.link is None
    refused = slot("r")
    refused.refuse(Unavailable("no worker"))
    with pytest.raises(Unavailable):
        asyncio.get_event_loop().run_until_complete(refused.granted())


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ({"model": "a"}, "exactly one of workers"),
        ({"model": "a", "workers": ["h:1"], "dns": "w:1"}, "exactly one of workers"),
        ({"model": "a", "dns": "workers"}, "must be name:port"),
        ({"model": "a", "workers": ["h:1"], "fallback": "a"}, "names itself"),
        ({"model": "a", "workers": ["h:1"], "fallback": "zzz"}, "falls back to 'zzz'"),
        ({"model": "a", "workers": ["h:1"], "max_queued_requests": -1}, "max_queued_requests=-1"),
        ({"model": "a", "workers": ["h:1"], "ttft_slo_share": 0}, "ttft_slo_share=0"),
        ({"model": "a", "workers": ["h:1"], "ttft_slo_share": 1.5}, "ttft_slo_share=1.5"),
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


def test_the_prompt_estimate_learns_how_many_tokens_a_bound_turns_out_to_be() -> None:
    """Bounds are bytes; after tokenized prompts of a quarter of their bound, a bound of 2,000 is
    forecast as about 500 tokens, never more than the bound itself."""
    estimate = PromptEstimate()
    assert estimate.expected(2000) == 2000  # nothing learnt: the bound
    for _ in range(60):
        estimate.observe(2000, 500)
    assert estimate.expected(2000) == pytest.approx(500, rel=0.02)
    for _ in range(60):
        estimate.observe(100, 400)  # an exact count above its bound is capped at the bound
    assert estimate.expected(2000) <= 2000 and estimate.expected(0) == 1
