"""strata/sampling.py is the one table of sampling parameters: every front door agrees with it.

Each check compares a surface with the table both ways, so a parameter added to the proto, the HTTP
API's body, the Python client's keyword arguments or `strata generate`'s options, and not to the table
(or the other way round), fails here, naming it. The request-level fields of each surface (the model,
streaming, routing, n, ...) are listed here as what they are: not sampling parameters. The limits are
defined once: no module but the table assigns them.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from gateway.errors import InvalidArgument
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.validation import validate
from services.worker.engine.params import InvalidRequestError, SamplingParams
from strata.cli.client_commands import add_generate
from strata.client import GenerateOptions
from strata.sampling import MAX_PENALTY, SAMPLING_PARAMS, SamplingParam
from strata.v1 import common_pb2, gateway_pb2
from tests.unit.test_gateway_validation import SETTINGS

REPO = Path(__file__).resolve().parents[2]
LIMITS = {
    "MAX_PENALTY",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_TOP_LOGPROBS",
    "MAX_STOP_TOKEN_IDS",
    "SEED_LIMIT",
    "MAX_SEED",
}
HTTP_REQUEST_FIELDS = {
    "model", "messages", "prompt", "stream", "stream_options", "n", "user", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "priority", "allow_fallback", "no_fallback",
    "truncation", "metadata", "store", "service_tier", "modalities", "echo", "suffix",
    # Accepted at its default only (one completion per prompt).
    "best_of",
}  # fmt: skip
CLIENT_REQUEST_ARGUMENTS = {"messages", "model", "n", "request_id", "allow_fallback", "truncation"}
CLI_REQUEST_OPTIONS = {
    "prompt", "chat", "system", "model", "n", "json", "timing", "local", "model_dir", "address", "api_key",
    "timeout", "tls_ca", "tls_cert", "tls_key",
}  # fmt: skip


def names(surface: str) -> set[str]:
    found: set[str] = set()
    for param in SAMPLING_PARAMS:
        found.update(getattr(param, surface) or ())
    return found


def test_the_table_holds_every_field_of_the_proto_once() -> None:
    fields = [field.name for field in common_pb2.SamplingParams.DESCRIPTOR.fields]
    table = [param.name for param in SAMPLING_PARAMS]
    assert sorted(table) == sorted(fields)
    assert len(set(table)) == len(table)


@pytest.mark.parametrize("param", SAMPLING_PARAMS, ids=lambda param: param.name)
def test_each_entry_says_what_it_means_and_its_default(param: SamplingParam) -> None:
    assert param.meaning and param.default


def test_the_http_api_exposes_what_the_table_says() -> None:
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert fields - HTTP_REQUEST_FIELDS == names("http")


def test_the_python_client_takes_what_the_table_says() -> None:
    assert set(GenerateOptions.__annotations__) - CLIENT_REQUEST_ARGUMENTS == names("client")


def test_strata_generate_takes_what_the_table_says() -> None:
    root = argparse.ArgumentParser()
    add_generate(root.add_subparsers())
    generate = next(action for action in root._actions if isinstance(action, argparse._SubParsersAction))
    dests = {action.dest for action in generate.choices["generate"]._actions if action.dest != "help"}
    assert dests - CLI_REQUEST_OPTIONS == names("cli")


def test_the_limits_are_assigned_in_the_table_only() -> None:
    """No installed module but strata/sampling.py gives a sampling limit a value."""
    assigned = []
    for root in ("strata", "services", "gateway"):
        for path in (REPO / root).rglob("*.py"):
            if path == REPO / "strata" / "sampling.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assign):
                    hits = [t for t in node.targets if isinstance(t, ast.Name) and t.id in LIMITS]
                    assigned += [f"{path}:{node.lineno}" for _ in hits]
    assert not assigned


def test_the_gateway_and_the_engine_refuse_past_the_tables_limit() -> None:
    """Both sides refuse a penalty past the table's MAX_PENALTY and take one at it."""
    for value, refused in ((MAX_PENALTY, False), (MAX_PENALTY + 0.5, True)):
        request = gateway_pb2.GenerateRequest(
            model="tiny", prompt="hi", sampling=common_pb2.SamplingParams(presence_penalty=value)
        )
        engine_params = SamplingParams(presence_penalty=value)
        if refused:
            with pytest.raises(InvalidArgument, match="presence_penalty"):
                validate(request, SETTINGS, lambda _model: None)
            with pytest.raises(InvalidRequestError, match="presence_penalty"):
                engine_params.validate(4, 100)
        else:
            validate(request, SETTINGS, lambda _model: None)
            engine_params.validate(4, 100)
