"""Output constraints through a real worker's Connect stream: compiled off the engine thread, refused
with INVALID_ARGUMENT naming the field (bad, unsupported, or too slow to compile), a failover's prior
output replayed into the grammar, and a request cancelled while its grammar compiles holding nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING

import jsonschema

from strata.v1 import common_pb2
from tests.grammar_cases import SCHEMA, slow_schema
from tests.integration.worker_harness import (
    INVALID_ARGUMENT,
    connect,
    running_worker,
    submission,
    wait_idle,
)

if TYPE_CHECKING:
    from pathlib import Path

PROMPT = [5, 17, 42, 99, 123, 200]


def _constrained(request_id: str, max_new_tokens: int = 80, prior: list[int] | None = None, **kind: object):
    sub = submission(request_id, PROMPT, max_new_tokens, prior_output_ids=prior or [])
    sub.sampling.constraint.CopyFrom(common_pb2.OutputConstraint(**kind))  # type: ignore[arg-type]
    return sub


def test_a_failover_continues_inside_the_grammar_and_bad_constraints_are_refused(
    tiny_serving_dir: Path,
) -> None:
    schema = json.dumps(SCHEMA)

    async def main():
        async with running_worker(tiny_serving_dir) as (server, stub):
            side = await connect(stub, tiny_serving_dir)
            await side.send(
                _constrained("whole", json_schema=schema),
                _constrained("regex", regex="[0-9]{4}"),
                _constrained("unsupported", json_schema=json.dumps({"type": "object", "if": {}})),
                _constrained("bad-regex", regex="[0-9"),
                _constrained("empty"),
            )
            await side.read_until(lambda s: {"whole", "regex"} <= set(s.finals) and len(s.rejections) == 3)
            whole = side.tokens["whole"]
            cut = len(whole) // 2
            # The fallback worker gets the prompt plus what the first one produced, and the grammar.
            await side.send(_constrained("rest", prior=whole[:cut], json_schema=schema))
            assert server.host.grammars is not None
            refused = server.host.grammars.tokenizer.tokenize_str("no")  # an object starts with '{'

            await side.send(_constrained("refused", prior=refused, json_schema=schema))
            await side.read_until(lambda s: "rest" in s.finals and "refused" in s.rejections)
            stats = await wait_idle(stub)
            return side, whole, cut, server.host.grammars, stats

    side, whole, cut, compiler, stats = asyncio.run(main())
    assert compiler is not None
    text = compiler.tokenizer.decode_str(whole)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert side.finals["whole"].finish_reason == common_pb2.FINISH_REASON_STOP
    assert re.fullmatch("[0-9]{4}", compiler.tokenizer.decode_str(side.tokens["regex"]))
    assert whole[:cut] + side.tokens["rest"] == whole
    assert side.finals["rest"].output_tokens == len(whole)
    for rid, field, says in (
        ("unsupported", "sampling.constraint.json_schema", "Unimplemented keys"),
        ("bad-regex", "sampling.constraint.regex", "unclosed character class"),
        ("empty", "sampling.constraint", "must set one of"),
        ("refused", "prior_output_ids", "are not a prefix"),
    ):
        rejection = side.rejections[rid]
        assert rejection.code == INVALID_ARGUMENT and field in rejection.message and says in rejection.message
    assert stats.used_kv_blocks == 0


def test_a_slow_compile_is_refused_at_the_bound_and_a_cancel_while_compiling_holds_nothing(
    tiny_serving_dir: Path,
) -> None:
    async def main():
        async with running_worker(tiny_serving_dir, grammar_compile_timeout_s=0.002) as (server, stub):
            side = await connect(stub, tiny_serving_dir)
            await side.send(_constrained("slow", json_schema=slow_schema(600)))
            await side.send(_constrained("cancelled", json_schema=slow_schema(599)), cancel=("cancelled",))
            await side.send(submission("plain", PROMPT, 8))
            await side.read_until(
                lambda s: "slow" in s.rejections and {"plain", "cancelled"} <= set(s.finals)
            )
            stats = await wait_idle(stub)
            return side, stats, server.host.credits.available

    side, stats, credits = asyncio.run(main())
    rejection = side.rejections["slow"]
    assert rejection.code == INVALID_ARGUMENT
    assert (
        "sampling.constraint.json_schema" in rejection.message
        and "did not compile within" in rejection.message
    )
    assert side.finals["cancelled"].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert len(side.tokens["plain"]) == 8
    assert stats.open_requests == 0 and stats.used_kv_blocks == 0
    assert credits == side.credits[0]
