"""bench.serve_peer_run reads both servers' /v1/completions streams the same way.

A small HTTP server on a free port replays, chunked, one stream in each server's format: llama-server's
(every chunk carries `model` and `system_fingerprint`, the last one `finish_reason`, `usage` and
`timings` next to its text) and Strata's (OpenAI's: text chunks, then a chunk with no choices and the
usage). The real client (httpx2, bench/http_driver.py) reads them through `Runner.level`, so what is
checked is what the benchmark computes: a first token, one gap per later text chunk, the usage's
token counts, the model, an HTTP refusal counted as an error, and the bodies as they reached the wire.
llama-server's own stream, live, is test_serve_peer_llama.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, ClassVar

import httpx2
import pytest

from bench.serve_peer_plan import LLAMA, STRATA, Level, Shape
from bench.serve_peer_run import Runner, Target
from bench.stack_prompts import Prompt

if TYPE_CHECKING:
    from collections.abc import Iterator

TEXTS = [" the", " river", "", " and"]  # an empty chunk: part of a character, no token of its own


def llama_events() -> list[dict[str, Any]]:
    head = {
        "created": 1,
        "model": "m",
        "system_fingerprint": "b1-abc",
        "object": "text_completion",
        "id": "c",
    }
    events = [
        {"choices": [{"text": t, "index": 0, "logprobs": None, "finish_reason": None}], **head}
        for t in TEXTS[:-1]
    ]
    usage = {"completion_tokens": 4, "prompt_tokens": 3, "total_tokens": 7}
    last = {"text": TEXTS[-1], "index": 0, "logprobs": None, "finish_reason": "length"}
    return [*events, {"choices": [last], **head, "usage": usage, "timings": {"predicted_n": 4}}]


def strata_events() -> list[dict[str, Any]]:
    """As the gateway sends them (captured), with the usage chunk's `strata` extension trimmed."""
    head = {"id": "cmpl-84ee", "object": "text_completion", "created": 1796170276, "model": "m"}
    texts = [t for t in TEXTS if t]
    events: list[dict[str, Any]] = [
        {**head, "choices": [{"index": 0, "finish_reason": finish, "logprobs": None, "text": t}]}
        for t, finish in zip(texts, [None] * (len(texts) - 1) + ["length"], strict=True)
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {}}
    return [*events, {**head, "choices": [], "usage": usage, "strata": {"fallback_reason": ""}}]


class Replay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Replay.bodies.append((self.path, payload))
        if self.path.startswith("/busy"):
            self._whole(429, {"error": {"message": "queue full", "type": "rate_limit_error"}})
            return
        events = llama_events() if self.path.startswith("/llama") else strata_events()
        if not payload["stream"]:
            self._whole(200, {"choices": [{"text": " the river and"}], "usage": events[-1]["usage"]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            data = event.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _whole(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads the bodies, not the access log."""


@pytest.fixture
def replay() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Replay.bodies = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _level(base: str, strata_path: str, level: Level, contestant: str) -> tuple[dict[str, Any], list[Any]]:
    prompts = [Prompt(f"prompt {i}", (1, 2, 3)) for i in range(level.requests)]
    me = lambda: [os.getpid()]  # noqa: E731 - both "servers" are this process's threads
    targets = {
        STRATA: Target(f"{base}{strata_path}/v1/completions", "m", "m", me),
        LLAMA: Target(f"{base}/llama/v1/completions", "m", None, me),
    }

    async def go() -> tuple[dict[str, Any], list[Any]]:
        async with httpx2.AsyncClient() as client:
            return await Runner(client, targets, 30.0).level(contestant, level, prompts)

    return asyncio.run(go())


@pytest.mark.parametrize("contestant", [STRATA, LLAMA])
def test_both_streams_give_a_first_token_a_gap_per_later_chunk_and_the_usage(
    replay: str, contestant: str
) -> None:
    level = Level(Shape(3, 4), 2, 4)
    figures, results = _level(replay, "/strata", level, contestant)
    assert figures["errors"] == 0 and figures["token_mismatches"] == 0, figures
    assert figures["output_tokens"] == 16 and figures["completed"] == 4
    for result in results:
        assert result.first_text_s is not None and result.first_text_s <= result.e2e_s
        assert len(result.itl_s) == 2  # three chunks with text; the empty one is no token's arrival
        assert (result.usage_input_tokens, result.usage_output_tokens, result.model) == (3, 4, "m")
    assert figures["chunks_per_token"] == pytest.approx(3 / 4)
    assert figures["server_cpu_s"] >= 0 and figures["client_cpu_s"] > 0
    sent = [body for path, body in Replay.bodies]
    assert sorted(b["prompt"] for b in sent) == sorted(f"prompt {i}" for i in range(4))
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["max_tokens"] == 4 for b in sent)
    assert all(("n_predict" in b) == (contestant == LLAMA) for b in sent)


def test_a_refused_request_is_an_error_of_its_contestant(replay: str) -> None:
    figures, results = _level(replay, "/busy", Level(Shape(3, 4), 1, 2), STRATA)
    assert figures["errors"] == 2 and figures["completed"] == 0
    refusal = json.dumps({"error": {"message": "queue full", "type": "rate_limit_error"}})
    assert figures["error_kinds"] == {f"429: {refusal[:120]}": 2}
    assert all(r.ttft_s is None for r in results)


def test_the_prompt_check_reads_the_prompt_tokens_both_report(replay: str) -> None:
    me = lambda: [os.getpid()]  # noqa: E731
    targets = {
        STRATA: Target(f"{replay}/strata/v1/completions", "m", "m", me),
        LLAMA: Target(f"{replay}/llama/v1/completions", "m", None, me),
    }

    async def go() -> list[dict[str, Any]]:
        async with httpx2.AsyncClient() as client:
            runner = Runner(client, targets, 30.0)
            return [await runner.prompt_check(c, Prompt("p", (1, 2, 3))) for c in (STRATA, LLAMA)]

    assert asyncio.run(go()) == [{"prompt_tokens": 3, "text": " the river and"}] * 2
    assert all(not body["stream"] and "stream_options" not in body for _, body in Replay.bodies)
