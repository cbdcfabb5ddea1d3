"""What of a prompt a worker's prefix cache likely holds, guessed from the prompt's text before it is
tokenized: the piece hashes (prompt_prefix), one stream's memory of prefilled prompts
(CachedPrefixes), and the forecast pricing only the rest. No I/O."""

from __future__ import annotations

import pytest

from gateway.admission import Ticket
from gateway.forecast import LinkLoad, LinkView, forecast
from gateway.prompt_prefix import PIECE_BYTES, CachedPrefixes, PromptPrefix, prompt_prefix
from strata.v1 import common_pb2, gateway_pb2, worker_pb2

SYSTEM = "You answer questions about the shipping manual. " * 100  # 4,900 bytes: 19 pieces


def chat(question: str, system: str = SYSTEM, tools: tuple[str, ...] = ()) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(role="system", content=system),
            common_pb2.ChatMessage(role="user", content=question),
        ]
    )
    for name in tools:
        request.tools.add(name=name, parameters_json="{}")
    return request


def cache(kv_tokens: int = 100_000, kv_blocks: int = 6_250) -> CachedPrefixes:
    memory = CachedPrefixes()
    memory.size(kv_tokens, kv_blocks)  # 16 tokens a block
    return memory


def test_requests_sharing_a_system_prompt_share_its_pieces_and_no_more() -> None:
    one, two = prompt_prefix(chat("Where is my parcel?"), ""), prompt_prefix(chat("How heavy?"), "")
    shared = len("system\0" + SYSTEM + "\x1euser\0") // PIECE_BYTES
    assert one.pieces[:shared] == two.pieces[:shared]
    assert len(one.pieces) == (len(SYSTEM) + len("Where is my parcel?") + 14) // PIECE_BYTES
    other = prompt_prefix(chat("Where is my parcel?", system="Another manual. " * 300), "")
    assert not set(other.pieces) & set(one.pieces)


def test_the_tenant_and_the_tools_change_every_piece() -> None:
    """A tenant salts the worker's cache, and a template renders tools before the messages: neither
    prompt can be served from the other's cached blocks."""
    base = prompt_prefix(chat("q"), "acme")
    for other in (prompt_prefix(chat("q"), "globex"), prompt_prefix(chat("q", tools=("lookup",)), "acme")):
        assert len(other.pieces) == len(base.pieces) and not set(other.pieces) & set(base.pieces)


def test_a_prompt_shorter_than_a_piece_has_none() -> None:
    assert prompt_prefix(gateway_pb2.GenerateRequest(prompt="hi"), "").pieces == ()


def test_a_prefilled_prompt_is_found_for_the_next_one_sharing_its_prefix_in_whole_blocks() -> None:
    memory = cache()
    first = prompt_prefix(chat("Where is my parcel?"), "")
    assert memory.cached_tokens(first) == 0
    memory.prefilled(first, prompt_tokens=1_000)
    share = 1_000 * PIECE_BYTES / first.size  # tokens per piece of that prompt
    # Its own prompt: its tokens up to its last whole piece, floored to whole blocks of 16.
    assert memory.cached_tokens(first) == int(len(first.pieces) * share) // 16 * 16
    second = prompt_prefix(chat("How heavy may it be?"), "")
    shared = len("system\0" + SYSTEM + "\x1euser\0") // PIECE_BYTES
    assert memory.cached_tokens(second) == int(shared * share) // 16 * 16 > 900
    assert memory.cached_tokens(prompt_prefix(chat("q"), "another tenant")) == 0


def test_the_memory_keeps_what_the_kv_cache_holds_and_evicts_a_prompts_tail_first() -> None:
    memory = cache(kv_tokens=1_600, kv_blocks=100)
    old = prompt_prefix(chat("old"), "")
    memory.prefilled(old, prompt_tokens=1_000)
    whole = memory.cached_tokens(old)
    new = prompt_prefix(chat("new", system="A different manual entirely. " * 120), "")
    memory.prefilled(new, prompt_tokens=1_000)
    # About 1,950 tokens of pieces in 1,600: the old prompt lost its tail, kept its head; the new
    # one, the most recently used, is whole.
    assert 0 < memory.cached_tokens(old) < whole - 300
    alone = cache(kv_tokens=1_600, kv_blocks=100)
    alone.prefilled(new, prompt_tokens=1_000)
    assert memory.cached_tokens(new) == alone.cached_tokens(new) > 900


def test_a_new_stream_forgets_everything() -> None:
    memory = cache()
    prefix = prompt_prefix(chat("q"), "")
    memory.prefilled(prefix, 1_000)
    memory.clear()
    assert memory.cached_tokens(prefix) == 0


def test_guesses_the_worker_did_not_confirm_lower_the_next_guesses_until_confirmed_again() -> None:
    memory = cache()
    prefix = prompt_prefix(chat("q"), "")
    memory.prefilled(prefix, 1_000)
    full = memory.cached_tokens(prefix)
    for _ in range(5):
        memory.confirmed(guessed=full, served=0)  # evicted on the worker behind the memory's back
    lowered = memory.cached_tokens(prefix)
    assert lowered < full * 0.4
    for _ in range(10):
        memory.confirmed(guessed=memory.cached_tokens(prefix), served=full)
    assert memory.cached_tokens(prefix) > full * 0.85


def step(duration_ms: float, prefill_budget: int) -> worker_pb2.StepInfo:
    return worker_pb2.StepInfo(duration_ms=duration_ms, max_running=8, prefill_budget=prefill_budget)


def hello(load: LinkLoad) -> None:
    memory = common_pb2.MemoryBudget(kv_tokens=100_000, kv_blocks=6_250)
    info = worker_pb2.GetWorkerInfoResponse(memory=memory)
    message = worker_pb2.ConnectResponse(hello=worker_pb2.WorkerHello(info=info), step=step(100.0, 64))
    load.observe(message, 0.0)


def serve_once(load: LinkLoad, prefix: PromptPrefix, prompt: int, cached: int) -> None:
    """A request of `prefix` sent on the stream and its first update (`cached` tokens served)."""
    load.sent(
        worker_pb2.Submission(
            request_id="first", prompt_ids=[1] * prompt, sampling=common_pb2.SamplingParams(max_new_tokens=4)
        ),
        prefix=prefix,
    )
    update = worker_pb2.TokenUpdate(
        request_id="first", output_tokens=1, finished=True, cached_prompt_tokens=cached
    )
    load.observe(worker_pb2.ConnectResponse(updates=[update]), 0.0)


def test_the_forecast_prices_only_the_prompt_the_worker_likely_lacks() -> None:
    """The user's case: a 1,000-token system prompt just served; the next question sharing it costs
    its own few tokens' prefill, not the whole prompt's."""
    load = LinkLoad()
    hello(load)
    serve_once(load, prompt_prefix(chat("Where is my parcel?"), ""), prompt=1_000, cached=0)
    second = prompt_prefix(chat("How heavy may it be?"), "")
    cached = load.cache.cached_tokens(second)
    assert cached >= 900
    ticket = Ticket(request_id="t", prompt_tokens=1_010, max_new_tokens=8, prefix=second)
    guessed = forecast([LinkView(load, slots=8, free_credits=8, cached_tokens=cached)], [], ticket)
    unaware = forecast([LinkView(load, slots=8, free_credits=8)], [], ticket)
    assert guessed is not None and unaware is not None
    # The step in progress plus ceil(1,010 / 64) = 16 chunks, against it plus ceil((1,010 - cached) / 64).
    assert unaware.ttft_s == pytest.approx(0.1 * 17)
    assert guessed.ttft_s == pytest.approx(0.1 * (1 + -(-(1_010 - cached) // 64)))


def test_a_sent_prompt_the_worker_likely_has_cached_waits_for_no_prefill_of_its_cached_part() -> None:
    load = LinkLoad()
    hello(load)
    prefix = prompt_prefix(chat("Where is my parcel?"), "")
    serve_once(load, prefix, prompt=1_000, cached=0)
    load.sent(
        worker_pb2.Submission(
            request_id="again", prompt_ids=[1] * 1_000, sampling=common_pb2.SamplingParams(max_new_tokens=4)
        ),
        prefix=prefix,
    )
    _, _, pending = load.busy_until(slots=8)
    assert pending == 1_000 - load.cache.cached_tokens(prefix) < 100
