"""Runs a prefix-cache benchmark's requests on one in-process LLMEngine and times each one.

The engine steps on the calling thread (one OpenMP team, as in a worker); a request's time to first
token runs from its submission to the end of the step that produced its first token, and its end
from submission to its last token. `run_burst` submits every prompt at once; `run_conversations`
keeps each conversation closed-loop: a turn is submitted when the previous turn's answer is
complete, and its prompt is the previous prompt, the answer, and the next question. This module
only drives and times: it must not decide pass or fail nor write records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from services.worker.engine.engine import LLMEngine


@dataclass(slots=True)
class Timed:
    """One request as the driver saw it."""

    request_id: str
    prompt: list[int]
    submitted: float
    ttft_s: float | None = None
    end_s: float | None = None
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)


def _step_until(engine: LLMEngine, open_: dict[str, Timed], on_done: object = None) -> None:
    """Step until no request is open; call on_done(request) as each finishes (it may add more)."""
    while open_:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timed = open_.get(out.request_id)
            if timed is None:
                continue
            if timed.ttft_s is None and out.new_token_ids:
                timed.ttft_s = now - timed.submitted
                timed.cached_tokens = out.num_cached_tokens
            timed.tokens.extend(out.new_token_ids)
            if out.finished:
                timed.end_s = now - timed.submitted
                del open_[out.request_id]
                if callable(on_done):
                    on_done(timed)


def run_burst(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list[Timed], float]:
    """Every prompt submitted at once; each request's timing and the wall time to the last token."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    requests = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"burst-{index}", prompt, params)
        requests.append(Timed(f"burst-{index}", prompt, time.perf_counter()))
    _step_until(engine, {r.request_id: r for r in requests})
    return requests, time.perf_counter() - started


def run_conversations(
    engine: LLMEngine,
    openings: list[list[int]],
    turns: list[list[list[int]]],
    closing: list[int],
    new_tokens: int,
) -> tuple[list[list[Timed]], float]:
    """Conversation c starts with openings[c] + turns[c][0]; each later turn k resends the previous
    prompt, its answer, `closing`, then turns[c][k]. Per conversation its turns' timings; the wall time."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    done: list[list[Timed]] = [[] for _ in openings]
    open_: dict[str, Timed] = {}

    def submit(conversation: int, prompt: list[int]) -> None:
        rid = f"chat-{conversation}-{len(done[conversation])}"
        engine.add_request(rid, prompt, params)
        timed = Timed(rid, prompt, time.perf_counter())
        done[conversation].append(timed)
        open_[rid] = timed

    def next_turn(finished: Timed) -> None:
        conversation = int(finished.request_id.split("-")[1])
        turn = len(done[conversation])
        if turn < len(turns[conversation]):
            submit(conversation, finished.prompt + finished.tokens + closing + turns[conversation][turn])

    started = time.perf_counter()
    for conversation, opening in enumerate(openings):
        submit(conversation, opening + turns[conversation][0])
    _step_until(engine, open_, next_turn)
    return done, time.perf_counter() - started
