"""The command line every Strata service process shares: `--config`, `--announce-file`, exit codes.

`python -m services.tokenizer | services.worker | gateway` all parse the same options, log the same
way, read their settings once, and map failures to the same exit codes: 2 for settings that cannot
start the service (the message names the value and the fix), 1 for a service that started but could
not serve (a port in use, say), else what the service's own `serve` returns. This module must not
know any service's settings or servers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from strata.settings import DEFAULT_CONFIG, ServiceSettings, SettingsError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
S = TypeVar("S", bound=ServiceSettings)


def run_service(
    settings_cls: type[S],
    serve: Callable[[S, Path | None], Coroutine[Any, Any, int | None]],
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
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
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        settings = settings_cls.load(args.config, index=args.index if indexed else None)
        result = asyncio.run(serve(settings, args.announce_file))
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        log.error("%s could not start: %s", prog, exc)
        return 1
    return result or 0
