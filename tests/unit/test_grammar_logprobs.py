"""Log probabilities of a constrained request are the model's, not the grammar's: the mask decides
which token is sampled, never the probabilities reported for it or its alternatives."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.grammar_compiler import GrammarCompiler
from services.worker.engine.grammar_spec import GrammarSpec
from strata.sampling import SamplingParams
from tests.grammar_cases import SCHEMA

if TYPE_CHECKING:
    from pathlib import Path

    from services.worker.engine.sequence import TokenLogprobs


def test_a_constrained_greedy_request_reports_the_raw_distributions_logprobs(tiny_serving_dir: Path) -> None:
    """Greedy under a JSON schema on a random tiny model: the grammar often forces a token the model
    does not rank first. Were the mask applied to the logprobs, every greedy token would be rank 1
    and the masked alternatives -inf; reported raw, some chosen tokens rank below 1, and the top
    alternatives are finite, the first at least as likely as the chosen one."""
    engine = LLMEngine.from_model_dir(tiny_serving_dir, EngineConfig(num_blocks=256, block_size=8))
    config = engine.model_config
    compiler = GrammarCompiler.from_model_dir(tiny_serving_dir, config.eos_token_ids, config.vocab_size)
    tokenizer = Tokenizer.from_file(str(tiny_serving_dir / "tokenizer.json"))
    prompt = tokenizer.encode("Describe a book as JSON:").ids
    grammar = compiler.matcher(GrammarSpec.of("json_schema", json.dumps(SCHEMA)))
    engine.add_request("c", prompt, SamplingParams(max_new_tokens=24, logprobs=3), grammar=grammar)
    found: list[TokenLogprobs] = []
    while engine.has_work():
        for out in engine.step():
            found.extend(out.logprobs or [])
    assert found, "the constrained request returned no logprobs"
    assert any(position.rank > 1 for position in found), [position.rank for position in found]
    for position in found:
        assert len(position.top) == 3
        assert all(math.isfinite(logprob) for _, logprob in position.top)
        assert position.top[0][1] >= position.logprob
