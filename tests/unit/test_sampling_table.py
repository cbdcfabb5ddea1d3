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
import re
from pathlib import Path
from typing import cast

import pytest

from gateway.errors import InvalidArgument
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.validation import validate
from strata.cli.client_commands import add_generate
from strata.client import GenerateOptions
from strata.generate_request import build_request
from strata.sampling import (
    BOUNDS,
    MAX_PENALTY,
    TABLE,
    InvalidRequestError,
    SamplingOptions,
    SamplingParams,
    TableEntry,
    option_type,
    out_of_bounds,
)
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
    for param in TABLE:
        found.update(getattr(param, surface) or ())
    return found


def test_the_table_holds_every_field_of_the_proto_once() -> None:
    fields = [field.name for field in common_pb2.SamplingParams.DESCRIPTOR.fields]
    table = [param.name for param in TABLE]
    assert sorted(table) == sorted(fields)
    assert len(set(table)) == len(table)


@pytest.mark.parametrize("param", TABLE, ids=lambda param: param.name)
def test_each_entry_says_what_it_means_and_its_default(param: TableEntry) -> None:
    assert param.meaning and param.default


def test_the_http_api_exposes_what_the_table_says() -> None:
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert fields - HTTP_REQUEST_FIELDS == names("http")


def test_the_python_client_takes_what_the_table_says() -> None:
    assert set(GenerateOptions.__annotations__) - CLIENT_REQUEST_ARGUMENTS == names("client")


def test_the_client_copies_every_scalar_it_names_as_the_proto_does() -> None:
    """SamplingOptions is the proto's scalars that the table says the client names as the proto does
    (logprobs, a count on the client, aside), each of the field's Python type; the client and the CLI
    copy each one by name, so a value given reaches the request and one not given stays unset."""
    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    scalars = {name for name, field in fields.items() if not field.is_repeated and field.message_type is None}
    own = {param.name for param in TABLE if param.client == (param.name,)} & scalars
    assert set(SamplingOptions.__annotations__) == own - {"logprobs"}
    for name in SamplingOptions.__annotations__:
        value = option_type(name)(3)
        assert type(getattr(common_pb2.SamplingParams(), name)) is option_type(name)
        sent = build_request("x", **cast("SamplingOptions", {name: value})).sampling
        assert getattr(sent, name) == value and name in {field.name for field, _ in sent.ListFields()}
        unset = build_request("x", **cast("SamplingOptions", {name: None})).sampling
        assert name not in {field.name for field, _ in unset.ListFields()}
    with pytest.raises(TypeError, match="no_speculation"):
        build_request("x", no_speculation=True)  # type: ignore[call-arg]


def test_each_sampling_flag_of_strata_generate_reaches_the_request() -> None:
    """Every scalar flag `strata generate` makes from the table sets its field, by its proto name."""
    from strata.cli import build_parser
    from strata.cli.client_commands import _generate_request

    root = argparse.ArgumentParser()
    add_generate(root.add_subparsers())
    generate = next(action for action in root._actions if isinstance(action, argparse._SubParsersAction))
    flags = [a for a in generate.choices["generate"]._actions if a.dest in SamplingOptions.__annotations__]
    assert flags
    for flag in flags:
        argv = ["generate", "hi", flag.option_strings[0], *([] if flag.nargs == 0 else ["3"])]
        sampling = _generate_request(build_parser().parse_args(argv)).sampling
        assert getattr(sampling, flag.dest) == option_type(flag.dest)(3)
        assert [field.name for field, _ in sampling.ListFields()] == [flag.dest]


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
                validate(request, SETTINGS, lambda _model: None, {})
            with pytest.raises(InvalidRequestError, match="presence_penalty"):
                engine_params.validate(4, 100)
        else:
            validate(request, SETTINGS, lambda _model: None, {})
            engine_params.validate(4, 100)


# The engine's name of each bounded field where it differs from the proto's.
ENGINE_NAMES = {"top_logprobs": "logprobs"}
# Per bounded field: a value at the range's end (taken) and one just past it (refused).
EDGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, -0.5),
    "top_p": (1.0, 0.0),
    "top_k": (0, -1),
    "repetition_penalty": (0.5, 0.0),
    "no_repeat_ngram_size": (0, -1),
    "seed": (2**63 - 1, 2**63),
    "presence_penalty": (2.0, 2.5),
    "frequency_penalty": (-2.0, -2.5),
    "min_p": (1.0, 1.5),
    "typical_p": (1.0, 0.0),
    "top_logprobs": (20, 21),
    "prompt_logprobs": (20, 21),
}


def test_every_bounded_field_has_its_edges_here() -> None:
    assert set(EDGES) == set(BOUNDS)


@pytest.mark.parametrize("name", sorted(EDGES))
def test_the_gateway_and_the_engine_check_each_range_by_the_tables_one_rule(name: str) -> None:
    """The value at the range's end is taken by both sides and the one past it refused by both, in
    the table's own words (out_of_bounds): one rule, not two that happen to agree."""
    taken, refused = EDGES[name]
    field = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name[name]
    unsigned = field.type in (field.TYPE_UINT32, field.TYPE_UINT64)
    for value, past in ((taken, False), (refused, True)):
        if unsigned and value < 0:
            continue  # the proto cannot carry it; the engine's side is checked below
        request = gateway_pb2.GenerateRequest(model="tiny", prompt="hi")
        setattr(request.sampling, name, value)
        request.sampling.logprobs = name == "top_logprobs"  # alternatives need logprobs on
        if past:
            with pytest.raises(InvalidArgument, match=_words(name, value)):
                validate(request, SETTINGS, lambda _model: None, {})
        else:
            validate(request, SETTINGS, lambda _model: None, {})
    engine_name = ENGINE_NAMES.get(name, name)
    SamplingParams(**{engine_name: taken}).validate(4, 100)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=_words(name, refused)):
        SamplingParams(**{engine_name: refused}).validate(4, 100)  # type: ignore[arg-type]


def _words(name: str, value: float) -> str:
    problem = out_of_bounds(name, value)
    assert problem is not None
    return re.escape(problem)
