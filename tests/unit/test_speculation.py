"""Speculative decoding's pure parts: prompt lookup, the acceptance rule, the draft-length rule, and
the scheduler scoring drafts over the fake model (tests/unit/scheduler_helpers.py).

The fake model samples a hash of each row's cached context, so a draft is accepted only where it is
the token the sequence would have got anyway; every output is compared with a run without drafts.
"""

from __future__ import annotations

import pydantic
import pytest

from services.worker.engine.config import EngineConfig, SpeculativeConfig
from services.worker.engine.cost_line import COST_WINDOW, StepCostModel
from services.worker.engine.ngram import ngram_proposal
from services.worker.engine.sequence import FinishReason, Sequence
from services.worker.engine.speculation import Speculator, accepted_tokens, draft_length
from strata.sampling import SamplingParams
from tests.unit.scheduler_helpers import FakeModel, make_scheduler, make_seq, run_all, step


def test_ngram_proposal_takes_what_followed_the_latest_occurrence_of_the_longest_tail() -> None:
    # [8, 2, 3] occurred at 0 (then 4, 5); the shorter [2, 3] occurred later, at 5 (then 6): the
    # longer tail wins.
    tokens = [8, 2, 3, 4, 5, 2, 3, 6, 8, 2, 3]
    assert ngram_proposal(tokens, 3, max_n=3, min_n=2) == [4, 5, 2]
    assert ngram_proposal(tokens, 3, max_n=2, min_n=2) == [6, 8, 2]
    # Near the end, fewer tokens follow than asked for.
    assert ngram_proposal([1, 2, 9, 1, 2], 4, max_n=2, min_n=2) == [9, 1, 2]
    assert ngram_proposal([1, 2, 3, 4], 4, max_n=3, min_n=1) == []
    assert ngram_proposal([7, 7], 0, max_n=2, min_n=1) == []


def test_ngram_proposal_ignores_a_byte_match_that_straddles_two_tokens() -> None:
    # 256's bytes 00 01 00 00 occur at byte 1 of [65541, 1792] (05 00 01 00 | 00 07 00 00): no token.
    assert ngram_proposal([65541, 1792, 256], 2, max_n=1, min_n=1) == []
    assert ngram_proposal([256, 42, 65541, 1792, 256], 2, max_n=1, min_n=1) == [42, 65541]


def test_accepted_tokens_keep_drafts_while_they_equal_the_models_pick() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    with pytest.raises(ValueError, match="one more"):
        accepted_tokens([5, 6], [5, 6])


def test_cost_model_fits_the_steps_and_prices_a_draft_by_batch_size() -> None:
    costs = StepCostModel()
    assert costs.draft_cost(1) == 0.0  # no fit yet: draft, and measure
    for tokens in (1, 5, 2, 8, 3):
        costs.observe(tokens, 0.020 + 0.001 * tokens)
    assert costs.fixed == pytest.approx(0.020)
    assert costs.per_token == pytest.approx(0.001)
    assert costs.draft_cost(1) == pytest.approx(0.001 / 0.021)
    assert costs.draft_cost(64) == pytest.approx(0.064 / 0.084)
    # A window of equal steps says nothing of b: the last fit stands.
    for _ in range(COST_WINDOW):
        costs.observe(4, 0.5)
    settled = (costs.fixed, costs.per_token)
    costs.observe(4, 0.9)
    assert (costs.fixed, costs.per_token) == settled


def test_a_draft_models_passes_price_each_draft_on_top_of_scoring_it() -> None:
    """c = (b * B + a_d + b_d * B) / (a + b * B): one draft pass finds a token for each of B decodes."""
    costs, passes = StepCostModel(), StepCostModel()
    for tokens in (1, 5, 2, 8, 3):
        costs.observe(tokens, 0.020 + 0.001 * tokens)
        passes.observe(tokens, 0.008 + 0.0005 * tokens)
    assert costs.draft_cost(1, passes) == pytest.approx((0.001 + 0.0085) / 0.021)
    assert costs.draft_cost(64, passes) == pytest.approx((0.064 + 0.040) / 0.084)
    assert costs.draft_cost(1, StepCostModel()) == costs.draft_cost(1)  # no passes fitted yet


def _decoding_on_a_loop() -> Sequence:
    """A decoding sequence whose prompt repeats 1..5: prompt lookup always finds what follows."""
    seq = Sequence("loop", [1, 2, 3, 4, 5] * 4, SamplingParams(max_new_tokens=64))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_the_speculator_drafts_while_the_step_line_says_drafts_pay() -> None:
    speculator = Speculator(SpeculativeConfig(method="ngram", num_tokens=4), max_model_len=1024)
    seq = _decoding_on_a_loop()
    assert speculator.propose([seq]) == {"loop": [1, 2, 3, 4]}  # no fit yet: draft, and measure
    for tokens in (1, 5, 2, 8, 3):
        speculator.observe_step(tokens, 0.020 + 0.001 * tokens)
    assert speculator.propose([seq]) == {"loop": [1, 2, 3, 4]}  # c = 1/21: all four pay
    for tokens in (1, 5, 2, 8) * (COST_WINDOW // 4):  # the window now holds the new line alone
        speculator.observe_step(tokens, 0.001 + 0.010 * tokens)
    assert speculator.propose([seq]) == {}  # c = 10/11 > the prior's 1/2: none pays


def test_draft_length_takes_drafts_while_their_chance_pays_their_cost() -> None:
    assert draft_length(0.5, 0.05, most=8) == 4  # 0.5**4 = 0.0625 >= 0.05 > 0.5**5
    assert draft_length(0.9, 0.76, most=8) == 2
    assert draft_length(0.99, 0.0, most=3) == 3
    assert draft_length(0.5, 0.9, most=8) == 0


def test_speculative_config_names_the_fix() -> None:
    assert not EngineConfig().speculative.enabled
    with pytest.raises(pydantic.ValidationError, match="SPECULATIVE__METHOD"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(pydantic.ValidationError, match="must be >= ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    assert EngineConfig.model_validate({"speculative": {"method": "ngram"}}).speculative.enabled


def _oracle(reference: dict[str, list[int]], wrong_every: int) -> dict[str, list[int]]:
    """Proposals from the reference outputs, with every wrong_every-th draft corrupted."""
    return {
        rid: [t + 1 if (i + 1) % wrong_every == 0 else t for i, t in enumerate(out)]
        for rid, out in reference.items()
    }


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-steps", "alternating-steps"])
def test_drafts_change_no_output_and_rejected_blocks_go_back(mixed: bool) -> None:
    seqs = [make_seq(f"r{i}", 3 + 5 * i, max_new=30) for i in range(4)]
    reference = run_all(make_scheduler(block_size=4), seqs)
    sched = make_scheduler(block_size=4, mixed_batches=mixed)
    model = FakeModel(sched.block_manager.num_blocks, 4)
    fresh = [make_seq(f"r{i}", 3 + 5 * i, max_new=30) for i in range(4)]
    for seq in fresh:
        sched.add(seq)
    guesses = _oracle(reference, wrong_every=4)
    while sched.has_work:
        proposals = {s.request_id: guesses[s.request_id][s.num_output_tokens :][:5] for s in sched.running}
        batch, _ = step(sched, model, proposals)
        assert sum(e.num_tokens for e in batch.entries) <= sched.config.max_num_batched_tokens
        for seq in sched.running:
            # Exact tables: the blocks its computed tokens fill, never a rejected draft's block.
            assert len(seq.block_table) == sched.block_manager.blocks_needed(seq.num_computed_tokens)
    assert {s.request_id: s.output_ids for s in fresh} == reference
    stats = sched.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_steps < run_steps(reference)
    assert sched.block_manager.num_used_blocks == 0


def run_steps(reference: dict[str, list[int]]) -> int:
    """Steps a run without drafts takes at least: one per token of the longest output."""
    return max(len(out) for out in reference.values())


@pytest.mark.parametrize(("budget", "expected"), [(512, {"a": 7, "b": 3}), (8, {"a": 6, "b": 0})])
def test_drafts_take_only_budget_and_blocks_left_after_every_plain_decode(
    budget: int, expected: dict[str, int]
) -> None:
    """Two prompts of 4 tokens in blocks of 4, 5 blocks: after both decode, one block is free. With
    budget to spare, a (the more urgent) drafts into it and b only into its own block's free slots;
    with 8 tokens a step, a's drafts take the 6 left after the two decodes. Nobody is preempted."""
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=budget)
    model = FakeModel(5, 4)
    sched.add(make_seq("a", 4, max_new=20))
    sched.add(make_seq("b", 4, max_new=20, arrival=1))
    step(sched, model)  # both prefills
    batch, _ = step(sched, model, {"a": [11] * 8, "b": [12] * 8})
    assert sched.stats.num_preemptions == 0
    assert batch.num_batched_tokens <= budget
    assert {e.seq.request_id: e.num_drafts for e in batch.entries} == expected


def test_a_stop_inside_accepted_drafts_ends_the_output_there() -> None:
    reference = run_all(make_scheduler(), [make_seq("a", 6, max_new=20)])["a"]
    stop = reference[5]
    cut = reference.index(stop) + 1
    sched = make_scheduler()
    model = FakeModel(256, 16)
    seq = make_seq("a", 6, max_new=20, stop_token_ids=(stop,))
    sched.add(seq)
    outputs = []
    while sched.has_work:
        _, out = step(sched, model, {"a": reference[seq.num_output_tokens :][:7]})
        outputs.extend(out)
    assert seq.output_ids == reference[:cut]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert sum(len(o.new_token_ids) for o in outputs) == cut
