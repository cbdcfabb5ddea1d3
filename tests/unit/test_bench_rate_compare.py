"""The `strata bench --rate` plot, one column per rate. The records are built from fake results with
tests/unit/bench_rate_helpers.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.plots import write_rate_plot
from tests.unit.bench_rate_helpers import FALLBACK, entry, failed, ok, record, refused

if TYPE_CHECKING:
    from pathlib import Path


def test_the_rate_plot_is_one_png_with_a_column_per_rate(tmp_path: Path) -> None:
    fast = entry(
        4.0,
        [[ok(0, 0.1), refused(1, "queue full", 0.001), refused(2, "token budget", 0.002)]],
        [[ok(0, 0.1), ok(1, 0.9, model=FALLBACK, fallback_reason="primary saturated")]],
    )
    # A miss on the primary with fallback on: its p99 is infinite, drawn as such.
    slow = entry(
        8.0, [[ok(0, 0.1), refused(1, "queue full", 0.001)]], [[ok(0, 0.1), failed(1, "UNAVAILABLE", 1.0)]]
    )
    path = tmp_path / "plots" / "rate.png"
    write_rate_plot(record([fast, slow]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    one = tmp_path / "one.png"
    write_rate_plot(record([fast]), one)
    # Two columns are wider than one: the figure grows with the rates.
    assert _png_width(path) > _png_width(one)


def _png_width(path: Path) -> int:
    """The width in the PNG's IHDR chunk (bytes 16-20, big-endian)."""
    return int.from_bytes(path.read_bytes()[16:20], "big")
