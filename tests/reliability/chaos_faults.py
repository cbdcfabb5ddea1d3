"""Faults a failover could cause, made in right answers, to show that the chaos soak's check catches them.

`inject` takes right answers that failed over and makes, at each one's failover point, a repeated
token (the last head token sent twice), a dropped one (the first tail token lost), a tail generated
from a context one token short (the fallback never saw the last head token) and a replaced one (the
first tail token swapped for the fallback's second choice there, which a check within a logit margin
of the top pick would let through). The soak checks the faulty answers with chaos_tokens.check_answers
and reports how many were caught. This module must not start a service nor decide what a test
asserts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.reliability.chaos_tokens import Answer, greedy_of, near_tie

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tests.reliability.chaos_tokens import ReferenceModel

REPEATED = "repeated"
"""The last head token sent twice (the tail one token later, its last token cut)."""
DROPPED = "dropped"
"""The first tail token lost (the rest one token earlier, its last token sent twice to keep the length)."""
SHIFTED = "shifted"
"""The tail generated from a context one token short: the fallback never saw the last head token."""
REPLACED = "replaced"
"""The first tail token replaced by the fallback's second choice there, the rest its continuation."""
INJECTED = (REPEATED, DROPPED, SHIFTED, REPLACED)


def inject(
    answers: Sequence[Answer], fallback: ReferenceModel, tie_gap: float
) -> list[tuple[str, int, Answer]]:
    """Each answer (a right one that failed over) with each fault of INJECTED at its failover, as
    (fault, index of the answer, the faulty answer). Left out: a fault that changes none of an
    answer's tokens (a tail that repeats one token, say), and one whose first changed token is the
    fallback's other choice of a near tie there (within `tie_gap`), which the parity rule rightly
    cannot tell from rounding."""
    heads = [a.tokens[: a.failover_at] for a in answers]
    tails = [a.tokens[a.failover_at :] for a in answers]
    lengths = [len(tail) for tail in tails]
    shifted = greedy_of(
        fallback, [a.prompt_ids + h[:-1] for a, h in zip(answers, heads, strict=True)], lengths
    )
    seconds = [
        _second(fallback.next_token_logits(a.prompt_ids + h)) for a, h in zip(answers, heads, strict=True)
    ]
    replaced = [[*a.prompt_ids, *h, t] for a, h, t in zip(answers, heads, seconds, strict=True)]
    rests = greedy_of(fallback, replaced, [n - 1 for n in lengths])
    faulty = {
        REPEATED: [[*h, h[-1], *t[:-1]] for h, t in zip(heads, tails, strict=True)],
        DROPPED: [[*h, *t[1:], t[-1]] for h, t in zip(heads, tails, strict=True)],
        SHIFTED: [h + t for h, t in zip(heads, shifted, strict=True)],
        REPLACED: [[*h, t, *r] for h, t, r in zip(heads, seconds, rests, strict=True)],
    }
    made = [
        (kind, i, Answer(a.prompt_ids, tokens, a.expected_len, a.failover_at, a.model))
        for kind in INJECTED
        for i, (a, tokens) in enumerate(zip(answers, faulty[kind], strict=True))
        if tokens != a.tokens
    ]
    return [
        (kind, i, bad)
        for kind, i, bad in made
        if not _near_tie_at_first_change(answers[i], bad, fallback, tie_gap)
    ]


def _second(logits: Sequence[float]) -> int:
    """The token with the second largest logit."""
    return sorted(range(len(logits)), key=lambda t: logits[t], reverse=True)[1]


def _near_tie_at_first_change(right: Answer, faulty: Answer, model: ReferenceModel, tie_gap: float) -> bool:
    position = next(p for p, (a, b) in enumerate(zip(right.tokens, faulty.tokens, strict=True)) if a != b)
    logits = model.next_token_logits(right.prompt_ids + right.tokens[:position])
    return near_tie(logits, faulty.tokens[position], right.tokens[position], tie_gap)
