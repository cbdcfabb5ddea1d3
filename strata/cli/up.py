"""`strata up`: the whole stack in the foreground, supervised, until Ctrl-C or SIGTERM.

It fetches the default model when the default config needs it, starts the stack (launcher.py), prints
where every service listens, and then keeps it serving: a service that ends is started again by the
Supervisor (supervisor.py), which prints a line when a service goes down and when it is back, and
whose counters are served at `--metrics-listen`. With `--exit-on-failure` a service that ends stops
the whole stack instead (exit 1), for scripts that want a dead stack to be loud. Ctrl-C or SIGTERM
stops the stack in order (exit 0). This module must not start processes itself nor decide restarts.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse
    from typing import TypeAlias

    from strata.cli.launcher import Stack

    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXAMPLE_PROMPT = "What is the capital of France?"
DEFAULT_METRICS_LISTEN = "127.0.0.1:0"
_POLL_S = 0.2


def strata_command() -> str:
    """`strata` when the shell finds this very command, else its path (a venv that is not activated)."""
    here = Path(sys.argv[0]).resolve()
    found = shutil.which("strata")
    if found is not None and Path(found).resolve() == here:
        return "strata"
    if here.name != "strata":  # run as `python -m strata.cli`
        return f"{sys.executable} -m strata.cli"
    cwd = Path.cwd()
    return str(here.relative_to(cwd)) if here.is_relative_to(cwd) else str(here)


def _print_ready(stack: Stack, supervisor_metrics: str) -> None:
    from strata.client import DEFAULT_ADDRESS

    addresses = stack.addresses
    print(f"strata up: the stack is ready ({stack.config_path})")
    print(f"  gateway    {addresses.gateway}")
    for address in stack.http_addresses.values():
        print(f"  http       http://{address}/v1  (OpenAI-compatible)")
    print(f"  tokenizer  {addresses.tokenizer}")
    for index, (address, model) in enumerate(zip(addresses.workers, stack.worker_models, strict=True)):
        print(f"  worker {index:<3} {address}  ({model})")
    metrics = dict(stack.metrics_addresses)
    if supervisor_metrics:
        metrics["strata up"] = supervisor_metrics
    for name, address in metrics.items():
        print(f"  metrics    {name:<10} http://{address}/metrics")
    target = "" if addresses.gateway == DEFAULT_ADDRESS else f" --address {addresses.gateway}"
    print(f'try: {strata_command()} generate "{EXAMPLE_PROMPT}" --chat{target}')
    print("Ctrl-C stops the stack.", flush=True)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(stack: Stack, stopping: threading.Event, exit_on_failure: bool) -> int:
    """Until `stopping`: supervise (or, with exit_on_failure, stop at the first exit); the exit status."""
    from strata.cli.supervisor import Supervisor

    if exit_on_failure:
        while (ended := stack.wait(_POLL_S)) is None and not stopping.is_set():
            pass
        if ended is None:
            return 0
        print(f"strata up: {ended}; stopping the stack", file=sys.stderr)
        return 1
    supervisor = Supervisor(stack.children, stack.restart, report=_report)
    while not stopping.wait(_POLL_S):
        supervisor.tick()
        if supervisor.all_given_up:
            print("strata up: every service was given up; stopping", file=sys.stderr)
            return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    from strata.cli.launcher import READY_TIMEOUT_S, StackError, start_stack
    from strata.cli.supervisor import serve_metrics
    from strata.settings import DEFAULT_CONFIG, SettingsError

    config = (args.config or DEFAULT_CONFIG).resolve()
    from strata.cli.model_fetch import ModelFetchError, ensure_models
    from strata.cli.stack_config import model_paths

    try:
        # Models of fetch-model's table that the config names are fetched now (a no-op once done).
        ensure_models(model_paths(config))
    except SettingsError as exc:
        print(f"strata up: error: {exc}", file=sys.stderr)
        return 1
    except ModelFetchError as exc:
        print(
            f"strata up: error: a model of {config} is missing and could not be fetched: {exc}",
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
        metrics = serve_metrics(args.metrics_listen) if args.metrics_listen else ""
        _print_ready(stack, metrics)
        status = _run(stack, stopping, args.exit_on_failure)
        if status == 0:
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


def add_up(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the whole stack (tokenizer, workers, gateway) until Ctrl-C",
        description=(
            "Start the tokenizer service, every worker of the config and then the gateway, each as its "
            "own process with its output in this terminal; print their addresses and keep them serving: "
            "a service that ends is started again on the same address (backoff from 0.5 s to 30 s; one "
            "that ends 5 times within 60 s is given up). Ctrl-C or SIGTERM stops them (exit 0). With "
            "the default config, the default model is fetched first when missing."
        ),
    )
    parser.add_argument("--config", type=Path, help="stack config (default: configs/local.yaml)")
    parser.add_argument(
        "--ready-timeout", type=float, help="seconds to wait for the services to be ready (default: 600)"
    )
    parser.add_argument(
        "--exit-on-failure",
        action="store_true",
        help="a service that ends stops the whole stack (exit 1) instead of being started again",
    )
    parser.add_argument(
        "--metrics-listen",
        default=DEFAULT_METRICS_LISTEN,
        help="host:port of the supervisor's /metrics (restarts, services up); empty: none "
        "(default: %(default)s, a free port)",
    )
    parser.set_defaults(handler=_up)
