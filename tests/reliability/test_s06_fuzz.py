"""Scenario 6: bad input, fuzzed, against a running gateway.

hypothesis builds GenerateRequests at the wire level with a small protobuf encoder (so that string
fields can carry invalid UTF-8, which the Python protobuf refuses to serialize, and numbers can be any
64-bit varint or any float32 bit pattern), oversized ones, and bytes that are no message at all, and
sends each to Generate or GenerateStream of a real stack: the tokenizer service, one worker of the
tiny model and the gateway, in-process on one event loop. Every answer must be OK (a well-formed
completion) or a status the gateway documents, never UNKNOWN, INTERNAL or UNAVAILABLE on this healthy
stack; after each run the stack is SERVING, answers a good request exactly as before, and the worker
holds no request and no KV block. Figures: inputs tried, codes seen, the slowest refusal.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from strata.v1 import common_pb2, gateway_pb2
from tests.integration.gateway_harness import Stack
from tests.polling import seconds_until
from tests.reliability.harness import SERVING, health, worker_stats
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.figures import Figure

SCENARIO = 6
MIB = 1 << 20
NEW_TOKENS = 8
CALL_TIMEOUT_S = 60.0  # far above any answer here: a DEADLINE_EXCEEDED means the gateway hung
ENGINE = {"num_blocks": 128, "max_num_seqs": 16, "max_num_batched_tokens": 256}
OK = grpc.StatusCode.OK
# What gateway.proto and gateway/errors.py document for a client's request to a healthy, idle stack.
# UNAVAILABLE is absent on purpose: nothing here is down, so it would mean an input broke a service.
DOCUMENTED = {
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
# Big inputs are the point here, and a call is slower than hypothesis expects of a test.
SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
GOOD = gateway_pb2.GenerateRequest(
    model="tiny", prompt="The quick brown fox", sampling=common_pb2.SamplingParams(max_new_tokens=6)
)


# A protobuf wire encoder small enough to trust: varint (wire type 0), fixed32 (5), length-delimited (2).
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int32/int64 goes out as its 64-bit two's complement
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def number_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def float_field(number: int, value: float) -> bytes:
    return varint(number << 3 | 5) + struct.pack("<f", value)


def bytes_field(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


BAD_UTF8 = (b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82")
EDGE_INTS = (0, 1, -1, 255, 256, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf"))

valid_text = st.text(max_size=48).map(str.encode)
invalid_text = st.tuples(valid_text, st.sampled_from(BAD_UTF8), valid_text).map(b"".join)
texts = st.one_of(valid_text, invalid_text, st.just(b""), st.binary(max_size=32))
numbers = st.one_of(
    st.integers(0, 16), st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1), st.integers(0, 300)
)
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(width=32), st.floats(0, 2, width=32))
models = st.one_of(st.sampled_from([b"tiny", b"", b"TINY", b"tiny ", b"gpt-4", b"tiny\x00"]), texts)
roles = st.one_of(st.sampled_from([b"system", b"user", b"assistant"]), texts)
chat_message = st.tuples(roles, texts).map(lambda m: bytes_field(1, m[0]) + bytes_field(2, m[1]))
unknown_field = st.tuples(st.integers(10, 2**29 - 1), st.binary(max_size=16)).map(lambda f: bytes_field(*f))
sampling_field = st.one_of(
    st.builds(number_field, st.just(1), st.one_of(st.integers(0, NEW_TOKENS), numbers)),
    st.builds(float_field, st.sampled_from([2, 3, 5]), floats),
    st.builds(number_field, st.sampled_from([4, 6, 8, 9]), numbers),
    st.builds(bytes_field, st.just(7), texts),
    unknown_field,
)
sampling = st.lists(sampling_field, max_size=10).map(b"".join)
request_field = st.one_of(
    st.builds(bytes_field, st.just(1), texts),
    st.builds(bytes_field, st.just(2), chat_message),
    st.builds(bytes_field, st.just(3), models),
    st.builds(bytes_field, st.just(4), sampling),
    st.builds(bytes_field, st.just(5), st.one_of(texts, st.text(max_size=300).map(str.encode))),
    st.builds(number_field, st.sampled_from([6, 7, 8, 9]), numbers),
    st.builds(float_field, st.integers(1, 9), floats),  # a known field with the wrong wire type
    unknown_field,
)
fuzzed_fields = st.lists(request_field, max_size=12).map(b"".join)
# Most fuzzed requests fail the prompt-or-messages rule first: give some a valid prompt to spoil, and
# some nothing but fuzzed sampling, so that odd numbers reach the tokenizer and the worker too.
fields_requests = st.one_of(
    fuzzed_fields,
    fuzzed_fields.map(lambda tail: bytes_field(1, b"Hello there") + tail),
    sampling.map(lambda params: bytes_field(1, b"Hello there") + bytes_field(4, params)),
)


@st.composite
def invalid_utf8_requests(draw: st.DrawFn) -> bytes:
    """A valid request with invalid UTF-8 in exactly one of its string fields."""
    bad = draw(invalid_text)
    where = draw(st.sampled_from(["prompt", "role", "content", "model", "request_id", "stop"]))
    chat = where in ("role", "content")
    text = bytes_field(1, b"Hello") if not chat else b""
    if chat:
        role, content = (bad, b"Hi") if where == "role" else (b"user", bad)
        text = bytes_field(2, bytes_field(1, role) + bytes_field(2, content))
    if where == "prompt":
        text = bytes_field(1, bad)
    stop = bytes_field(4, bytes_field(7, bad)) if where == "stop" else b""
    return (
        text
        + bytes_field(3, bad if where == "model" else b"tiny")
        + bytes_field(5, bad if where == "request_id" else b"")
        + stop
    )


@st.composite
def oversized_requests(draw: st.DrawFn) -> bytes:
    """Prompts up to 4 MiB, thousands of stop strings or chat messages, long ids: big by repetition."""
    pattern = draw(st.text(min_size=1, max_size=8)).encode()
    size = draw(
        st.one_of(
            st.integers(0, 4096),
            st.sampled_from([MIB - 64, MIB - 1, MIB, MIB + 1, 2 * MIB, 4 * MIB]),
            st.integers(0, 4 * MIB),
        )
    )
    repeated = (pattern * (size // len(pattern) + 1))[:size].decode(errors="ignore").encode()
    stops = draw(st.lists(valid_text, max_size=8)) * draw(st.sampled_from([0, 1, 2, 100, 1000, 5000]))
    shape = draw(st.sampled_from(["prompt", "messages", "stop", "request_id"]))
    if shape == "messages":
        message = bytes_field(2, bytes_field(1, b"user") + bytes_field(2, pattern))
        body = message * draw(st.integers(0, 3000))
    elif shape == "request_id":
        body = bytes_field(1, b"Hi") + bytes_field(5, repeated)
    else:
        body = bytes_field(1, repeated if shape == "prompt" else b"Hi")
    truncation = number_field(7, draw(st.sampled_from([0, 1, 2])))
    stop_fields = b"".join(bytes_field(7, stop) for stop in stops) if shape == "stop" else b""
    return body + truncation + bytes_field(4, number_field(1, NEW_TOKENS) + stop_fields)


@st.composite
def mangled_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid request cut short or with bytes overwritten."""
    random = st.binary(max_size=2048)
    base = draw(st.one_of(fields_requests, st.just(GOOD.SerializeToString())))
    if not base or draw(st.booleans()):
        return draw(random)
    if draw(st.booleans()):
        return base[: draw(st.integers(0, len(base) - 1))]
    spot = draw(st.integers(0, len(base) - 1))
    return base[:spot] + draw(st.binary(min_size=1, max_size=8)) + base[spot + 1 :]


STRATEGIES: dict[str, st.SearchStrategy[bytes]] = {
    "fields": fields_requests,
    "invalid_utf8": invalid_utf8_requests(),
    "oversized": oversized_requests(),
    "raw_bytes": mangled_bytes(),
}


@dataclass
class Tally:
    """What the fuzzing saw: inputs tried, codes, the slowest refusal."""

    tried: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    by_strategy: Counter[tuple[str, str]] = field(default_factory=Counter)
    slowest_refusal_s: float = 0.0

    def summary(self, strategy: str = "") -> str:
        codes = (
            self.codes
            if not strategy
            else Counter({code: n for (name, code), n in self.by_strategy.items() if name == strategy})
        )
        return ", ".join(f"{code} {count}" for code, count in codes.most_common())


@dataclass
class FuzzStack:
    gateway: str
    worker: str
    unary: Callable[..., Any]
    streaming: Callable[..., Any]
    good: gateway_pb2.GenerateResponse = field(default_factory=gateway_pb2.GenerateResponse)
    tally: Tally = field(default_factory=Tally)


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path) -> Iterator[FuzzStack]:
    with Stack(tiny_serving_dir) as servers:
        tokenizer = servers.start_tokenizer()
        worker = servers.start_worker(tiny_serving_dir, engine=ENGINE)
        settings_ = GatewaySettings.build(
            {
                "listen": "127.0.0.1:0",
                "tokenizer_address": tokenizer,
                "routes": [harness_route("tiny", workers=[worker])],
                "default_max_new_tokens": NEW_TOKENS,
                "max_message_bytes": MIB,
            }
        )
        gateway = servers.loop.run(start_gateway(settings_))
        servers.servers.append(gateway)
        assert servers.loop.run(gateway.wait_ready(60)), "the gateway did not become ready in 60 s"
        channel = servers.channel(gateway.address)
        # No serializers: the test sends bytes and reads bytes, as a hostile client would.
        fuzz = FuzzStack(
            gateway.address,
            worker,
            channel.unary_unary("/strata.v1.Gateway/Generate"),
            channel.unary_stream("/strata.v1.Gateway/GenerateStream"),
        )
        fuzz.good = generate(fuzz, GOOD)
        assert fuzz.good.usage.output_tokens == 6, fuzz.good
        yield fuzz


def generate(stack: FuzzStack, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
    reply = stack.unary(request.SerializeToString(), timeout=CALL_TIMEOUT_S)
    return gateway_pb2.GenerateResponse.FromString(reply)


def describe(payload: bytes) -> str:
    """The input for a failure message: its size and first bytes, and what it parses as."""
    try:
        parsed = str(gateway_pb2.GenerateRequest.FromString(payload))[:400]
    except DecodeError as exc:
        parsed = f"unparsable: {exc}"
    return f"{len(payload)} bytes {payload[:200]!r}... parsed: {parsed}"


def check_ok(payload: bytes, replies: list[bytes], streamed: bool) -> None:
    """An OK answer is a whole completion within the request's token budget, for the caller's id."""
    request = gateway_pb2.GenerateRequest.FromString(payload)
    if streamed:
        messages = [gateway_pb2.GenerateStreamResponse.FromString(reply) for reply in replies]
        assert messages and messages[-1].HasField("final"), "the stream ended without a final message"
        assert not any(message.HasField("final") for message in messages[:-1])
        final = messages[-1].final
    else:
        final = gateway_pb2.GenerateResponse.FromString(replies[0])
    budget = request.sampling.max_new_tokens or NEW_TOKENS
    assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH), final
    assert 1 <= final.usage.output_tokens <= budget, final
    assert final.usage.output_tokens == len(final.token_ids), final
    assert final.model == "tiny", final
    if request.request_id:
        assert final.request_id == request.request_id, final


def attempt(stack: FuzzStack, strategy: str, payload: bytes, streamed: bool) -> grpc.StatusCode:
    """Send one input; assert its answer is documented (and whole when OK)."""
    started = time.monotonic()
    details = ""
    try:
        if streamed:
            replies = list(stack.streaming(payload, timeout=CALL_TIMEOUT_S))
        else:
            replies = [stack.unary(payload, timeout=CALL_TIMEOUT_S)]
        code = OK
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    elapsed = time.monotonic() - started
    kind = "GenerateStream" if streamed else "Generate"
    stack.tally.tried[strategy] += 1
    stack.tally.codes[code.name] += 1
    stack.tally.by_strategy[strategy, code.name] += 1
    assert code in DOCUMENTED, f"{kind} answered {code.name} ({details!r}) to {describe(payload)}"
    if code == OK:
        check_ok(payload, replies, streamed)
    else:
        stack.tally.slowest_refusal_s = max(stack.tally.slowest_refusal_s, elapsed)
    return code


def assert_healthy(stack: FuzzStack) -> None:
    """SERVING, the good request answered exactly as at the start, and the worker idle and empty."""
    assert health(stack.gateway, timeout=10) == SERVING
    again = generate(stack, GOOD)
    assert (again.text, list(again.token_ids)) == (stack.good.text, list(stack.good.token_ids))

    def idle() -> bool:
        stats = worker_stats(stack.worker)
        return (stats.open_requests, stats.running, stats.waiting, stats.used_kv_blocks) == (0, 0, 0, 0)

    seconds_until(idle, 10, "the worker idle with every KV block free")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_fuzzed_input_gets_a_documented_answer_and_the_stack_stays_healthy(
    stack: FuzzStack, strategy: str, full: bool, figure: Figure
) -> None:
    before = stack.tally.tried[strategy]

    @settings(
        max_examples=2000 if full else 150,
        deadline=None,
        derandomize=not full,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(payload=STRATEGIES[strategy], streamed=st.booleans())
    def fuzz(payload: bytes, streamed: bool) -> None:
        code = attempt(stack, strategy, payload, streamed)
        if strategy == "invalid_utf8":
            assert code == grpc.StatusCode.INVALID_ARGUMENT, describe(payload)
        if len(payload) > MIB:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, describe(payload)

    fuzz()
    assert_healthy(stack)
    tried = stack.tally.tried[strategy] - before
    assert tried >= 100, f"only {tried} inputs reached the gateway"
    figure(SCENARIO, f"inputs tried ({strategy})", tried)
    figure(SCENARIO, f"codes seen ({strategy})", stack.tally.summary(strategy))


def test_totals_after_all_fuzzing(stack: FuzzStack, figure: Figure) -> None:
    assert_healthy(stack)
    tally = stack.tally
    assert not set(tally.codes) - {code.name for code in DOCUMENTED}, tally.codes
    if tally.tried:
        figure(SCENARIO, "inputs tried", sum(tally.tried.values()))
        figure(SCENARIO, "codes seen", tally.summary())
        figure(SCENARIO, "slowest refusal", tally.slowest_refusal_s * 1000, "ms")
