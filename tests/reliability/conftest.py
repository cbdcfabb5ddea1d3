"""Fixtures of the reliability suite: choosing the short or full run (measured figures are recorded
through the `figure` fixture of tests/figures.py).

`full` is True under STRATA_RELIABILITY_FULL=1, the long versions `make reliability` runs; CI runs the
short ones. This module must not start services nor assert anything about them.
"""

from __future__ import annotations

import os

import pytest

FULL_ENV = "STRATA_RELIABILITY_FULL"


@pytest.fixture(scope="session")
def full() -> bool:
    """True for the full versions of the scenarios (STRATA_RELIABILITY_FULL=1), else the short CI ones."""
    return os.environ.get(FULL_ENV, "") == "1"
