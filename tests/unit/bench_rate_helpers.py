"""What the `strata bench --rate` test modules share: the model names, the request size and SLO the
fake results use, builders of fake results, a phase summarized with them, a rate entry and a record.

Only data and calls into bench.rate_phase and bench.rate_report; no tests and no assertions live here.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from bench.driver import RequestResult
from bench.options import resolve
from bench.provenance import start_provenance
from bench.rate_phase import aggregate_phase, summarize_phase
from bench.rate_report import build_rate_record, rate_entry
from bench.stack import add_arguments

if TYPE_CHECKING:
    from bench.gateway_metrics import Buckets

PRIMARY, FALLBACK = "primary", "fallback"
NEW = 4
SLO_MS = 1000.0
CHECKOUT = {"tree": "/src", "commit": "abc123", "dirty": False}


def ok(index: int, ttft_s: float, model: str = PRIMARY, tokens: int = NEW, **extra: Any) -> RequestResult:
    """A completed request: `tokens` tokens, the first after `ttft_s`, served by `model`."""
    fields: dict[str, Any] = {"usage_input_tokens": 8, "usage_output_tokens": NEW, **extra}
    return RequestResult(
        index=index, send_lag_s=0.001 * index, status="OK", ttft_s=ttft_s, e2e_s=ttft_s + 0.1,
        token_ids=list(range(tokens)), model=model, **fields,
    )  # fmt: skip


def refused(index: int, message: str, decision_s: float, hint: float | None = 1.0) -> RequestResult:
    """A RESOURCE_EXHAUSTED answer `decision_s` after the send, no token."""
    return RequestResult(
        index=index, send_lag_s=0.0, status="RESOURCE_EXHAUSTED", ttft_s=None, e2e_s=decision_s,
        message=message, retry_hint_s=hint,
    )  # fmt: skip


def failed(index: int, status: str, e2e_s: float, message: str = "", **extra: Any) -> RequestResult:
    """A call that ended with `status` after `e2e_s`, by default before any token."""
    fields: dict[str, Any] = {"ttft_s": None, **extra}
    return RequestResult(index=index, status=status, e2e_s=e2e_s, message=message, **fields)


def phase_summary(
    name: str, results: list[RequestResult], wall_s: float = 2.0, decisions: dict[str, Buckets] | None = None
) -> dict[str, Any]:
    """One phase's summary with the shared request size, SLO and primary."""
    return summarize_phase(
        results, phase=name, wall_s=wall_s, input_tokens=[8] * len(results), new_tokens=NEW,
        slo_ms=SLO_MS, primary=PRIMARY, decisions=decisions,
    )  # fmt: skip


def entry(
    rate: float,
    off: list[list[RequestResult]],
    on: list[list[RequestResult]],
    decisions: dict[str, Buckets] | None = None,
    source: str = "--rate",
) -> dict[str, Any]:
    """A rate's entry from the rounds' results per phase (the same `decisions` for every phase)."""
    phases = {
        name: aggregate_phase([phase_summary(name, results, decisions=decisions) for results in rounds])
        for name, rounds in (("off", off), ("on", on))
    }
    offsets = [index / rate for index in range(len(off[0]))]
    return rate_entry(rate_rps=rate, rate_source=source, offsets=offsets, phases=phases, slo_ms=SLO_MS)


def parse(*argv: str) -> argparse.Namespace:
    """`strata bench`'s options as its parser reads them, not resolved."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def record(rates: list[dict[str, Any]], *argv: str, checkout: dict[str, Any] | None = None) -> dict[str, Any]:
    """A smoke record of these rate entries, as bench.rate_report builds it."""
    args = parse("--rate", ",".join(f"{e['rate_rps']:g}" for e in rates), "--smoke", *argv)
    if resolve(args) is not None:
        raise ValueError(f"bad options {argv}")
    workload = {
        "model": PRIMARY, "fallback_model": FALLBACK, "prompt_tokens": 8, "new_tokens": NEW,
        "arrival": "poisson", "ttft_slo_ms": SLO_MS,
    }  # fmt: skip
    return build_rate_record(
        args, checkout=checkout or CHECKOUT, stack={}, provenance=start_provenance(),

        workload=workload, capacity=None, rates=rates,
    )  # fmt: skip
