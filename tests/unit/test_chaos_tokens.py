"""The chaos soak's token check (tests/reliability/chaos_tokens.py) against known sequences: exact
answers pass, a token lost or repeated across a failover fails, a near-tie flip is excused by the
parity rule (and what follows it is still compared), a wider flip is not, every token is counted as
compared, and each failover fault chaos_faults.py injects is made and caught; the references come from
deterministic fake models (tests/unit/test_chaos_injected.py does the same on real answers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.reliability.chaos_faults import INJECTED, inject
from tests.reliability.chaos_tokens import (
    HEAD,
    LENGTH,
    TAIL,
    Answer,
    CheckReport,
    Divergence,
    Rule,
    check_answers,
    divergence,
    near_tie,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

VOCAB = 50
PROMPT = [3, 1, 4, 1, 5]


class FakeModel:
    """Greedy next token = (sum(context) * mul + len(context)) % VOCAB; optional near ties."""

    def __init__(self, mul: int, ties: dict[tuple[int, ...], tuple[int, float]] | None = None) -> None:
        self.mul = mul
        self.ties = ties or {}
        """context -> (runner-up token, its logit gap below the top) where a context has a close second."""

    def next_token(self, context: Sequence[int]) -> int:
        return (sum(context) * self.mul + len(context)) % VOCAB

    def greedy(self, contexts: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]:
        outputs = []
        for context, length in zip(contexts, lengths, strict=True):
            sequence = list(context)
            for _ in range(length):
                sequence.append(self.next_token(sequence))
            outputs.append(sequence[len(context) :])
        return outputs

    def next_token_logits(self, context: Sequence[int]) -> list[float]:
        logits = [0.0] * VOCAB
        logits[self.next_token(context)] = 10.0
        runner_up, gap = self.ties.get(tuple(context), ((self.next_token(context) + 1) % VOCAB, 5.0))
        logits[runner_up] = 10.0 - gap
        return logits


PRIMARY, FALLBACK = FakeModel(7), FakeModel(11)
EXACT = {"p": Rule(tie_gap=1e-3), "f": Rule(tie_gap=1e-3)}


def _check(
    answers: list[Answer],
    primary: FakeModel = PRIMARY,
    fallback: FakeModel = FALLBACK,
    rules: dict[str, Rule] = EXACT,
) -> CheckReport:
    return check_answers(answers, {"p": primary, "f": fallback}, "p", "f", rules)


def _failover(head_len: int, total: int) -> list[int]:
    head = PRIMARY.greedy([PROMPT], [head_len])[0]
    return head + FALLBACK.greedy([PROMPT + head], [total - head_len])[0]


def test_divergence_is_none_for_exact_answers_and_names_the_first_difference() -> None:
    ref = [1, 2, 3, 4]
    assert divergence([1, 2, 3, 4], 4, 0, ref, []) is None
    assert divergence([1, 2, 9, 4], 4, 0, ref, []) == Divergence(HEAD, 2, 9, 3)
    assert divergence([1, 2, 7, 8], 4, 2, ref, [7, 8]) is None
    assert divergence([1, 2, 7, 9], 4, 2, ref, [7, 8]) == Divergence(TAIL, 3, 9, 8)
    assert divergence([1, 9, 7, 8], 4, 2, ref, [7, 8], parts=[TAIL]) is None
    assert divergence([1, 9, 7, 8], 4, 2, ref, [7, 8], parts=[]) is None
    assert divergence([1, 9, 7], 4, 2, ref, [7, 8], parts=[]) == Divergence(LENGTH, 3, 3, 4)
    assert divergence([1, 2, 3], 4, 0, ref, []) == Divergence(LENGTH, 3, 3, 4)
    assert divergence([1, 2, 3, 4], 4, 0, [1, 2], []) == Divergence(HEAD, 2, 3, -1)
    assert divergence([1, 2, 3, 4], 4, 5, ref, []) == Divergence(LENGTH, 5, 5, 4)


def test_near_tie_needs_the_two_tokens_on_top_and_within_the_gap() -> None:
    logits = [0.0, 5.0, 4.9995, 1.0]
    assert near_tie(logits, got=2, expected=1, tie_gap=1e-3)
    assert not near_tie(logits, got=2, expected=1, tie_gap=1e-4)
    assert not near_tie(logits, got=3, expected=1, tie_gap=10.0)  # not the runner-up
    assert not near_tie(logits, got=1, expected=1, tie_gap=1e-3)
    assert not near_tie(logits, got=2, expected=-1, tie_gap=1e-3)


def test_exact_answers_pass_on_either_model_and_across_a_failover() -> None:
    answers = [
        Answer(PROMPT, PRIMARY.greedy([PROMPT], [12])[0], 12, 0, "p"),
        Answer(PROMPT, PRIMARY.greedy([PROMPT], [5])[0], 5, 0, "p"),  # a prefix of the longest reference
        Answer(PROMPT, FALLBACK.greedy([PROMPT], [8])[0], 8, 0, "f"),
        Answer(PROMPT, _failover(4, 12), 12, 4, "f"),
        Answer(PROMPT, _failover(1, 3), 3, 1, "f"),
    ]
    report = _check(answers)
    assert report.failures == [] and report.excused == [] and report.exact == 5


def test_a_token_lost_or_repeated_across_the_failover_fails() -> None:
    tokens = _failover(4, 13)
    lost = tokens[:4] + tokens[5:]  # the fallback's first token dropped
    repeated = [*tokens[:4], tokens[3], *tokens[4:12]]  # the last primary token sent twice
    report = _check([Answer(PROMPT, lost, 12, 4, "f"), Answer(PROMPT, repeated, 13, 4, "f")])
    assert len(report.failures) == 2 and report.exact == 0
    assert "tail" in report.failures[0] and "position=4" in report.failures[0]


def test_a_head_that_is_not_the_primarys_output_fails() -> None:
    tokens = _failover(4, 10)
    tokens[2] = (tokens[2] + 3) % VOCAB
    report = _check([Answer(PROMPT, tokens, 10, 4, "f")])
    assert len(report.failures) == 1 and "head" in report.failures[0]


def test_wrong_lengths_and_unexpected_models_fail() -> None:
    short = PRIMARY.greedy([PROMPT], [6])[0]
    report = _check(
        [
            Answer(PROMPT, short, 7, 0, "p"),
            Answer(PROMPT, short, 6, 0, "other"),
            Answer(PROMPT, short, 6, 2, "p"),  # a failover point on the primary itself
        ]
    )
    assert len(report.failures) == 3 and report.exact == 0


def test_a_flip_at_a_near_tie_is_excused_and_the_tail_is_still_checked() -> None:
    head = PRIMARY.greedy([PROMPT], [4])[0]
    runner_up = (head[2] + 9) % VOCAB
    flipped_head = [*head[:2], runner_up, PRIMARY.next_token([*PROMPT, *head[:2], runner_up])]
    primary = FakeModel(7, ties={tuple(PROMPT + head[:2]): (runner_up, 5e-4)})
    tail = FALLBACK.greedy([PROMPT + flipped_head], [6])[0]
    good = Answer(PROMPT, flipped_head + tail, 10, 4, "f")
    bad_tail = Answer(PROMPT, flipped_head + tail[:1] + tail[2:] + [0], 10, 4, "f")
    report = _check([good, bad_tail], primary=primary)
    assert len(report.excused) == 2 and report.exact == 0
    assert len(report.failures) == 1 and "tail" in report.failures[0]


def test_a_flip_wider_than_the_tie_gap_fails() -> None:
    head = PRIMARY.greedy([PROMPT], [4])[0]
    runner_up = (head[2] + 9) % VOCAB
    primary = FakeModel(7, ties={tuple(PROMPT + head[:2]): (runner_up, 0.5)})
    flipped = [*head[:2], runner_up, 0]
    report = _check([Answer(PROMPT, flipped, 4, 0, "p")], primary=primary)
    assert len(report.failures) == 1 and report.excused == []


def test_after_an_excused_flip_the_rest_of_the_part_is_still_compared() -> None:
    head = PRIMARY.greedy([PROMPT], [6])[0]
    runner_up = (head[2] + 9) % VOCAB
    primary = FakeModel(7, ties={tuple(PROMPT + head[:2]): (runner_up, 5e-4)})
    flipped = [*head[:2], runner_up, *PRIMARY.greedy([[*PROMPT, *head[:2], runner_up]], [3])[0]]
    wrong_later = [*flipped[:4], (flipped[4] + 1) % VOCAB, flipped[5]]
    report = _check([Answer(PROMPT, flipped, 6, 0, "p"), Answer(PROMPT, wrong_later, 6, 0, "p")], primary)
    assert len(report.excused) == 2 and report.failed == [1]
    assert "position=4" in report.failures[0]
    assert report.tokens_checked == 6 and report.tokens_unverified == 0 and report.answers_unverified == 0


def test_every_token_of_the_answers_that_pass_is_counted_as_compared() -> None:
    answers = [
        Answer(PROMPT, _failover(4, 12), 12, 4, "f"),
        Answer(PROMPT, PRIMARY.greedy([PROMPT], [5])[0], 5, 0, "p"),
    ]
    report = _check(answers)
    assert report.tokens_checked == 17 and report.tokens_unverified == 0 and report.failed == []


def test_each_injected_failover_fault_changes_the_answer_and_is_caught() -> None:
    answers = [Answer(PROMPT, _failover(k, 10), 10, k, "f") for k in (1, 4, 9)]
    assert _check(answers).failed == []
    injected = inject(answers, FALLBACK, tie_gap=1e-3)
    assert {kind for kind, _, _ in injected} == set(INJECTED)
    for kind, i, faulty in injected:
        assert faulty.tokens != answers[i].tokens and len(faulty.tokens) == 10, kind
        assert faulty.tokens[: faulty.failover_at] == answers[i].tokens[: answers[i].failover_at]
    report = _check([faulty for _, _, faulty in injected])
    assert report.failed == list(range(len(injected)))


def test_a_replacement_within_the_tie_gap_is_not_injected() -> None:
    tokens = _failover(4, 10)
    runner_up = (tokens[4] + 1) % VOCAB
    near = FakeModel(11, ties={tuple(PROMPT + tokens[:4]): (runner_up, 5e-4)})
    injected = inject([Answer(PROMPT, tokens, 10, 4, "f")], near, tie_gap=1e-3)
    assert "replaced" not in {kind for kind, _, _ in injected}
