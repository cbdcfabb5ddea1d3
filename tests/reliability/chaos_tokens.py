"""The chaos soak's token check: is a completed greedy answer exactly what its models would generate?

An answer of `n` tokens that failed over at token `k` (GenerateResponse.failover_at_token; 0 when it
did not) is right when its first `k` tokens are the primary's greedy output for the prompt and the
rest are the serving model's greedy continuation of the prompt plus those `k` tokens: a token lost or
repeated across the failover shifts the rest and fails the check. An answer served by one model alone
is that model's greedy output. `divergence` is the pure comparison; it names the first token that
differs, in which part. `near_tie` is the project's parity rule (tests/parity.py) for such a token:
the reference's top-2 logits, on the same context, are the two tokens and lie within a tie gap, so
float rounding (or a batch's dynamic int8 scale) may flip them; after an excused flip nothing later
in that part is compared. `Reference` computes greedy outputs with the engine in this process
(LLMEngine.generate) and next-token logits with the engine's model on a KV cache of its own. This
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
    skip_head: bool = False,
) -> Divergence | None:
    """The first divergence of `tokens` from its references; None when it matches them exactly.

    `head_ref` is the greedy output for the prompt of the model that produced the head (the primary,
    or the fallback when it served the whole answer); `tail_ref` the fallback's greedy continuation of
    prompt + tokens[:failover_at] (unused when failover_at is 0). `skip_head` leaves the head out (its
    divergence was already judged a near tie), so the tail is still compared.
    """
    if len(tokens) != expected_len:
        return Divergence(LENGTH, min(len(tokens), expected_len), len(tokens), expected_len)
    if not 0 <= failover_at <= expected_len:
        return Divergence(LENGTH, failover_at, failover_at, expected_len)
    head_end = failover_at if failover_at else expected_len
    parts = [] if skip_head else [(HEAD, 0, head_end, head_ref)]
    if failover_at:
        parts.append((TAIL, failover_at, expected_len, tail_ref))
    for part, start, end, ref in parts:
        for position in range(start, end):
            offset = position - start
            if offset >= len(ref):
                return Divergence(part, position, tokens[position], -1)
            if tokens[position] != ref[offset]:
                return Divergence(part, position, tokens[position], ref[offset])
    return None


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
        """The model's logits for the token after `context`, from one prefill on a KV cache of its own
        (the engine's cache, and the prefix blocks it keeps, stay untouched)."""
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
            logits = model.compute_logits(hidden.index_select(0, meta.last_token_indices))
        return [float(value) for value in logits[0].float().tolist()]


@dataclass(frozen=True, slots=True)
class Answer:
    """A completed greedy answer to check: its prompt ids, tokens, length asked, failover point, model."""

    prompt_ids: list[int]
    tokens: list[int]
    expected_len: int
    failover_at: int
    model: str


@dataclass
class CheckReport:
    """How the answers fared: exact ones, excused near-tie flips, and failures (each described)."""

    exact: int = 0
    excused: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def check_answers(
    answers: Sequence[Answer],
    references: Mapping[str, ReferenceModel],
    primary: str,
    fallback: str,
    tie_gaps: Mapping[str, float],
) -> CheckReport:
    """Check every answer against greedy references of the route's two models (see the module doc).

    The references are generated per model in one batch: the primary's (or, for answers the fallback
    served alone, the fallback's) output for each prompt at the longest length any answer needs, and
    the fallback's continuation of each failed-over answer's head.
    """
    report = CheckReport()
    head_model = {
        i: primary if a.model == primary or a.failover_at else fallback for i, a in enumerate(answers)
    }
    longest: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, answer in enumerate(answers):
        key = (head_model[i], tuple(answer.prompt_ids))
        longest[key] = max(longest.get(key, 0), answer.failover_at or answer.expected_len)
    heads: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for model in (primary, fallback):
        keys = [key for key in longest if key[0] == model]
        outputs = references[model].greedy([key[1] for key in keys], [longest[key] for key in keys])
        heads.update(zip(keys, outputs, strict=True))
    failed_over = [i for i, a in enumerate(answers) if a.failover_at]
    tails = dict(
        zip(
            failed_over,
            references[fallback].greedy(
                [answers[i].prompt_ids + answers[i].tokens[: answers[i].failover_at] for i in failed_over],
                [answers[i].expected_len - answers[i].failover_at for i in failed_over],
            ),
            strict=True,
        )
    )
    for i, answer in enumerate(answers):
        where = f"answer {i} ({answer.model}, failover at {answer.failover_at}, {answer.expected_len} tokens)"
        if answer.model not in (primary, fallback) or (answer.failover_at and answer.model != fallback):
            report.failures.append(f"{where}: served by an unexpected model")
            continue
        head_ref = heads[(head_model[i], tuple(answer.prompt_ids))]
        tail_ref = tails.get(i, [])
        skip_head = False
        while True:
            found = divergence(
                answer.tokens,
                answer.expected_len,
                answer.failover_at,
                head_ref,
                tail_ref,
                skip_head=skip_head,
            )
            if found is None:
                if not skip_head:
                    report.exact += 1
                break
            model = head_model[i] if found.part == HEAD else fallback
            context = answer.prompt_ids + answer.tokens[: found.position]
            if found.part == LENGTH or not near_tie(
                references[model].next_token_logits(context), found.got, found.expected, tie_gaps[model]
            ):
                report.failures.append(f"{where}: {found}; tokens {answer.tokens}")
                break
            report.excused.append(f"{where}: near tie on {model} at {found}")
            if found.part == TAIL or not answer.failover_at:
                break
            skip_head = True
    return report
