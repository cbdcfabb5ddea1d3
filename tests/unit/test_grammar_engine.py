"""Structured output in the engine on a tiny random model: every form's output belongs to its language,
the mask spans the logits' whole width, constrained rows leave their neighbours' tokens alone, and
preemption or a failover's replay keeps the grammar's state.

A random-weight model writes anything it is allowed to, so an output that belongs to the language is
the grammar's doing: the same prompts unconstrained produce text outside it (checked per test).
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_mask import GrammarMasker
from services.worker.engine.grammar_spec import GrammarSpec
from services.worker.engine.sequence import FinishReason
from strata.sampling import InvalidRequestError, SamplingParams
from tests.grammar_cases import LARK, REGEX, SCHEMA, slow_schema

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture(scope="module")
def engine(tiny_serving_dir: Path) -> LLMEngine:
    return LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig(num_blocks=256, block_size=8))


@pytest.fixture(scope="module")
def compiler(engine: LLMEngine, tiny_serving_dir: Path) -> GrammarCompiler:
    config = engine.model_config
    return GrammarCompiler.from_model_dir(tiny_serving_dir, config.eos_token_ids, config.vocab_size)


@pytest.fixture(scope="module")
def tokenizer(tiny_serving_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))


def _prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(f"Hello world number {i}: the quick brown fox").ids for i in range(count)]


def _generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    compiler: GrammarCompiler,
    spec: GrammarSpec | None,
    max_new_tokens: int = 80,
) -> list[tuple[list[int], FinishReason | None]]:
    ids = []
    for i, prompt in enumerate(prompts):
        grammar = compiler.matcher(spec) if spec is not None else None
        rid = f"g-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens), grammar=grammar)
        ids.append(rid)
    results: dict[str, tuple[list[int], FinishReason | None]] = {rid: ([], None) for rid in ids}
    while engine.has_work():
        for out in engine.step():
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return [results[rid] for rid in ids]


def test_json_schema_outputs_validate_and_finish_with_stop(engine, compiler, tokenizer) -> None:
    spec = GrammarSpec.of("json_schema", json.dumps(SCHEMA))
    outputs = _generate(engine, _prompts(tokenizer, 6), compiler, spec)
    for tokens, reason in outputs:
        assert reason is FinishReason.STOP
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    free = _generate(engine, _prompts(tokenizer, 6), compiler, None)
    assert not any(tokenizer.decode(t).startswith('{"name": ') for t, _ in free)


def test_regex_and_lark_outputs_match_their_language(engine, compiler, tokenizer) -> None:
    for spec, accepts in (
        (GrammarSpec.of("regex", REGEX), lambda s: re.fullmatch(REGEX, s) is not None),
        (
            GrammarSpec.of("lark_grammar", LARK),
            lambda s: re.fullmatch(r"yes|no|maybe [1-9][0-9]?", s) is not None,
        ),
    ):
        for tokens, reason in _generate(engine, _prompts(tokenizer, 4), compiler, spec):
            assert reason is FinishReason.STOP, tokenizer.decode(tokens)
            assert accepts(tokenizer.decode(tokens)), tokenizer.decode(tokens)


def test_json_object_output_is_an_object_or_an_object_cut_by_length(engine, compiler, tokenizer) -> None:
    spec = GrammarSpec.of("json_object", True)
    for tokens, reason in _generate(engine, _prompts(tokenizer, 4), compiler, spec, max_new_tokens=40):
        text = tokenizer.decode(tokens)
        assert text.startswith("{")
        if reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:
            # Cut by max_new_tokens: incomplete, but still a prefix the grammar accepts.
            assert reason is FinishReason.LENGTH and len(tokens) == 40
            assert compiler.matcher(spec).replay(tokens)


def test_the_mask_covers_padding_ids_past_the_tokenizer(compiler) -> None:
    grammar = compiler.matcher(GrammarSpec.of("regex", "[0-9]+"))
    width = compiler.vocab_size + 16
    logits = torch.zeros(2, width)
    logits[:, compiler.vocab_size :] = 100.0  # padding ids the model scores highest
    GrammarMasker(threads=1).apply(logits, [(1, grammar, [])])
    assert torch.isneginf(logits[1, compiler.vocab_size :]).all()
    allowed = (~torch.isneginf(logits[1])).nonzero().squeeze(1).tolist()
    assert allowed and all(compiler.tokenizer.decode_str([i]).isdigit() for i in allowed)
    assert not torch.isneginf(logits[0]).any(), "an unconstrained row was masked"


def test_a_constrained_request_leaves_its_batch_neighbours_unchanged(engine, compiler, tokenizer) -> None:
    prompts = _prompts(tokenizer, 5)
    alone = _generate(engine, prompts, compiler, None, max_new_tokens=24)
    spec = GrammarSpec.of("json_schema", json.dumps(SCHEMA))
    rids = []
    for i, prompt in enumerate(prompts):
        grammar = compiler.matcher(spec) if i == 2 else None
        rid = f"mixed-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=24), grammar=grammar)
        rids.append(rid)
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    for i, rid in enumerate(rids):
        if i != 2:
            assert got[rid] == alone[i][0]
    assert got["mixed-2"] != alone[2][0]
    assert tokenizer.decode(got["mixed-2"]).startswith('{"name": "')


def test_preemption_keeps_the_grammar_state(tiny_serving_dir, compiler, tokenizer) -> None:
    spec = GrammarSpec.of("json_schema", json.dumps(SCHEMA))
    prompts = _prompts(tokenizer, 16)
    ample = LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig(num_blocks=256, block_size=8))
    expected = ample.generate(
        prompts, SamplingParams(max_new_tokens=60), [compiler.matcher(spec) for _ in prompts]
    )
    tight = LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig(num_blocks=14, block_size=8))
    got = tight.generate(
        prompts, SamplingParams(max_new_tokens=60), [compiler.matcher(spec) for _ in prompts]
    )
    assert tight.stats().num_preemptions > 0
    assert got == expected
    for tokens in got:
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


def test_a_failover_replays_the_prior_output_into_the_grammar(engine, compiler, tokenizer) -> None:
    spec = GrammarSpec.of("json_schema", json.dumps(SCHEMA))
    prompt = _prompts(tokenizer, 1)[0]
    ((whole, _),) = _generate(engine, [prompt], compiler, spec)
    cut = len(whole) // 2
    grammar = compiler.matcher(spec)
    assert grammar.replay(whole[:cut])
    rest = engine.generate([prompt + whole[:cut]], SamplingParams(max_new_tokens=80 - cut), [grammar])[0]
    assert whole[:cut] + rest == whole
    refused = compiler.matcher(spec)
    assert not refused.replay(tokenizer.encode("not json").ids)


@pytest.mark.parametrize(
    ("kind", "source", "field", "says"),
    [
        ("json_schema", json.dumps({"type": "object", "if": {}, "then": {}}), "json_schema", "Unimplemented"),
        ("json_schema", "{not json", "json_schema", "must be JSON"),
        ("json_schema", "[1, 2]", "json_schema", "JSON object"),
        ("regex", "[0-9", "regex", "unclosed character class"),
        ("lark_grammar", "start: missing_rule", "lark_grammar", "unknown name"),
        ("regex", "", "regex", "must not be empty"),
        ("json_object", False, "json_object", "must be true"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(compiler, kind, source, field, says) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compiler.matcher(GrammarSpec.of(kind, source))
    assert caught.value.field == f"sampling.constraint.{field}"
    assert says in str(caught.value)


def test_a_constraint_compiles_once_and_is_cached_by_hash(compiler) -> None:
    spec = GrammarSpec.of("regex", "[a-c]{1,7}x")
    before = compiler.compiles
    first, second = compiler.matcher(spec), compiler.matcher(GrammarSpec.of("regex", "[a-c]{1,7}x"))
    assert compiler.compiles == before + 1
    assert first.raw is not second.raw, "each request needs its own state"


def test_a_compile_past_the_time_bound_is_refused_without_waiting_for_it(engine, tiny_serving_dir) -> None:
    config = engine.model_config
    unbounded = GrammarCompiler.from_model_dir(tiny_serving_dir, config.eos_token_ids, config.vocab_size)
    started = time.perf_counter()
    unbounded.matcher(GrammarSpec.of("json_schema", slow_schema(600)), timeout_s=60)
    compile_s = time.perf_counter() - started
    bound_s = compile_s / 20  # the bound is far below what this schema takes
    bounded = GrammarCompiler.from_model_dir(
        tiny_serving_dir, config.eos_token_ids, config.vocab_size, timeout_s=bound_s
    )
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as caught:
        bounded.matcher(GrammarSpec.of("json_schema", slow_schema(600)))
    waited = time.perf_counter() - started
    assert caught.value.field == "sampling.constraint.json_schema"
    assert "did not compile within" in str(caught.value)
    # Half the compile, ten times the bound: a scheduler's hiccup of tens of milliseconds on a busy
    # core must not fail it, and a compiler that waited for the compile still would.
    assert waited < compile_s / 2, f"waited {waited:.3f} s for a bound of {bound_s:.3f} s"


@pytest.mark.real_model
@pytest.mark.slow
def test_the_real_model_answers_each_benchmark_schema_with_valid_json(real_model_dir: Path) -> None:
    from bench.grammar_cost import chat_prompts, compiler_for
    from bench.grammar_schemas import SCHEMAS

    engine = LLMEngine.from_model_dir(real_model_dir, EngineConfig(max_num_seqs=8))
    compiler = compiler_for(engine, real_model_dir)
    prompts = chat_prompts(real_model_dir, len(SCHEMAS))
    grammars = [compiler.matcher(GrammarSpec.of("json_schema", json.dumps(SCHEMAS[n]))) for n, _ in prompts]
    outputs = engine.generate([ids for _, ids in prompts], SamplingParams(max_new_tokens=256), grammars)
    for (name, _), tokens in zip(prompts, outputs, strict=True):
        assert len(tokens) < 256, name
        jsonschema.validate(json.loads(compiler.tokenizer.decode_str(tokens)), SCHEMAS[name])
