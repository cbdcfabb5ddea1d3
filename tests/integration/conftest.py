"""Stacks that several integration test modules share, each started once per module that asks for it.

`gateway_env`: the tokenizer service, one worker and one gateway of gateway_harness.py, with blocking
clients; `http_stack`: the gateway with its HTTP API of http_harness.py, at that module's defaults.
Both serve the tiny model. A module whose stack differs (another model, tracing, slower steps)
starts its own from the same harness instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.integration.gateway_harness import Env, Stack
from tests.integration.http_harness import HttpStack

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="module")
def gateway_env(tiny_serving_dir: Path) -> Iterator[Env]:
    with Stack(tiny_serving_dir) as stack:
        tokenizer = stack.start_tokenizer()
        worker = stack.start_worker(tiny_serving_dir)
        gateway = stack.start_gateway(tokenizer, worker)
        yield Env(stack, gateway, tokenizer, worker)


@pytest.fixture(scope="module")
def http_stack(tiny_serving_dir: Path) -> Iterator[HttpStack]:
    with HttpStack(tiny_serving_dir) as stack:
        yield stack
