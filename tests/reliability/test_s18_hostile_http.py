"""Scenario 18: HTTP clients that trickle bytes, hold connections or never read meet the HTTP API's
bounds (gateway/http_guard.py, http_endpoints.py), and the API goes on serving the rest.

Raw sockets play the clients that misbehave, which an HTTP library would not: a request head sent a
byte at a time (slowloris), a connection that sends nothing, a body that stops halfway, a flood of
connections past http_max_connections, and a stream whose client stops reading (a small receive
buffer, nothing read after the first event). The answers are checked as the official openai SDK
parses them (408 and 503 are OpenAI error bodies), and after each case the SDK is served. One real
stack for the module (http_harness.py) with short limits, so most cases take about a second.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import TYPE_CHECKING

import openai
import pytest
from prometheus_client import REGISTRY

from tests.integration.http_harness import KEY, MODEL, HttpStack
from tests.polling import wait_for

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests.figures import Figure

HEAD_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
IDLE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4
STEP_DELAY_S = 0.04
NEW_TOKENS = 2000
"""At STEP_DELAY_S a step, a stream this long cannot end by itself within 80 s."""
TRICKLE_S = 0.05
"""The slow client's pause between bytes: the misbehaviour under test, not a synchronisation."""
BOUND = 5.0
"""Every timing bound is this many times the expected value."""


@pytest.fixture(scope="module")
def stack(tiny_long_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(
        tiny_long_serving_dir,
        step_delay_s=STEP_DELAY_S,
        http_max_connections=MAX_CONNECTIONS,
        http_header_timeout_s=HEAD_TIMEOUT_S,
        http_body_timeout_s=BODY_TIMEOUT_S,
        stream_idle_timeout_s=IDLE_TIMEOUT_S,
    ) as running:
        yield running


def _served(stack: HttpStack) -> float:
    """Seconds a good request takes through the openai SDK; it must succeed."""
    started = time.perf_counter()
    with openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert reply.choices[0].message.content is not None
    return time.perf_counter() - started


def _connect(stack: HttpStack, receive_buffer: int = 0) -> socket.socket:
    host, port = stack.gateway.http.address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], dict[str, object]]:
    """Read a whole response until the server closes: status, headers, JSON body."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _request_head(body: bytes) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: strata\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()


def test_a_head_sent_a_byte_at_a_time_gets_408_and_the_api_serves_on(
    stack: HttpStack, figure: Figure
) -> None:
    """Slowloris: the head trickles in a byte every TRICKLE_S; at http_header_timeout_s from its first
    byte the server answers 408 (an OpenAI error body naming the setting) and closes."""
    head = _request_head(b"{}")
    sock = _connect(stack)
    answered = threading.Event()

    def trickle() -> None:
        for byte in head[:-4]:  # never the blank line that ends the head
            if answered.is_set():
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return
            time.sleep(TRICKLE_S)

    started = time.perf_counter()
    sender = threading.Thread(target=trickle)
    sender.start()
    status, _, body = _response(sock)
    took = time.perf_counter() - started
    answered.set()
    sender.join()
    sock.close()
    figure(18, "slowloris head answered 408 after", took, f"s (http_header_timeout_s {HEAD_TIMEOUT_S})")
    assert status == 408
    assert "http_header_timeout_s" in str(body["error"])
    assert HEAD_TIMEOUT_S <= took < BOUND * HEAD_TIMEOUT_S
    figure(18, "a good request after it", _served(stack), "s")


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(stack: HttpStack) -> None:
    """A connection opened and left silent (a half-open or abandoned client) holds no slot: 408, closed."""
    started = time.perf_counter()
    with _connect(stack) as sock:
        status, _, _ = _response(sock)
    took = time.perf_counter() - started
    assert status == 408
    assert HEAD_TIMEOUT_S <= took < BOUND * HEAD_TIMEOUT_S
    _served(stack)


def test_a_body_that_stops_halfway_gets_408(stack: HttpStack, figure: Figure) -> None:
    """A whole head announcing 200 bytes, then 10 of them and nothing: 408 naming http_body_timeout_s."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 120}]}).encode()
    body = body.ljust(200)
    started = time.perf_counter()
    with _connect(stack) as sock:
        sock.sendall(_request_head(body) + body[:10])
        status, _, answer = _response(sock)
    took = time.perf_counter() - started
    figure(18, "half a body answered 408 after", took, f"s (http_body_timeout_s {BODY_TIMEOUT_S})")
    assert status == 408
    assert "http_body_timeout_s" in str(answer["error"])
    assert BODY_TIMEOUT_S <= took < BOUND * BODY_TIMEOUT_S
    _served(stack)


def test_connections_past_the_cap_are_answered_503_as_the_sdk_reads_it(
    stack: HttpStack, figure: Figure
) -> None:
    """Idle keep-alive connections fill the API up to http_max_connections (fewer when earlier
    connections are still closing: the first answered 503 marks the cap); the SDK's request on one
    more is answered 503 with an OpenAI error body and Retry-After; once they close, it is served."""
    client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)
    held: list[socket.socket] = []
    while (sock := _kept_alive(stack)) is not None:
        held.append(sock)
        assert len(held) <= MAX_CONNECTIONS, "more connections held than http_max_connections"
    try:
        started = time.perf_counter()
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        took = time.perf_counter() - started
    finally:
        for sock in held:
            sock.close()
    error = refused.value
    figure(18, "a connection past http_max_connections answered 503 in", took * 1000, "ms")
    assert error.status_code == 503
    assert error.code == "too_many_connections"
    assert error.response.headers["retry-after"] == "1"
    wait_for(lambda: _served_or_none(stack), 60, "the SDK served once the held connections closed")


def _kept_alive(stack: HttpStack) -> socket.socket | None:
    """A connection that asked GET /health and now idles between keep-alive requests (uvicorn closes
    it after http_keep_alive_s, 5 s: ten times the head timeout an idle new connection would get);
    None, the connection closed, when the API answered it 503 for being over its cap."""
    sock = _connect(stack)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: strata\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    head, _, body = received.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 503"):
        sock.close()
        return None
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
    )
    while len(body) < length:
        body += sock.recv(4096)
    return sock


def _served_or_none(stack: HttpStack) -> float | None:
    try:
        return _served(stack)
    except openai.InternalServerError as error:
        assert error.status_code == 503, error
        return None


def _stuck() -> float:
    return REGISTRY.get_sample_value("strata_gateway_stuck_streams_total", {"model": MODEL}) or 0.0


def test_a_stream_nobody_reads_is_cancelled_and_frees_the_worker(stack: HttpStack, figure: Figure) -> None:
    """A 2,000-token stream (80 s at the least) whose client reads the first event and then nothing,
    through a 4 KiB receive buffer: stream_idle_timeout_s after the gateway's writes stop completing,
    the request is cancelled and the worker's KV blocks freed, long before its natural end."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Go on"}],
            "max_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    before = _stuck()
    with _connect(stack, receive_buffer=4096) as sock:
        sock.sendall(_request_head(body) + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, f"the stream ended before its first event: {received!r}"
            received += chunk
        started = time.perf_counter()
        wait_for(stack.idle, NEW_TOKENS * STEP_DELAY_S / 2, "the worker let go of the unread stream")
        freed = time.perf_counter() - started
    figure(
        18, "an unread stream's KV blocks freed after", freed, f"s (stream_idle_timeout_s {IDLE_TIMEOUT_S})"
    )
    assert _stuck() == before + 1, "the gateway cancelled the stream for its idle reader"
    figure(18, "a good request after it", _served(stack), "s")
