"""The container tests run only under `make compose-test`, which builds the images first and sets
STRATA_CONTAINER_TESTS=1; `make test` collects them and skips them with that reason (they need a
Docker Engine, the built images and minutes of a machine's time)."""

from __future__ import annotations

import os

import pytest

ENABLE_ENV = "STRATA_CONTAINER_TESTS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(ENABLE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"container tests run by `make compose-test` ({ENABLE_ENV}=1)")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
