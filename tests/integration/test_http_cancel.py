"""The HTTP API's promises about a request's end: a client that goes away, whether its request is queued,
generating or streaming, and whether it asked for a stream or not, cancels the request in the worker
(its KV blocks freed); the deadline header ends it with 504; readiness and the drain on stop.

One real stack for the module (http_harness.py): its worker sleeps a little before each engine step,
so a 200-token request lasts seconds (far longer than any cancellation may take), and holds few
credits, so that requests beyond them wait in the gateway's queue.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx2
import openai
import pytest
from prometheus_client import REGISTRY

from gateway.server import start as start_gateway
from gateway.settings import GatewaySettings
from tests.integration.http_harness import CREDITS, KEY, MODEL, HttpStack
from tests.polling import wait_for
from tests.route_defaults import harness_route

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from openai.types.chat import ChatCompletionMessageParam

GO_ON: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Go on"}]
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Go on"}],
    "max_tokens": 200,
    "ignore_eos": True,
}
AUTH = {"authorization": f"Bearer {KEY}"}
SLOW_STEP_S = 0.02
"""200 tokens take 4 s or more: any cancellation must take far less."""


@pytest.fixture(scope="module")
def stack(tiny_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_serving_dir, step_delay_s=SLOW_STEP_S) as running:
        yield running


def sdk(stack: HttpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


def cancelled() -> float:
    labels = {"model": MODEL, "protocol": "http", "code": "cancelled"}
    return REGISTRY.get_sample_value("strata_gateway_requests_total", labels) or 0.0


def post_and_give_up(stack: HttpStack, body: dict[str, Any], after_s: float) -> None:
    """POST `body` and drop the connection after `after_s` seconds without an answer."""
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(f"{stack.base_url}/chat/completions", json=body, headers=AUTH, timeout=after_s)


def test_stream_disconnect_frees_the_kv_blocks(stack: HttpStack) -> None:
    """A streaming client that closes its response mid-stream: the worker frees the request's blocks,
    long before its 200 tokens could have run."""
    wait_for(stack.idle, 30, "the worker went idle")
    steps = stack.worker_stats().steps
    stream = sdk(stack).chat.completions.create(
        model=MODEL, messages=GO_ON, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    assert stack.worker_stats().used_kv_blocks > 0
    stream.close()
    wait_for(stack.idle, 10, "KV blocks freed after the client closed its stream")
    assert stack.worker_stats().steps - steps < 150


def test_whole_response_disconnect_frees_the_kv_blocks(stack: HttpStack) -> None:
    """A client that asked for a whole response and gave up while it was generating: the disconnect is
    seen although nothing was being sent, and the worker frees the blocks."""
    wait_for(stack.idle, 30, "the worker went idle")
    steps = stack.worker_stats().steps
    before = cancelled()
    post_and_give_up(stack, LONG, after_s=0.4)
    wait_for(stack.idle, 10, "KV blocks freed after the client went away")
    assert stack.worker_stats().steps - steps < 150
    wait_for(lambda: cancelled() == before + 1, 10, "the request counted as cancelled over http")


def test_queued_disconnect_leaves_the_queue_and_never_runs(stack: HttpStack) -> None:
    """With every worker credit taken, a request waits in the gateway's queue; its client walking away
    takes it out of the queue, and it never reaches the worker."""
    wait_for(stack.idle, 30, "the worker went idle")
    client = sdk(stack)
    holders = []
    for _ in range(CREDITS):
        holder = client.chat.completions.create(
            model=MODEL,
            messages=GO_ON,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(holder))
        holders.append(holder)
    assert stack.worker_stats().open_requests == CREDITS
    gone = threading.Thread(target=post_and_give_up, args=(stack, {**LONG, "max_tokens": 8}, 1.5))
    gone.start()
    wait_for(lambda: stack.queued() == 1, 5, "the fourth request queued in the gateway")
    gone.join(10)
    wait_for(lambda: stack.queued() == 0, 5, "the abandoned request left the queue")
    assert stack.worker_stats().open_requests == CREDITS  # it never reached the worker
    for holder in holders:
        holder.close()
    wait_for(stack.idle, 10, "KV blocks freed after the streams closed")


def test_deadline_header_ends_the_request_with_504(stack: HttpStack) -> None:
    """x-strata-timeout-ms is the request's deadline: a generation longer than it is 504 with an OpenAI
    error body, soon after the deadline, and the worker frees its blocks; a bad value is 400."""
    wait_for(stack.idle, 30, "the worker went idle")
    started = time.monotonic()
    reply = httpx2.post(
        f"{stack.base_url}/chat/completions",
        json=LONG,
        headers={**AUTH, "x-strata-timeout-ms": "300"},
        timeout=30,
    )
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 3
    wait_for(stack.idle, 10, "KV blocks freed after the deadline")
    bad = httpx2.post(
        f"{stack.base_url}/chat/completions", json=LONG, headers={**AUTH, "x-strata-timeout-ms": "soon"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-strata-timeout-ms"


def test_health_is_503_until_ready_and_a_drain_finishes_running_streams(stack: HttpStack) -> None:
    """A second gateway whose route has no worker yet answers /health 503. The module's worker behind a
    third gateway: a stream running when the gateway stops still ends with [DONE], and the HTTP API
    takes no new connection once the drain began."""
    lonely = stack.loop.run(start_gateway(_settings(stack, "127.0.0.1:1")))
    try:
        assert lonely.http is not None
        health = httpx2.get(f"http://{lonely.http.address}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "not_serving"}
    finally:
        stack.loop.run(lonely.stop(0))
    gateway = stack.loop.run(start_gateway(_settings(stack, stack.worker_address)))
    assert stack.loop.run(gateway.wait_ready(30))
    url = f"http://{gateway.http.address}/v1/chat/completions"
    with httpx2.stream("POST", url, json={**LONG, "max_tokens": 60, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        stopping = asyncio.run_coroutine_threadsafe(gateway.stop(10), stack.loop.loop)
        wait_for(lambda: _refused(url), 5, "new connections refused once the drain began")
        events = [line for line in lines if line]
    stopping.result(30)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def _settings(stack: HttpStack, worker: str) -> GatewaySettings:
    return GatewaySettings.build(
        {
            "listen": "127.0.0.1:0",
            "http_listen": "127.0.0.1:0",
            "tokenizer_address": stack.servers[0].address,
            "routes": [harness_route(MODEL, workers=[worker])],
            "reconnect_backoff_max_s": 0.5,
        }
    )


def _refused(url: str) -> bool:
    try:
        httpx2.get(url.replace("/v1/chat/completions", "/health"), timeout=2)
    except httpx2.ConnectError:
        return True
    return False
