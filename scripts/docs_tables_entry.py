"""A catalogued record's entry (what its figures depend on, its run time, its command and target) and
the shapes of the commands the catalog names, for docs_tables_catalog.py.

This module must not run anything or read records.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE = ("services/worker/",)
KERNELS = ("services/worker/model/",)
STACK = ("gateway/", "services/", "strata/", "configs/local.yaml")
GATEWAY = ("gateway/", "strata/")


@dataclass(frozen=True)
class Entry:
    """One record's entry in docs_tables_catalog.CATALOG."""

    paths: tuple[str, ...]
    """What its figures depend on, besides its own benchmark module."""
    bench: str
    """Its benchmark's module (bench/X.py) or script."""
    estimate_s: int
    """Seconds a run takes here: a `make records` record's last whole run (bench/results/records-run.json)
    plus 30% for these machines' swings; for the others, their last run or a guess."""
    command: tuple[str, ...]
    """Used only when the record's provenance names no command."""
    target: str = "make records"

    @property
    def depends_on(self) -> tuple[str, ...]:
        return (*self.paths, self.bench)


DROPPED = "none: a dropped lever's record (its script is at the record's commit)"
"""The target of a lever measured and dropped: the record and its row stay, its script left with it."""


def py(module: str, *args: str) -> tuple[str, ...]:
    """`python -m module args`."""
    return ("python", "-m", module, *args)


def spawn(*args: str) -> tuple[str, ...]:
    """`strata bench --spawn args`, run from a checkout (bench/ is not installed)."""
    return ("python", "-m", "strata.cli", "bench", "--spawn", *args)


def out(name: str) -> tuple[str, ...]:
    """The option that writes the record `name` under bench/results/."""
    return ("--json", f"bench/results/{name}")
