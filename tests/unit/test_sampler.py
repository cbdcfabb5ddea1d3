"""Tests of the batched sampler: transformers parity of every filter, seeded reproducibility across
batch compositions, the distribution of draws, the cost rules (no noise for greedy), and bad logits.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.worker.engine.noise import gumbel, row_keys, uniform
from services.worker.engine.penalties import apply_penalties
from services.worker.engine.sampler import Sampler, SampleRow
from strata.sampling import SamplingParams
from tests.sampling_cases import CPU, TARGETS


def rows_of(params: SamplingParams, n: int, seed: int = 7, position: int = 0, history=()) -> list[SampleRow]:
    return [SampleRow(params=params, seed=seed + i, position=position, history=history) for i in range(n)]


def hf_allowed(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """transformers' allowed set for one row: its processors in generate()'s order, then > -inf."""
    ids = torch.tensor([history], dtype=torch.long) if history else torch.zeros((1, 0), dtype=torch.long)
    scores = logits[None, :].clone()
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if params.no_repeat_ngram_size:
        scores = NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size)(ids, scores)
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    allowed: torch.Tensor = (scores > float("-inf"))[0]
    return allowed


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token of probability 0"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --- greedy and the cost rules -------------------------------------------------------------------


def test_greedy_is_argmax_and_generates_no_noise_or_softmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    assert sampler(logits, rows_of(SamplingParams(), 16)) == logits.argmax(-1).tolist()
    assert sampler.stats.noise_values == 0
    assert sampler.stats.normalized_rows == 0
    assert sampler.stats.candidate_rounds == 0


def test_greedy_with_penalties_still_draws_no_noise() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    history = [int(t) for t in logits.argmax(-1)]
    sampler = Sampler()
    params = SamplingParams(repetition_penalty=100.0, no_repeat_ngram_size=3)
    tokens = sampler(logits, rows_of(params, 4, history=history))
    # The penalty pushes every row's argmax (all in the history) down: none of them wins any more.
    assert all(t not in history or logits[i, t] < 0 for i, t in enumerate(tokens))
    assert sampler.stats.noise_values == 0
    assert sampler.stats.normalized_rows == 0


def test_mixed_batch_makes_noise_only_for_sampled_rows_and_never_for_the_whole_vocabulary() -> None:
    vocab = 5000
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(2)) * 4
    rows = rows_of(SamplingParams(), 6) + rows_of(SamplingParams(temperature=0.8, top_p=0.9), 2)
    sampler = Sampler()
    tokens = sampler(logits, rows)
    assert tokens[:6] == logits[:6].argmax(-1).tolist()
    assert 0 < sampler.stats.noise_values < 2 * vocab


def test_low_temperature_behaves_like_greedy() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1)
    logits[torch.arange(64), best] += 0.05  # a clear winner: 50 nats ahead at this temperature
    for position in range(3):
        tokens = Sampler()(logits, rows_of(SamplingParams(temperature=1e-3), 64, position=position))
        assert tokens == best.tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(32, 400, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.5, top_k=1)
    assert Sampler()(logits, rows_of(params, 32)) == logits.argmax(-1).tolist()


# --- seeded reproducibility ----------------------------------------------------------------------
# (the parameter sets, TARGETS, are in tests/sampling_cases.py, shared with the CUDA tests)


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 2.0]),
        top_k=rng.choice([0, 0, 5, 100]),
        top_p=rng.choice([1.0, 0.5, 0.95]),
        repetition_penalty=rng.choice([1.0, 1.2]),
    )


def test_same_seed_and_position_give_the_same_token_in_any_batch() -> None:
    vocab = 1000
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    history = [rng.randrange(vocab) for _ in range(40)]
    batch_sampler = Sampler(head_size=16, wide_set=200)
    for position in range(6):
        target_logits = torch.randn(len(TARGETS), vocab, generator=gen) * 2
        targets = [
            SampleRow(p, seed=100 + i, position=position, history=history) for i, p in enumerate(TARGETS)
        ]
        alone = [
            Sampler(head_size=16, wide_set=200)(target_logits[i : i + 1], [row])[0]
            for i, row in enumerate(targets)
        ]
        others = [
            SampleRow(random_params(rng), seed=rng.randrange(2**40), position=rng.randrange(50))
            for _ in range(32)
        ]
        entries: list[tuple[torch.Tensor, SampleRow, int | None]]
        entries = [(target_logits[i], row, i) for i, row in enumerate(targets)]
        entries += [(torch.randn(vocab, generator=gen) * 3, row, None) for row in others]
        rng.shuffle(entries)
        tokens = batch_sampler(torch.stack([e[0] for e in entries]), [e[1] for e in entries])
        in_batch = {e[2]: t for e, t in zip(entries, tokens, strict=True) if e[2] is not None}
        assert [in_batch[i] for i in range(len(TARGETS))] == alone
    # The batches above went through every drawing path, so all of them are batch-invariant.
    assert batch_sampler.stats.tail_draws > 0
    assert batch_sampler.stats.wide_draws > 0
    assert batch_sampler.stats.candidate_rounds > 6


def test_different_seeds_and_positions_give_different_draws() -> None:
    flat = torch.zeros(200, 1000)
    params = SamplingParams(temperature=1.0)
    by_seed = Sampler()(flat, [SampleRow(params, seed=s, position=0) for s in range(200)])
    by_position = Sampler()(flat, [SampleRow(params, seed=3, position=p) for p in range(200)])
    # 200 uniform draws over 1000 tokens repeat about 20 times; a seed or position ignored gives 1.
    assert len(set(by_seed)) > 150
    assert len(set(by_position)) > 150
    assert by_seed != by_position


def test_noise_is_a_pure_function_of_its_coordinates() -> None:
    keys = row_keys([1, 2**63 - 1, 1], [0, 5, 0], CPU)
    columns = torch.arange(10_000)[None, :]
    u = uniform(keys, columns)
    assert torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[1])
    assert float(u.min()) > 0.0
    assert float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert torch.isfinite(gumbel(keys, columns)).all()
    # The same column read alone gives the same value: no dependence on the rest of the block.
    assert torch.equal(uniform(keys[1:2], torch.tensor([[1234]])), u[1:2, 1234:1235])


# --- the distribution of draws -------------------------------------------------------------------

# Critical values of chi-square with p about 1e-6 for the degrees of freedom used below: a correct
# sampler never crosses them, while a wrong distribution (say uniform) lands in the thousands.
DRAWS = 20_000


def draws(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> list[int]:
    rows = [SampleRow(params, seed=42, position=p) for p in range(DRAWS)]
    return sampler(logits.expand(DRAWS, -1), rows)


@pytest.mark.parametrize(
    ("name", "sampler", "vocab", "params", "kept"),
    [
        ("gumbel over the head", Sampler(), 8, SamplingParams(temperature=0.8), 8),
        ("head and tail", Sampler(head_size=4), 40, SamplingParams(temperature=1.5), 40),
        ("top-k gumbel", Sampler(), 40, SamplingParams(temperature=1.0, top_k=6), 6),
        ("top-k wide inverse cdf", Sampler(wide_set=3), 40, SamplingParams(temperature=1.0, top_k=6), 6),
    ],
)
def test_draws_follow_softmax_of_the_allowed_set(
    name: str, sampler: Sampler, vocab: int, params: SamplingParams, kept: int
) -> None:
    logits = torch.linspace(2.0, -2.0, vocab)[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(9))
    ]
    scaled = logits / params.temperature
    allowed = scaled >= scaled.topk(kept).values[-1]
    probs = torch.where(allowed, scaled, float("-inf")).softmax(-1)
    tokens = draws(sampler, logits, params)
    limit = {8: 40.0, 6: 36.0, 40: 110.0}[kept]
    assert chi_square(tokens, probs) < limit, name
    assert chi_square(tokens, allowed.double() / allowed.sum()) > 10 * limit, name


def test_typical_draws_follow_softmax_of_the_typical_set() -> None:
    """Locally typical sampling draws from the softmax over its kept set and nothing else: here the
    most likely token, whose surprisal is far below the row's entropy, is left out, which a top-p or
    min_p set never does."""
    from services.worker.engine.logits_processors import typical_keep

    logits = torch.cat([torch.tensor([3.0]), torch.linspace(1.2, -1.2, 39)])
    params = SamplingParams(temperature=1.0, typical_p=0.6)
    allowed = typical_keep(logits[None, :], torch.tensor([0.6]))[0]
    assert not allowed[0] and 3 < int(allowed.sum()) < 39
    probs = torch.where(allowed, logits, float("-inf")).softmax(-1)
    tokens = draws(Sampler(), logits, params)
    kept = int(allowed.sum())
    # chi-square's critical value at p about 1e-6: its degrees of freedom plus about 7 deviations.
    limit = (kept - 1) + 7 * (2 * (kept - 1)) ** 0.5
    assert chi_square(tokens, probs) < limit
    assert chi_square(tokens, allowed.double() / allowed.sum()) > 10 * limit


def test_head_and_tail_stages_are_both_used() -> None:
    sampler = Sampler(head_size=4)
    draws(sampler, torch.linspace(2.0, -2.0, 40), SamplingParams(temperature=1.5))
    assert 0.2 * DRAWS < sampler.stats.tail_draws < 0.9 * DRAWS


# --- transformers parity ----------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 5, 50, 499, 500, 10_000])
def test_top_k_allowed_set_matches_transformers(top_k: int) -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(top_k)) * 3
    params = SamplingParams(temperature=0.7, top_k=top_k)
    ours = Sampler(head_size=8).allowed(logits, rows_of(params, 6))
    for i in range(6):
        assert torch.equal(ours[i], hf_allowed(logits[i], [], params))


@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("head_size", [4, 64])
def test_top_p_allowed_set_matches_transformers(top_p: float, head_size: int) -> None:
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(int(top_p * 1000))) * 2
    params = SamplingParams(temperature=1.3, top_p=top_p)
    sampler = Sampler(head_size=head_size)
    ours = sampler.allowed(logits, rows_of(params, 6))
    for i in range(6):
        assert torch.equal(ours[i], hf_allowed(logits[i], [], params))
    if top_p == 1e-9:
        assert ours.sum(-1).tolist() == [1] * 6
        assert ours.float().argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_combined_processors_match_transformers_in_order() -> None:
    rng = random.Random(11)
    vocab = 300
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(11)) * 2
    rows = []
    for i in range(12):
        params = SamplingParams(
            temperature=rng.choice([0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 10, 120]),
            top_p=rng.choice([1.0, 0.6, 0.95]),
            repetition_penalty=rng.choice([1.0, 0.8, 1.4]),
            no_repeat_ngram_size=rng.choice([0, 1, 2, 3]),
        )
        history = [rng.randrange(30) for _ in range(rng.randrange(1, 60))]
        rows.append(SampleRow(params, seed=i, position=0, history=history))
    ours = Sampler(head_size=8).allowed(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(ours[i], hf_allowed(logits[i], list(row.history), row.params)), row


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(12))
    history = [[1, 2, 2, 50, 99], [0], list(range(0, 100, 3)) * 2]
    x = logits.clone()
    apply_penalties(x, history, [penalty] * 3, [0] * 3)
    for i in range(3):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([history[i]]), logits[i : i + 1].clone()
        )
        assert torch.equal(x[i], expected[0])


def test_repetition_penalty_edge_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = [[0, 1, 1]]
    for penalty, expected in [
        (1.0, [2.0, -2.0, 1.0, 0.5]),
        (2.0, [1.0, -4.0, 1.0, 0.5]),
        (0.5, [4.0, -1.0, 1.0, 0.5]),
    ]:
        x = logits.clone()
        apply_penalties(x, history, [penalty], [0])
        assert x[0].tolist() == expected
    greedy = SampleRow(SamplingParams(repetition_penalty=2.5), seed=0, position=0, history=[0])
    favour = SampleRow(SamplingParams(repetition_penalty=0.2), seed=0, position=0, history=[3])
    assert Sampler()(logits.expand(2, -1), [greedy, favour]) == [2, 3]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_matches_transformers(n: int) -> None:
    rng = random.Random(n)
    vocab = 20
    histories = [[rng.randrange(6) for _ in range(length)] for length in [0, 1, 2, 3, 5, 17, 60]]
    logits = torch.randn(len(histories), vocab, generator=torch.Generator().manual_seed(n))
    x = logits.clone()
    apply_penalties(x, histories, [1.0] * len(histories), [n] * len(histories))
    banned_any = False
    for i, history in enumerate(histories):
        ids = torch.tensor([history], dtype=torch.long).reshape(1, len(history))
        expected = NoRepeatNGramLogitsProcessor(n)(ids, logits[i : i + 1].clone())[0]
        assert torch.equal(x[i], expected)
        banned_any |= bool((expected == float("-inf")).any())
    assert banned_any


# --- bad logits ------------------------------------------------------------------------------------


def test_nan_and_infinite_logits_do_not_crash_and_fall_back_to_the_raw_argmax() -> None:
    vocab = 100
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(13))
    logits[0] = float("-inf")  # sampled, nothing finite at all
    logits[1] = float("-inf")  # greedy, nothing finite at all
    logits[2, ::2] = float("nan")  # sampled, half NaN: must never draw a NaN token
    logits[3, 17] = float("inf")  # sampled, one +inf: it takes all the mass
    logits[4, 7] = float("nan")  # greedy with a NaN: the NaN is not the argmax
    # Sampled row whose only finite tokens are all banned by no-repeat-ngram (size 1).
    logits[5] = float("-inf")
    logits[5, [3, 9]] = torch.tensor([1.0, 2.0])
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    rows = [
        SampleRow(sampled, 0, 0),
        SampleRow(SamplingParams(), 0, 0),
        SampleRow(SamplingParams(temperature=1.0), 0, 0),
        SampleRow(SamplingParams(temperature=0.5), 0, 0),
        SampleRow(SamplingParams(), 0, 0),
        SampleRow(SamplingParams(temperature=1.0, no_repeat_ngram_size=1), 0, 0, history=[3, 9]),
    ]
    for position in range(20):
        tokens = Sampler()(logits, [SampleRow(r.params, r.seed, position, r.history) for r in rows])
        assert tokens[0] == 0
        assert tokens[1] == 0
        assert tokens[2] % 2 == 1
        assert tokens[3] == 17
        assert tokens[4] == int(torch.nan_to_num(logits[4], nan=float("-inf")).argmax())
        assert tokens[5] == 9


def test_top_k_keeps_ties_beyond_the_candidate_list_like_transformers() -> None:
    # Rounded logits, as from a bf16 model, tie often: transformers keeps every token equal to the
    # k-th value, even when the ties run past the first candidate list.
    logits = torch.round(torch.randn(8, 400, generator=torch.Generator().manual_seed(14)) * 2)
    for top_k in (3, 10, 40):
        params = SamplingParams(temperature=1.0, top_k=top_k)
        ours = Sampler(head_size=4).allowed(logits, rows_of(params, 8))
        for i in range(8):
            assert torch.equal(ours[i], hf_allowed(logits[i], [], params))
        assert (ours.sum(-1) > top_k).any()
