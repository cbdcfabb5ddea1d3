"""The command line every Strata service process shares: `--config`, `--announce-file`, exit codes.

`python -m services.tokenizer | services.worker | gateway` all parse the same options, read their
settings once, start the same telemetry (log format, /metrics endpoint, tracing: strata.telemetry),
and map failures to the same exit codes: 2 for settings that cannot start the service (the message
names the value and the fix), 1 for a service that started but could not serve (a port in use, say),
else what the service's own `serve` returns. This module must not
know any service's settings or servers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from strata import telemetry
from strata.settings import DEFAULT_CONFIG, ServiceSettings, SettingsError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from strata.tracing import Tracing

log = logging.getLogger(__name__)
S = TypeVar("S", bound=ServiceSettings)


def run_service(
    settings_cls: type[S],
    serve: Callable[[S, Path | None, Tracing], Coroutine[Any, Any, int | None]],
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    service_name: str,
    indexed: bool = False,
) -> int:
    """Parse the options, load the settings, run `serve` until it returns; the process exit code."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help=f"the stack's YAML config; its `{settings_cls.section}` section is read",
    )
    if indexed:
        parser.add_argument("--index", type=int, default=0, help=f"which entry of `{settings_cls.section}`")
    parser.add_argument(
        "--announce-file", type=Path, default=None, help="write the bound host:port here once listening"
    )
    args = parser.parse_args(argv)
    telemetry.configure_logging("text")  # until the settings say otherwise
    started: telemetry.Telemetry | None = None
    try:
        settings = settings_cls.load(args.config, index=args.index if indexed else None)
        started = telemetry.start(settings.telemetry, service_name, args.announce_file)
        result = asyncio.run(serve(settings, args.announce_file, started.tracing))
    except SettingsError as exc:  # also a value only checked at start (a model folder, say)
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        log.error("%s could not start: %s", prog, exc)
        return 1
    finally:
        if started is not None:
            started.close()
    return result or 0
