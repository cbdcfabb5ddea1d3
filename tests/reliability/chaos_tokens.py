"""The chaos soak's token check: is a completed greedy answer what its models would generate?

An answer of `n` tokens that failed over at token `k` (GenerateResponse.failover_at_token; 0 when it
did not) is right when its first `k` tokens (its head) are the primary's greedy output for the
prompt and the rest (its tail) the fallback's greedy continuation of the prompt plus those `k`
tokens: a token lost or repeated across the failover shifts the tail and fails the check. An answer
one model served alone is all head, that model's greedy output.

Every token is compared with a reference, so every model the check is given must have greedy output
that does not depend on its batch (float32, bfloat16, int8-weight-only; not torch's dynamic int8,
whose activation scale is taken over the whole batch). `divergence` names the first token that
differs from the reference, and `near_tie` is the project's parity rule (tests/parity.py) for it: the
reference's top-2 logits on that context are the two tokens and lie within a tie gap, so float
rounding may flip them. After an excused flip the rest of that part is compared with the model's
greedy continuation of the answer's own tokens up to and including the flipped one, so no token goes
unverified; `CheckReport` counts the tokens compared and any that were not (chaos_faults.py makes
the faults a failover could cause, to show that the check catches them). `Reference` computes
greedy outputs with the engine in this process (LLMEngine.generate) and logits with the engine's
model on a KV cache of its own. This module must not start a service nor decide what a test
asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.host import resolve_device, resolve_dtype
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from services.worker.settings import WorkerSettings

HEAD = "head"
"""The tokens before the failover (or all of them when one model served the answer)."""
TAIL = "tail"
"""The tokens the fallback generated after a failover."""
LENGTH = "length"


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first token of an answer that differs from its reference."""

    part: str
    """HEAD, TAIL, or LENGTH (the answer has the wrong number of tokens)."""
    position: int
    """Index of the token in the whole answer."""
    got: int
    expected: int
    """-1 when a length divergence has no token to name."""


def divergence(
    tokens: Sequence[int],
    expected_len: int,
    failover_at: int,
    head_ref: Sequence[int],
    tail_ref: Sequence[int],
    *,
    parts: Sequence[str] = (HEAD, TAIL),
) -> Divergence | None:
    """The first divergence of `tokens` from its references in `parts`; None when they match exactly.

    The length and the failover point are always checked. `head_ref` is the greedy output for the
    prompt of the model that produced the head (the primary, or the fallback when it served the whole
    answer); `tail_ref` the fallback's greedy continuation of prompt + tokens[:failover_at] (unused
    when failover_at is 0).
    """
    if len(tokens) != expected_len:
        return Divergence(LENGTH, min(len(tokens), expected_len), len(tokens), expected_len)
    if not 0 <= failover_at <= expected_len:
        return Divergence(LENGTH, failover_at, failover_at, expected_len)
    for part, start, end in spans(expected_len, failover_at):
        if part not in parts:
            continue
        ref = head_ref if part == HEAD else tail_ref
        for position in range(start, end):
            offset = position - start
            if offset >= len(ref):
                return Divergence(part, position, tokens[position], -1)
            if tokens[position] != ref[offset]:
                return Divergence(part, position, tokens[position], ref[offset])
    return None


def spans(expected_len: int, failover_at: int) -> list[tuple[str, int, int]]:
    """(part, start, end) of an answer's head and, after a failover, its tail."""
    if not failover_at:
        return [(HEAD, 0, expected_len)]
    return [(HEAD, 0, failover_at), (TAIL, failover_at, expected_len)]


def near_tie(logits: Sequence[float], got: int, expected: int, tie_gap: float) -> bool:
    """Whether `got` and `expected` are the top two of `logits` and within `tie_gap` of each other."""
    if got == expected or expected < 0:
        return False
    order = sorted(range(len(logits)), key=lambda i: logits[i], reverse=True)[:2]
    return set(order) == {got, expected} and abs(logits[got] - logits[expected]) < tie_gap


class ReferenceModel(Protocol):
    """What the check needs of a model: greedy continuations and next-token logits."""

    def greedy(self, contexts: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]: ...
    def next_token_logits(self, context: Sequence[int]) -> list[float]: ...


class Reference:
    """One worker's model, loaded in this process as that worker loads it (device, dtype, quantization,
    engine limits; test-mode step delays left out), for greedy references."""

    def __init__(self, settings: WorkerSettings) -> None:
        device = resolve_device(settings.device)
        engine = settings.engine.model_copy(
            update={"enable_fault_injection": False, "fault_step_delay_s": 0.0}
        )
        self.engine = LLMEngine.from_model_dir(
            settings.model_path,
            engine,
            device=device,
            dtype=resolve_dtype(settings.dtype, device),
            quantization=None if settings.quantization == "none" else settings.quantization,
        )

    def greedy(self, contexts: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]:
        """Each context's greedy continuation of its length (ignore_eos), generated together."""
        if not contexts:
            return []
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
        return self.engine.generate([list(c) for c in contexts], params)

    def next_token_logits(self, context: Sequence[int], block_size: int = 16) -> list[float]:
        """The model's float32 logits for the token after `context`, from one prefill of it on a KV
        cache of its own (the engine's cache, and the prefix blocks it keeps, stay untouched)."""
        model = self.engine.runner.model
        blocks = -(-len(context) // block_size)
        cache = KVCache.allocate(model.config, blocks, block_size, model.dtype, model.device)
        meta = AttentionMetadata.build(
            query_lens=[len(context)],
            context_lens=[len(context)],
            block_tables=[list(range(blocks))],
            block_size=block_size,
            device=model.device,
            num_decodes=0,
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(list(context), device=model.device),
                torch.arange(len(context), device=model.device),
                meta,
                cache,
            )
            logits = model.compute_logits(hidden[-1:]).float().cpu()[0]
        return [float(v) for v in logits.tolist()]


@dataclass(frozen=True, slots=True)
class Answer:
    """A completed greedy answer to check: its prompt ids, tokens, length asked, failover point, model."""

    prompt_ids: list[int]
    tokens: list[int]
    expected_len: int
    failover_at: int
    model: str


@dataclass(frozen=True, slots=True)
class Rule:
    """How one model's parts are checked: exactly, a flip at a near tie (within tie_gap) excused."""

    tie_gap: float = 0.0


@dataclass
class CheckReport:
    """How the answers fared: fully exact ones, excused near-tie flips, tokens compared with a
    reference and tokens (and answers) that were not, and failures (each described)."""

    exact: int = 0
    excused: list[str] = field(default_factory=list)
    tokens_checked: int = 0
    tokens_unverified: int = 0
    answers_unverified: int = 0
    failures: list[str] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    """Indices of the failed answers."""


def check_answers(
    answers: Sequence[Answer],
    references: Mapping[str, ReferenceModel],
    primary: str,
    fallback: str,
    rules: Mapping[str, Rule],
) -> CheckReport:
    """Check every answer against its route's two models (see the module doc).

    The references are generated per model in one batch: each prompt's output at the longest length
    any head needs, and each failed-over answer's tail.
    """
    report = CheckReport()
    heads = [primary if a.model == primary or a.failover_at else fallback for a in answers]
    longest: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, answer in enumerate(answers):
        key = (heads[i], tuple(answer.prompt_ids))
        longest[key] = max(longest.get(key, 0), answer.failover_at or answer.expected_len)
    head_refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for model in (primary, fallback):
        keys = [key for key in longest if key[0] == model]
        outputs = references[model].greedy([key[1] for key in keys], [longest[key] for key in keys])
        head_refs.update(zip(keys, outputs, strict=True))
    failed_over = [
        i for i, a in enumerate(answers) if 0 < a.failover_at <= min(a.expected_len, len(a.tokens))
    ]
    contexts = [answers[i].prompt_ids + answers[i].tokens[: answers[i].failover_at] for i in failed_over]
    lengths = [answers[i].expected_len - answers[i].failover_at for i in failed_over]
    tail_refs = dict(zip(failed_over, greedy_of(references[fallback], contexts, lengths), strict=True))
    for i, answer in enumerate(answers):
        where = f"answer {i} ({answer.model}, failover at {answer.failover_at}, {answer.expected_len} tokens)"
        if answer.model not in (primary, fallback) or (answer.failover_at and answer.model != fallback):
            report.failures.append(f"{where}: served by an unexpected model")
            report.failed.append(i)
            continue
        head_ref = head_refs.get((heads[i], tuple(answer.prompt_ids)), [])
        models = {HEAD: heads[i], TAIL: fallback}
        failures = len(report.failures)
        _check_one(answer, models, rules, references, (head_ref, tail_refs.get(i, [])), report, where)
        if len(report.failures) > failures:
            report.failed.append(i)
    return report


def _check_one(
    answer: Answer,
    models: Mapping[str, str],
    rules: Mapping[str, Rule],
    references: Mapping[str, ReferenceModel],
    refs: tuple[list[int], list[int]],
    report: CheckReport,
    where: str,
) -> None:
    """Check one answer's length and parts, adding what was found to `report`."""
    head_ref, tail_ref = refs
    flipped = False
    while (
        found := divergence(answer.tokens, answer.expected_len, answer.failover_at, head_ref, tail_ref)
    ) is not None:
        if found.part == LENGTH:
            report.failures.append(f"{where}: {found}")
            return
        model = models[found.part]
        logits = references[model].next_token_logits(answer.prompt_ids + answer.tokens[: found.position])
        if not near_tie(logits, found.got, found.expected, rules[model].tie_gap):
            report.failures.append(f"{where}: {found}; tokens {answer.tokens}")
            return
        report.excused.append(f"{where}: near tie on {model} at {found}")
        flipped = True
        # The rest of the part: the model's continuation of the answer's own tokens, flip included.
        start, end = next(
            (s, e) for part, s, e in spans(answer.expected_len, answer.failover_at) if part == found.part
        )
        context = answer.prompt_ids + answer.tokens[: found.position + 1]
        rest = greedy_of(references[model], [context], [end - found.position - 1])[0]
        anchored = answer.tokens[start : found.position + 1] + rest
        head_ref, tail_ref = (anchored, tail_ref) if found.part == HEAD else (head_ref, anchored)
    checked = _compared(answer, head_ref, tail_ref)
    report.tokens_checked += checked
    report.tokens_unverified += answer.expected_len - checked
    report.answers_unverified += checked < answer.expected_len
    if not flipped:
        report.exact += 1


def _compared(answer: Answer, head_ref: Sequence[int], tail_ref: Sequence[int]) -> int:
    """How many of the answer's tokens equal the token their reference has at their position."""
    matched = 0
    for part, start, end in spans(answer.expected_len, answer.failover_at):
        ref = head_ref if part == HEAD else tail_ref
        matched += sum(
            1 for p in range(start, end) if p - start < len(ref) and answer.tokens[p] == ref[p - start]
        )
    return matched


def greedy_of(
    model: ReferenceModel, contexts: Sequence[Sequence[int]], lengths: Sequence[int]
) -> list[list[int]]:
    """model.greedy of each context that asks for tokens; [] for those whose length is 0 (greedy takes
    none)."""
    asked = [i for i, n in enumerate(lengths) if n > 0]
    outputs = dict(
        zip(asked, model.greedy([contexts[i] for i in asked], [lengths[i] for i in asked]), strict=True)
    )
    return [outputs.get(i, []) for i in range(len(contexts))]
