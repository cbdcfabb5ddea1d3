"""The chaos soak's token check: is a completed greedy answer what its models would generate?

An answer of `n` tokens that failed over at token `k` (GenerateResponse.failover_at_token; 0 when it
did not) is right when its first `k` tokens (its head) are the primary's greedy output for the
prompt and the rest (its tail) the fallback's greedy continuation of the prompt plus those `k`
tokens: a token lost or repeated across the failover shifts the tail and fails the check. An answer
one model served alone is all head, that model's greedy output.

A part is checked by one of two rules, chosen per model. Exact (a model whose greedy output does not
depend on its batch, as float32 and bfloat16 ones): `divergence` names the first token that differs
from the reference, and `near_tie` is the project's parity rule (tests/parity.py) for it: the
reference's top-2 logits on that context are the two tokens and lie within a tie gap, so float
rounding may flip them; after an excused flip nothing later in that part is compared. Margin (torch's
dynamic int8, whose activation scale is taken over the whole batch, so its greedy output depends on
the requests it ran next to): every token of the part lies within a margin of the model's top logit
on the answer's own context, the model run alone (`Reference.deficits`). That catches a wrong model
or a wrong context, not every shifted token. `Reference` computes greedy outputs with the engine in
this process (LLMEngine.generate) and logits with the engine's model on a KV cache of its own. This
module must not start a service nor decide what a test asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from services.worker.engine.engine import LLMEngine
from services.worker.engine.params import SamplingParams
from services.worker.host import resolve_device, resolve_dtype
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache

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
    """What the check needs of a model: greedy continuations, next-token logits, deficits."""

    def greedy(self, contexts: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]: ...
    def next_token_logits(self, context: Sequence[int]) -> list[float]: ...
    def deficits(self, sequence: Sequence[int], start: int) -> list[float]: ...


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

    def next_token_logits(self, context: Sequence[int]) -> list[float]:
        """The model's logits for the token after `context`."""
        return [float(v) for v in self._logits(context, [len(context) - 1])[0].tolist()]

    def deficits(self, sequence: Sequence[int], start: int) -> list[float]:
        """For each token of `sequence` from `start` on: how far its logit lies below the largest one,
        given the tokens before it (0 where it is the model's greedy pick)."""
        rows = self._logits(sequence, list(range(start - 1, len(sequence) - 1)))
        picked = rows.gather(1, torch.tensor(list(sequence[start:])).unsqueeze(1)).squeeze(1)
        return [float(v) for v in (rows.max(dim=1).values - picked).tolist()]

    def _logits(self, sequence: Sequence[int], rows: list[int], block_size: int = 16) -> torch.Tensor:
        """float32 logits after sequence[: row + 1] for each of `rows`, from one prefill of `sequence`
        on a KV cache of its own (the engine's cache, and the prefix blocks it keeps, stay untouched)."""
        model = self.engine.runner.model
        blocks = -(-len(sequence) // block_size)
        cache = KVCache.allocate(model.config, blocks, block_size, model.dtype, model.device)
        meta = AttentionMetadata.build(
            query_lens=[len(sequence)],
            context_lens=[len(sequence)],
            block_tables=[list(range(blocks))],
            block_size=block_size,
            device=model.device,
            num_decodes=0,
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(list(sequence), device=model.device),
                torch.arange(len(sequence), device=model.device),
                meta,
                cache,
            )
            index = torch.tensor(rows, dtype=torch.long, device=model.device)
            return model.compute_logits(hidden.index_select(0, index)).float().cpu()


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
    """How one model's parts are checked: exactly up to near ties, or within a logit margin."""

    tie_gap: float = 0.0
    margin: float | None = None
    """Set for the margin rule (a model whose greedy output depends on its batch)."""


@dataclass
class CheckReport:
    """How the answers fared: fully exact ones, excused near-tie flips, parts checked by margin and
    their largest deficit, and failures (each described)."""

    exact: int = 0
    excused: list[str] = field(default_factory=list)
    by_margin: int = 0
    worst_deficit: float = 0.0
    failures: list[str] = field(default_factory=list)


def check_answers(
    answers: Sequence[Answer],
    references: Mapping[str, ReferenceModel],
    primary: str,
    fallback: str,
    rules: Mapping[str, Rule],
) -> CheckReport:
    """Check every answer against its route's two models (see the module doc).

    For the exact rule the references are generated per model in one batch: each prompt's output at
    the longest length any head needs, and each failed-over answer's tail.
    """
    report = CheckReport()
    heads = [primary if a.model == primary or a.failover_at else fallback for a in answers]
    exact_heads = [i for i, model in enumerate(heads) if rules[model].margin is None]
    longest: dict[tuple[str, tuple[int, ...]], int] = {}
    for i in exact_heads:
        key = (heads[i], tuple(answers[i].prompt_ids))
        longest[key] = max(longest.get(key, 0), answers[i].failover_at or answers[i].expected_len)
    head_refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for model in (primary, fallback):
        keys = [key for key in longest if key[0] == model]
        outputs = references[model].greedy([key[1] for key in keys], [longest[key] for key in keys])
        head_refs.update(zip(keys, outputs, strict=True))
    exact_tails = (
        [i for i, a in enumerate(answers) if a.failover_at] if rules[fallback].margin is None else []
    )
    contexts = [answers[i].prompt_ids + answers[i].tokens[: answers[i].failover_at] for i in exact_tails]
    lengths = [answers[i].expected_len - answers[i].failover_at for i in exact_tails]
    tail_refs = dict(zip(exact_tails, references[fallback].greedy(contexts, lengths), strict=True))
    for i, answer in enumerate(answers):
        where = f"answer {i} ({answer.model}, failover at {answer.failover_at}, {answer.expected_len} tokens)"
        if answer.model not in (primary, fallback) or (answer.failover_at and answer.model != fallback):
            report.failures.append(f"{where}: served by an unexpected model")
            continue
        head_ref = head_refs.get((heads[i], tuple(answer.prompt_ids)), [])
        models = {HEAD: heads[i], TAIL: fallback}
        _check_one(answer, models, rules, references, (head_ref, tail_refs.get(i, [])), report, where)
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
    parts = spans(answer.expected_len, answer.failover_at)
    exact = [part for part, _, _ in parts if rules[models[part]].margin is None]
    flipped = False
    while (
        found := divergence(answer.tokens, answer.expected_len, answer.failover_at, *refs, parts=exact)
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
        exact.remove(found.part)
        flipped = True
    by_margin = [(part, start, end) for part, start, end in parts if rules[models[part]].margin is not None]
    for part, start, end in by_margin:
        model = models[part]
        sequence = answer.prompt_ids + answer.tokens[:end]
        worst = max(references[model].deficits(sequence, len(answer.prompt_ids) + start))
        report.by_margin += 1
        report.worst_deficit = max(report.worst_deficit, worst)
        if worst > (rules[model].margin or 0.0):
            report.failures.append(f"{where}: a {part} token {worst:.2f} logits below {model}'s top pick")
            return
    if not flipped and not by_margin:
        report.exact += 1
