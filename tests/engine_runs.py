"""For the engine's tests: running requests through an in-process engine to the end, and a draft
cost that does not depend on the machine's timings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine.cost_line import StepCostModel
from tests.scheduler_invariants import check_invariants

if TYPE_CHECKING:
    from services.worker.engine.engine import LLMEngine
    from services.worker.engine.sequence import StepOutput
    from strata.sampling import SamplingParams


def run_requests(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[StepOutput]]:
    """Validate and add every request, step until the engine is idle (checking the scheduler's
    invariants after each step), and return each request's step outputs in order."""
    for rid, (prompt, params) in requests.items():
        engine.validate(prompt, params)
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
        check_invariants(engine.scheduler)
    return outputs


class PinnedDraftCost(StepCostModel):
    """A draft-cost rule that ignores step times: a test's drafts must not hang on how busy the
    machine was (a loaded machine's noisy steps can make drafts look dear and stop them)."""

    def __init__(self, cost: float = 0.0) -> None:
        super().__init__()
        self._cost = cost

    def observe(self, num_tokens: int, seconds: float) -> None:
        return

    def draft_cost(self, num_decodes: int, drafting: StepCostModel | None = None) -> float:
        return self._cost


def pin_draft_cost(engine: LLMEngine, cost: float = 0.0) -> LLMEngine:
    """Give the engine's speculator PinnedDraftCost(cost); returns the engine."""
    if engine.speculator is None:
        raise ValueError("the engine has speculative decoding off: nothing to pin")
    engine.speculator.costs = PinnedDraftCost(cost)
    return engine
