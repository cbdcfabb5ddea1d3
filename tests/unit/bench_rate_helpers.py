"""What both `strata bench --rate` test modules share: the model names, the request size and SLO the
fake results use, and one phase summarized with them.

Only data and one call into bench.rate_report; no tests and no assertions live here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.rate_report import summarize_phase

if TYPE_CHECKING:
    from bench.driver import RequestResult

PRIMARY, FALLBACK = "primary", "fallback"
NEW = 4
SLO_MS = 1000.0


def phase_summary(name: str, results: list[RequestResult], wall_s: float = 2.0) -> dict[str, Any]:
    """One phase's summary with the shared request size, SLO and primary."""
    return summarize_phase(
        results, phase=name, wall_s=wall_s, input_tokens=[8] * len(results), new_tokens=NEW,
        slo_ms=SLO_MS, primary=PRIMARY,
    )  # fmt: skip
