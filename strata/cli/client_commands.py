"""The ``strata`` subcommands that call a running gateway: ``generate`` and ``models``.

Each builds its request from the parsed options, calls strata.client and renders the answer: streamed
text on stdout, timing on stderr, gRPC failures as "error: CODE: message" with exit status 1. It
must stay cheap to import (strata.cli builds these parsers for ``strata --help``): no grpc, torch or
transformers at module level. It holds no serving logic; ``generate --local`` delegates to
strata.cli.local_generate, the in-process engine demonstration.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from strata.sampling import TABLE, SamplingOptions, option_type

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterable
    from typing import TypeAlias

    from strata.client import StrataClient
    from strata.v1 import gateway_pb2

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_TIMEOUT_S = 300.0
_LOCAL_OPTIONS = ("max_new_tokens", "temperature")
"""The sampling options the in-process --local path honours."""
_OPTIONS = tuple(
    param.name
    for param in TABLE
    if param.cli == (param.name,) and param.name in SamplingOptions.__annotations__
)
"""The scalar sampling options `strata generate` takes, under their proto names (strata/sampling.py)."""
# Options of the gRPC path that the in-process --local path cannot honour.
_REMOTE_ONLY = (
    "address",
    "system",
    "model",
    *(name for name in _OPTIONS if name not in _LOCAL_OPTIONS),
    "stop",
    "logprobs",
    "n",
    "json_schema",
    "json_object",
    "regex",
    "grammar",
)


def _generate_request(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    from strata.client import build_request

    messages = None
    if args.chat:
        messages = [("user", args.prompt)]
        if args.system is not None:
            messages.insert(0, ("system", args.system))
    # The parser made one option per name, of the type SamplingOptions gives it (add_generate).
    options = cast("SamplingOptions", {name: getattr(args, name) for name in _OPTIONS})
    return build_request(
        None if args.chat else args.prompt,
        messages=messages,
        model=args.model or "",
        stop=args.stop or (),
        logprobs=args.logprobs,
        n=args.n or 1,
        json_schema=_text_or_file(args.json_schema),
        json_object=args.json_object,
        regex=args.regex,
        grammar=_text_or_file(args.grammar),
        **options,
    )


def _text_or_file(value: str | None) -> str | None:
    """An option's text, or the contents of the file it names with a leading '@' (curl's convention)."""
    if value is None or not value.startswith("@"):
        return value
    return Path(value[1:]).read_text()


def _print_logprobs(response: gateway_pb2.GenerateResponse) -> None:
    """One line per generated token on stderr: its logprob, its text, then the alternatives'."""
    for position in response.logprobs:
        chosen = position.chosen
        tops = "  ".join(f"{top.token!r} {top.logprob:.3f}" for top in position.top)
        print(f"{chosen.logprob:9.4f}  {chosen.token!r:<16} {tops}".rstrip(), file=sys.stderr)


def _print_stream(
    messages: Iterable[gateway_pb2.GenerateStreamResponse],
) -> gateway_pb2.GenerateResponse | None:
    """Write each text delta as it arrives; the final summary, or None when the stream lacked it."""
    final = None
    try:
        for message in messages:
            if message.text:
                sys.stdout.write(message.text)
                sys.stdout.flush()
            if message.HasField("final"):
                final = message.final
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return final


def _print_timing(response: gateway_pb2.GenerateResponse) -> None:
    import shutil

    from strata.cli.waterfall import render_waterfall
    from strata.v1 import common_pb2

    # The waterfall goes to stderr, so that is the stream whose terminal decides colour; NO_COLOR
    # (no-color.org) turns it off when set to anything nonempty.
    color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    # The rows' text takes about 35 columns; the bars get what the terminal has left, up to 60.
    width = max(20, min(60, shutil.get_terminal_size().columns - 36))
    print(
        render_waterfall(response.timing, width=width, color=color, trace_id=response.trace_id),
        file=sys.stderr,
    )
    fallback = f" (fallback: {response.fallback_reason})" if response.fallback_reason else ""
    finish = common_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_")
    print(
        f"model {response.model}{fallback} | {response.usage.input_tokens} input tokens, "
        f"{response.usage.output_tokens} output tokens | finish {finish} | request {response.request_id}",
        file=sys.stderr,
    )


def _generate(args: argparse.Namespace) -> int:
    response: gateway_pb2.GenerateResponse | None
    if args.local:
        return _generate_local(args)
    if args.system is not None and not args.chat:
        print(
            "strata generate: error: --system needs --chat (a system message is part of a chat)",
            file=sys.stderr,
        )
        return 2
    import grpc
    from google.protobuf.json_format import MessageToJson

    request = _generate_request(args)
    with _client(args) as client:
        try:
            if args.json:
                response = client.send(request, timeout=args.timeout)
                print(MessageToJson(response))
            elif request.n > 1:
                response = client.send(request, timeout=args.timeout)
                for choice in response.choices:
                    print(f"[{choice.index}] {choice.text}")
            else:
                response = _print_stream(client.send_stream(request, timeout=args.timeout))
        except grpc.RpcError as error:
            return _rpc_failed(error)
    if response is None:
        print("error: the stream ended without its final message", file=sys.stderr)
        return 1
    if args.logprobs is not None and not args.json:
        _print_logprobs(response)
    if args.timing:
        _print_timing(response)
    return 0


def _generate_local(args: argparse.Namespace) -> int:
    given = [name for name in _REMOTE_ONLY if getattr(args, name) not in (None, [], False)]
    given += [flag for flag in ("json", "timing") if getattr(args, flag)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        print(f"strata generate: error: {flags} need the gRPC stack; drop --local", file=sys.stderr)
        return 2
    from strata.cli.local_generate import generate_local
    from strata.cli.model_fetch import ensure_default_model

    model_dir = args.model_dir if args.model_dir is not None else ensure_default_model()
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else 64
    generate_local(model_dir, args.prompt, args.chat, max_new_tokens, args.temperature or 0.0)
    return 0


def add_generate(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream an answer to PROMPT from the running stack (strata up)",
        description=(
            "Send PROMPT to the gateway and stream the text as it is decoded. PROMPT is sent as raw text "
            "unless --chat (then as a user message, through the model's chat template). Errors print "
            "'error: CODE: message' and exit 1. --local runs the engine in this process instead, "
            "without any service (a demonstration of the engine)."
        ),
    )
    parser.add_argument("prompt", help="the prompt (with --chat: the user's message)")
    _add_address(parser)
    parser.add_argument("--chat", action="store_true", help="send PROMPT as a user message (chat template)")
    parser.add_argument("--system", help="with --chat: a system message before PROMPT")
    parser.add_argument("--model", help="model name, as `strata models` lists it (default: the gateway's)")
    sampling = parser.add_argument_group("sampling (strata/sampling.py's table; docs/outputs.md)")
    for param in TABLE:
        if param.name in _OPTIONS:
            flag, kind = "--" + param.name.replace("_", "-"), option_type(param.name)
            valid = f"; {param.valid}" if param.valid else ""
            text = f"{param.meaning}{valid} (default: {param.default})".replace("%", "%%")
            if kind is bool:
                sampling.add_argument(flag, action="store_true", default=None, help=text)
            else:
                sampling.add_argument(flag, type=kind, help=text)
    parser.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    parser.add_argument(
        "--n", type=int, help="generate N samples of PROMPT, printed as [i] TEXT (default: 1)"
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="print each token's log probability and its N most likely alternatives (N in [0, 20]) to stderr",
    )
    parser.add_argument("--json", action="store_true", help="print the whole GenerateResponse as JSON")
    shape = parser.add_argument_group("structured output (one at most; docs/structured-output.md)")
    shape.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema's text, or @FILE")
    shape.add_argument("--json-object", action="store_true", help="any JSON object")
    shape.add_argument("--regex", help="a regular expression the whole output matches")
    shape.add_argument("--grammar", metavar="LARK", help="a Lark grammar's text, or @FILE")
    parser.add_argument("--timing", action="store_true", help="print the per-stage timing to stderr")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds for the whole call (default: %(default)s)",
    )
    local = parser.add_argument_group("in-process generation (no services)")
    local.add_argument(
        "--local", action="store_true", help="run the engine in this process, not via the stack"
    )
    local.add_argument(
        "--model-dir", type=Path, help="with --local: model folder (default: the default model)"
    )
    parser.set_defaults(handler=_generate)


def _models(args: argparse.Namespace) -> int:
    import grpc

    with _client(args) as client:
        try:
            reply = client.list_models(timeout=args.timeout)
        except grpc.RpcError as error:
            return _rpc_failed(error)
    rows = [("MODEL", "FAMILY", "CONTEXT", "KV TOKENS", "WORKERS", "FALLBACK", "WEIGHTS", "NATIVE KERNELS")]
    for model in reply.models:
        name = model.name + (" *" if model.name == reply.default_model else "")
        workers = f"{model.ready_workers}/{model.configured_workers} ready"
        kv = str(model.kv_cache_tokens)
        if model.memory.kv_cache_dtype:
            kv += f" ({model.memory.kv_cache_dtype})"
        kernels = "; ".join([*model.native_kernels, *model.native_paths]) or "-"
        family = model.model_family or "-"
        if model.base_model:  # a LoRA adapter over a route's model: that route's figures
            family = f"{family} + LoRA r{model.lora_rank}"
        weights = "; ".join(model.weights_format) or "-"
        fallback = model.fallback_model or "-"
        rows.append((name, family, str(model.max_model_len), kv, workers, fallback, weights, kernels))
    widths = [max(len(row[column]) for row in rows) for column in range(7)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[7])
    print("(* the default model)")
    if len(reply.tenants) > 1 or any(t.running or t.queued for t in reply.tenants):
        print()
        table = [("TENANT", "WEIGHT", "RUNNING", "QUEUED", "LIMITS")]
        for tenant in reply.tenants:
            limits = [
                f"{tenant.max_concurrent_requests} requests" if tenant.max_concurrent_requests else "",
                f"{tenant.tokens_left}/{tenant.tokens_per_minute} tokens/min left"
                if tenant.tokens_per_minute
                else "",
            ]
            shown = ", ".join(limit for limit in limits if limit) or "-"
            table.append((tenant.name, f"{tenant.weight:g}", str(tenant.running), str(tenant.queued), shown))
        sizes = [max(len(line[column]) for line in table) for column in range(4)]
        for line in table:
            cells = "  ".join(cell.ljust(size) for cell, size in zip(line, sizes, strict=False))
            print(f"{cells}  {line[4]}")
    return 0


def add_models(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser("models", help="list the models the gateway serves")
    _add_address(parser)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds (default: %(default)s)")
    parser.set_defaults(handler=_models)


def _address(args: argparse.Namespace) -> str:
    from strata.client import DEFAULT_ADDRESS

    return str(args.address or os.environ.get("STRATA_ADDRESS") or DEFAULT_ADDRESS)


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", help="gateway HOST:PORT (default: $STRATA_ADDRESS, else 127.0.0.1:50051)"
    )
    parser.add_argument("--api-key", help="the gateway's API key (default: $STRATA_API_KEY)")
    parser.add_argument("--tls-ca", type=Path, help="speak TLS; PEM CA that signed the gateway's certificate")
    parser.add_argument("--tls-cert", type=Path, help="with --tls-ca: PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, help="with --tls-cert: its PEM private key")


def _client(args: argparse.Namespace) -> StrataClient:
    """A client of the gateway the options name, with their API key and TLS files."""
    from strata.client import StrataClient
    from strata.tls import ClientTlsSettings

    tls = None
    if args.tls_ca or args.tls_cert:
        tls = ClientTlsSettings(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key)
    api_key = args.api_key or os.environ.get("STRATA_API_KEY")
    return StrataClient(_address(args), api_key=api_key, tls=tls)


def _rpc_failed(error: BaseException) -> int:
    import grpc

    if isinstance(error, grpc.Call):
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
    else:
        print(f"error: {error}", file=sys.stderr)
    return 1
