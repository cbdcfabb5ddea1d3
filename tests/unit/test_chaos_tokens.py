"""The chaos soak's token check (tests/reliability/chaos_tokens.py) against known sequences: exact
answers pass, a token lost or repeated across a failover fails, a near-tie flip is excused by the
parity rule and a wider flip is not, and a part under the margin rule fails only beyond its margin;
the references come from deterministic fake models."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

    def deficits(self, sequence: Sequence[int], start: int) -> list[float]:
        rows = [self.next_token_logits(sequence[:position]) for position in range(start, len(sequence))]
        return [max(row) - row[token] for row, token in zip(rows, sequence[start:], strict=True)]


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


def test_a_margin_part_passes_within_its_margin_and_fails_beyond_it() -> None:
    margin = {"p": Rule(tie_gap=1e-3), "f": Rule(margin=6.0)}
    tokens = _failover(4, 10)
    near = FakeModel(11, ties={tuple(PROMPT + tokens[:6]): ((tokens[6] + 1) % VOCAB, 4.0)})
    # The runner-up (4 logits down), or a token 10 logits down, each followed by its greedy continuation.
    swapped, garbage = ([*tokens[:6], (tokens[6] + step) % VOCAB] for step in (1, 2))
    swapped += FALLBACK.greedy([PROMPT + swapped], [3])[0]
    garbage += FALLBACK.greedy([PROMPT + garbage], [3])[0]
    report = _check(
        [
            Answer(PROMPT, tokens, 10, 4, "f"),
            Answer(PROMPT, swapped, 10, 4, "f"),
            Answer(PROMPT, garbage, 10, 4, "f"),
        ],
        fallback=near,
        rules=margin,
    )
    assert report.by_margin == 3 and report.exact == 0
    assert report.worst_deficit == 10.0
    assert len(report.failures) == 1 and "answer 2" in report.failures[0]


def test_the_head_stays_exact_when_the_tail_is_checked_by_margin() -> None:
    margin = {"p": Rule(tie_gap=1e-3), "f": Rule(margin=100.0)}
    tokens = _failover(4, 10)
    tokens[1] = (tokens[1] + 3) % VOCAB
    report = _check(
        [Answer(PROMPT, tokens, 10, 4, "f"), Answer(PROMPT, tokens[:9], 10, 4, "f")], rules=margin
    )
    assert len(report.failures) == 2
    assert "head" in report.failures[0] and "length" in report.failures[1]
