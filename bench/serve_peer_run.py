"""The server-level peer's run: the prompt-token check, the warm-up and the alternated timed rounds.

Both servers are up when it starts; one httpx2 client (bench/http_driver.py's request) sends every
request to either. First one prompt of each shape goes, unstreamed, to both: both must report the
shape's prompt tokens in usage.prompt_tokens (the texts are kept, greedy on the same weights). Then
one untimed pass of each shape on both (8 streams of one request by default), then the rounds.
Around each level it reads the CPU seconds of both servers' processes (the contestant's own, and the
idle one's, which should be near zero), of this client, and the load average at each round's start
and end.
This module runs the workload; it must not start or stop servers nor write the record.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx2
import psutil

from bench.driver import RequestResult
from bench.http_driver import send_http
from bench.http_vs_grpc import closed_loop
from bench.serve_peer_plan import CONTESTANTS, LLAMA, STRATA, Level, request_body, round_order, schedule
from bench.serve_peer_report import level_figures
from bench.session import BenchError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from bench.stack_prompts import Prompt


def fresh_connection_client(concurrency: int) -> httpx2.AsyncClient:
    """The one client for both servers: a fresh connection per request (none kept alive), since
    llama-server closes idle connections and one it closed as the pool handed it out failed the
    request; `concurrency` streams at once, with room for the checks beside them."""
    return httpx2.AsyncClient(
        limits=httpx2.Limits(max_connections=2 * concurrency + 8, max_keepalive_connections=0)
    )


@dataclass(frozen=True, slots=True)
class Target:
    """One contestant's /v1/completions URL, the model name it is asked for, and its process ids."""

    url: str
    model: str
    expect_model: str | None
    """The model every response must name (None: not checked)."""
    pids: Callable[[], list[int]]


@dataclass(slots=True)
class Outcome:
    """What the run produced: checks, per-round levels, and every timed request per level."""

    prompt_check: dict[str, Any] = field(default_factory=dict)
    warmup: dict[str, dict[str, Any]] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    pooled: dict[str, dict[str, list[RequestResult]]] = field(default_factory=dict)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User plus system CPU seconds of these processes so far."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


class Runner:
    """Sends levels to the contestants through one client."""

    def __init__(self, client: httpx2.AsyncClient, targets: dict[str, Target], timeout_s: float) -> None:
        self._client, self._targets, self._timeout_s = client, targets, timeout_s

    async def level(
        self, contestant: str, level: Level, prompts: list[Prompt]
    ) -> tuple[dict[str, Any], list[RequestResult]]:
        """One level on one contestant: its figures (with CPU seconds) and its requests."""
        target = self._targets[contestant]
        other = self._targets[LLAMA if contestant == STRATA else STRATA]
        bodies = [request_body(contestant, p, level.shape.new_tokens, target.model) for p in prompts]

        async def one(index: int) -> RequestResult:
            try:
                return await send_http(self._client, target.url, index, bodies[index], self._timeout_s)
            except httpx2.HTTPError as exc:
                # A transport failure is the contestant's error, counted as such; the level goes on.
                return RequestResult(index, type(exc).__name__, None, 0.0, message=str(exc))

        own_pids, other_pids = target.pids(), other.pids()
        own, idle = cpu_seconds(own_pids), cpu_seconds(other_pids)
        results, wall, client_cpu = await closed_loop(one, len(prompts), level.concurrency)
        figures = level_figures(results, wall, level, target.expect_model)
        figures["server_cpu_s"] = cpu_seconds(own_pids) - own
        figures["idle_peer_cpu_s"] = cpu_seconds(other_pids) - idle
        figures["client_cpu_s"] = client_cpu
        return figures, results

    async def prompt_check(self, contestant: str, prompt: Prompt) -> dict[str, Any]:
        """One unstreamed request: the prompt tokens and text the contestant reports."""
        target = self._targets[contestant]
        payload = {**request_body(contestant, prompt, 16, target.model), "stream": False}
        payload.pop("stream_options")
        response = await self._client.post(target.url, json=payload, timeout=self._timeout_s)
        if response.status_code != 200:
            raise BenchError(
                f"{contestant}'s prompt check answered {response.status_code}: {response.text[:300]}"
            )
        answer = response.json()
        return {"prompt_tokens": answer["usage"]["prompt_tokens"], "text": answer["choices"][0]["text"]}


async def run(
    runner: Runner,
    levels: list[Level],
    rounds: int,
    prompts_for: Callable[[str, Level], list[Prompt]],
    warmup_streams: int,
) -> Outcome:
    """The check, the warm-up (`warmup_streams` requests of each shape through as many streams) and
    `rounds` alternated rounds of `levels`."""
    outcome = Outcome(
        runs={level.key: {c: [] for c in CONTESTANTS} for level in levels},
        pooled={level.key: {c: [] for c in CONTESTANTS} for level in levels},
    )
    shapes = list(dict.fromkeys(level.shape for level in levels))
    for shape in shapes:
        prompt = prompts_for("check", Level(shape, 1, 1))[0]
        seen = {c: await runner.prompt_check(c, prompt) for c in CONTESTANTS}
        outcome.prompt_check[shape.name] = {
            "expected": shape.prompt_tokens,
            **{c: seen[c]["prompt_tokens"] for c in CONTESTANTS},
            "texts": {c: seen[c]["text"] for c in CONTESTANTS},
            "texts_equal": seen[STRATA]["text"] == seen[LLAMA]["text"],
        }
        wrong = {
            c: seen[c]["prompt_tokens"]
            for c in CONTESTANTS
            if seen[c]["prompt_tokens"] != shape.prompt_tokens
        }
        if wrong:
            raise BenchError(
                f"{shape.name}: the servers saw {wrong} prompt tokens, not {shape.prompt_tokens}"
            )
    for shape in shapes:
        warm = Level(shape, warmup_streams, warmup_streams)
        for contestant in CONTESTANTS:
            figures, _ = await runner.level(contestant, warm, prompts_for("warm", warm))
            outcome.warmup[f"{warm.key}/{contestant}"] = figures
            if figures["errors"] or figures["token_mismatches"]:
                raise BenchError(
                    f"the warm-up of {warm.key} on {contestant} failed: {figures['error_kinds']}"
                )
    for index, steps in enumerate(schedule(rounds, levels)):
        record: dict[str, Any] = {
            "round": index + 1,
            "order": list(round_order(index)),
            "load_average": {"start": list(os.getloadavg()), "end": None},
            "levels": [],
        }
        for level, contestant in steps:
            figures, results = await runner.level(contestant, level, prompts_for(f"r{index}", level))
            outcome.runs[level.key][contestant].append(figures)
            outcome.pooled[level.key][contestant].extend(results)
            record["levels"].append({"level": level.key, "contestant": contestant, **figures})
            print(
                f"round {index + 1} {level.key:<10} {contestant:<9} {figures['output_tok_s']:7.1f} tok/s "
                f"TTFT p50 {figures['ttft_ms_p50'] or 0:7.1f} ms errors {figures['errors']}",
                file=sys.stderr,
                flush=True,
            )
        record["load_average"]["end"] = list(os.getloadavg())
        outcome.rounds.append(record)
    return outcome
