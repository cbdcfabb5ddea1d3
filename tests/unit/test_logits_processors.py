"""Tests of the OpenAI/vLLM processors (logit_bias, presence/frequency, min_tokens, min_p, typical_p):
each against transformers' processor where it has one (a direct formula where it has none), all of
them together in the documented order, and their parameter validation.
"""

from __future__ import annotations

import random
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from services.worker.engine.logits_processors import (
    apply_logit_bias,
    apply_output_penalties,
    banned_until_min_tokens,
)
from services.worker.engine.sampler import Sampler, SampleRow
from strata.sampling import InvalidRequestError, SamplingParams

EOS = (0, 7)


def reference_output_penalties(logits: torch.Tensor, output: list[int], p: SamplingParams) -> torch.Tensor:
    """OpenAI's and vLLM's definition, one token at a time: logit - presence * seen - frequency * count."""
    out = logits.clone()
    for token in set(output):
        out[token] -= p.presence_penalty + p.frequency_penalty * output.count(token)
    return out


def reference_allowed(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """transformers' processors (and the direct formula for presence/frequency) in the documented order."""
    history = prompt + output
    ids = torch.tensor([history], dtype=torch.long).reshape(1, len(history))
    scores = logits[None, :].clone()
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.no_repeat_ngram_size:
        scores = NoRepeatNGramLogitsProcessor(p.no_repeat_ngram_size)(ids, scores)
    scores = reference_output_penalties(scores[0], output, p)[None, :]
    if p.min_tokens:
        stops = sorted({*EOS, *p.stop_token_ids})
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p:
        scores = MinPLogitsWarper(p.min_p)(cast("torch.LongTensor", ids), scores)
    if p.typical_p < 1.0:
        scores = TypicalLogitsWarper(p.typical_p)(cast("torch.LongTensor", ids), scores)
    allowed: torch.Tensor = (scores > float("-inf"))[0]
    return allowed


def row_for(p: SamplingParams, prompt: list[int], output: list[int], seed: int = 0) -> SampleRow:
    return SampleRow(
        p,
        seed=seed,
        position=len(output),
        history=prompt + output,
        output=output,
        banned=banned_until_min_tokens(p, len(output), EOS),
    )


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    biases = [((3, 5.0), (49, -100.0)), (), ((0, 0.25), (1, 100.0), (2, -3.5))]
    x = logits.clone()
    apply_logit_bias(x, [SamplingParams(logit_bias=b) for b in biases])
    for i, bias in enumerate(biases):
        expected = logits[i : i + 1].clone()
        if bias:
            expected = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias])(torch.zeros(1, 1), expected)
        assert torch.equal(x[i], expected[0])


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_follow_the_openai_formula(presence: float, frequency: float) -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 3
    outputs = [[1, 1, 1, 5, 39], [], [2, 3, 2, 3, 2, 0]]
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 3
    divisor = torch.tensor([1.0, 2.0, 0.5])
    x = logits / divisor[:, None]
    apply_output_penalties(x, params, outputs, [(), (), ()], divisor)
    for i, output in enumerate(outputs):
        expected = reference_output_penalties(logits[i], output, params[i]) / divisor[i]
        torch.testing.assert_close(x[i], expected, rtol=0, atol=1e-6)
    # The prompt is not the output: nothing outside the generated ids moved.
    assert torch.equal(x[1], logits[1] / divisor[1])


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    p = SamplingParams(min_tokens=3, stop_token_ids=(11,), max_new_tokens=10)
    assert banned_until_min_tokens(p, 0, EOS) == (0, 7, 11)
    assert banned_until_min_tokens(p, 2, EOS) == (0, 7, 11)
    assert banned_until_min_tokens(p, 3, EOS) == ()
    assert banned_until_min_tokens(SamplingParams(min_tokens=3, ignore_eos=True), 0, EOS) == ()
    # EOS is the argmax: greedy takes the best token min_tokens allows, then EOS once reached.
    logits = torch.zeros(2, 20)
    logits[:, 7] = 10.0
    logits[:, 11] = 9.0
    logits[:, 4] = 8.0
    rows = [row_for(p, [1, 2], [5, 6]), row_for(p, [1, 2], [5, 6, 8])]
    assert Sampler()(logits, rows) == [4, 7]
    sampled = SamplingParams(temperature=1.0, min_tokens=5, max_new_tokens=10)
    draws = Sampler()(logits[:1].expand(64, -1), [row_for(sampled, [1], [], seed=s) for s in range(64)])
    assert not {0, 7} & set(draws)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_min_p_allowed_set_equals_transformers(min_p: float, scale: float) -> None:
    # scale 0.3 is flat: the allowed set is wider than the first candidate lists and the wide-set cutoff.
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(3)) * scale
    p = SamplingParams(temperature=1.0, min_p=min_p)
    rows = [row_for(p, [1], []) for _ in range(6)]
    ours = Sampler(head_size=8, wide_set=64).allowed(logits, rows)
    for i in range(6):
        assert torch.equal(ours[i], reference_allowed(logits[i], [1], [], p))
    tokens = Sampler(head_size=8, wide_set=64)(logits, rows)
    assert all(bool(ours[i, t]) for i, t in enumerate(tokens))


@pytest.mark.parametrize("typical_p", [0.05, 0.3, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_typical_p_allowed_set_equals_transformers(typical_p: float, scale: float) -> None:
    """The kept set, and every draw inside it, over flat and peaked rows; seeds and positions vary, so
    the draws cover the set's several tokens."""
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(5)) * scale
    p = SamplingParams(temperature=0.7, typical_p=typical_p)
    rows = [row_for(p, [1], [2] * i, seed=i) for i in range(6)]
    ours = Sampler().allowed(logits, rows)
    for i in range(6):
        assert torch.equal(ours[i], reference_allowed(logits[i], [1], [2] * i, p))
    tokens = Sampler()(logits, rows)
    assert all(bool(ours[i, t]) for i, t in enumerate(tokens))


def test_all_processors_together_match_the_reference_in_order() -> None:
    rng = random.Random(4)
    vocab = 300
    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(4)) * 2
    rows = []
    for i in range(40):
        params = SamplingParams(
            max_new_tokens=20,
            temperature=rng.choice([0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 10, 120]),
            top_p=rng.choice([1.0, 0.6, 0.95]),
            min_p=rng.choice([0.0, 0.02, 0.2]),
            typical_p=rng.choice([1.0, 1.0, 0.5, 0.9]),
            repetition_penalty=rng.choice([1.0, 1.3]),
            no_repeat_ngram_size=rng.choice([0, 2]),
            presence_penalty=rng.choice([0.0, 1.0, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.4, -1.0]),
            logit_bias=tuple((rng.randrange(vocab), rng.uniform(-100, 100)) for _ in range(rng.randrange(4))),
            min_tokens=rng.choice([0, 4]),
            stop_token_ids=rng.choice([(), (3, 9)]),
        )
        prompt = [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(30) for _ in range(rng.randrange(0, 8))]
        rows.append((prompt, output, row_for(params, prompt, output, seed=i)))
    ours = Sampler(head_size=8).allowed(logits, [r for _, _, r in rows])
    for i, (prompt, output, row) in enumerate(rows):
        assert torch.equal(ours[i], reference_allowed(logits[i], prompt, output, row.params)), row


def test_greedy_rows_with_processors_take_the_processed_argmax() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(3, -1)
    rows = [
        row_for(SamplingParams(logit_bias=((3, 5.0),)), [1], []),
        row_for(SamplingParams(presence_penalty=2.0, frequency_penalty=0.0), [1], [0]),
        row_for(SamplingParams(), [1], [0]),
    ]
    sampler = Sampler()
    assert sampler(logits, rows) == [3, 1, 0]
    assert sampler.stats.noise_values == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.01), "frequency_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(typical_p=0.0), "typical_p"),
        (SamplingParams(typical_p=1.5), "typical_p"),
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias[3]"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(min_tokens=65), "min_tokens"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_out_of_range_processor_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        params.validate(4, 1000)
    assert raised.value.field == field
    SamplingParams(
        presence_penalty=2.0, frequency_penalty=-2.0, min_p=1.0, logit_bias=((3, -100.0),), min_tokens=64
    ).validate(4, 1000)
