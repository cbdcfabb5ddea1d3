"""One tenant floods the gateway with connections and streams: does another tenant keep its promise?

    python -m bench.flood [--connections 2000] [--streams 10000] [--runs 3] [--json PATH]   (make bench-flood)

The default stack (`--config`, each phase a fresh one in child processes) with API keys on: two
tenants of equal weight, `flood` and `quiet`. Once its `--connections` HTTP/2 connections are open,
the flood tenant starts `--streams` GenerateStream calls over them at once (bench/flood_load.py, a
process of its own), each a `--flood-prompt-tokens` (32) prompt asking `--flood-tokens` (256), and keeps
each open: a refused one is sent again after its retry hint (backing off), an ended one at once. When
the flood holds every running slot of the primary (its strata_requests_running gauge at its
max_num_seqs), the quiet tenant sends `--quiet-requests` (16)
streaming requests, one every `--quiet-gap` (0.5) s, of `--quiet-prompt-tokens` (32) and
`--quiet-tokens` (16) new tokens. Every request is greedy with EOS ignored, interactive and no_fallback:
the primary alone serves them. Three contestants alternate over `--runs` rounds, the order reversed
every other round: `fair` (the gateway as configured: fair queuing, a tenant below its share favoured
on the worker, which preempts for it, and the route's credit reserve), `fair, no reserve` (the same
with every route's fair_reserve_share 0: what the reserve adds) and `fifo` (fair_queuing false: first
come, first served, nobody favoured). Per phase: the
quiet requests' TTFT and refusals, the flood's calls by outcome, the time its refusals took inside the
gateway (each one's strata-elapsed-ms trailer; and the admission decision histogram's p99 bucket), and
the gateway's resident memory before the flood, at its peak and once the flood's connections closed.
Targets, for `fair` over every round's requests together: the quiet tenant's TTFT p99 within the
route's TTFT SLO, none of its requests refused, and the flood's refusals p99 within 50 ms inside the
gateway. This module runs and records; it must not change a service's code.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.config_copy import write_config
from bench.driver import send
from bench.flood_load import start_flood
from bench.gateway_metrics import bucket_delta, decision_summary, fetch_metrics, scrape_decisions
from bench.provenance import start_provenance
from bench.rate import rate_request
from bench.rate_target import primary_worker, route_slo_ms
from bench.session import BenchError, gateway, spawned
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import percentile, print_targets, save_record
from strata.client import auth_metadata
from strata.rpc import MIB
from strata.settings import DEFAULT_CONFIG, read_config

CONTESTANTS: dict[str, tuple[bool, float | None]] = {
    "fair": (True, None),
    "fair, no reserve": (True, 0.0),
    "fifo": (False, None),
}
"""Each contestant's gateway fair_queuing, and its routes' fair_reserve_share (None: the config's)."""
KEYS = {"flood": "bench-flood-flood", "quiet": "bench-flood-quiet"}
TARGET_REFUSAL_P99_MS = 50.0
RSS_SAMPLE_S = 0.2
FILL_TIMEOUT_S = 300.0
"""How long the flood may take to hold every running slot of the primary before the round fails."""
FILL_POLL_S = 0.5
WORKLOAD_KEYS = (
    "connections", "streams", "flood_prompt_tokens", "flood_tokens", "quiet_requests", "quiet_gap",
    "quiet_prompt_tokens", "quiet_tokens", "runs",
)  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=10000)
    parser.add_argument("--flood-prompt-tokens", type=int, default=32)
    parser.add_argument("--flood-tokens", type=int, default=256)
    parser.add_argument("--quiet-requests", type=int, default=16)
    parser.add_argument("--quiet-gap", type=float, default=0.5, help="seconds between quiet requests")
    parser.add_argument("--quiet-prompt-tokens", type=int, default=32)
    parser.add_argument("--quiet-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.connections < 1 or args.streams < args.connections:
        parser.error("--runs and --connections must be >= 1, and --streams at least --connections")
    return args


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


class _RssPeak:
    """The highest resident memory of a process, sampled every RSS_SAMPLE_S from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.peak = max(self.peak, _rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss(self.pid))


async def _full(metrics: str, model: str, slots: int) -> float:
    """Seconds until the worker at `metrics` runs `slots` requests of `model`; BenchError past
    FILL_TIMEOUT_S."""
    started = time.perf_counter()
    while time.perf_counter() - started < FILL_TIMEOUT_S:
        text = await asyncio.to_thread(fetch_metrics, metrics)
        for family in text_string_to_metric_families(text):
            if family.name == "strata_requests_running":
                running = sum(x.value for x in family.samples if x.labels.get("model") == model)
                if running >= slots:
                    return time.perf_counter() - started
        await asyncio.sleep(FILL_POLL_S)
    raise BenchError(f"the flood did not fill the primary's {slots} running slots in {FILL_TIMEOUT_S:g} s")


async def _phase(args: argparse.Namespace, config: Path, model: str, setup: dict[str, Any]) -> dict[str, Any]:
    with spawned(config, config.parent / "logs") as endpoints:
        quiet = auth_metadata(KEYS["quiet"])
        async with gateway(endpoints.gateway, quiet) as (stub, _):
            for index, prompt in enumerate(setup["warm"]):  # untimed: links connect, steps get measured
                warm = rate_request(prompt, 8, f"warm-{index}", model, fallback=False)
                await send(stub, index, warm, args.timeout, metadata=quiet)
            pid = endpoints.pids["gateway"]
            rss_before = _rss(pid)
            metrics = endpoints.gateway_metrics
            decisions = await scrape_decisions(metrics) if metrics else None
            flood_request = rate_request(setup["flood"], args.flood_tokens, "", model, fallback=False)
            process, pipe = start_flood(
                endpoints.gateway, args.connections, args.streams, flood_request, auth_metadata(KEYS["flood"])
            )
            try:
                await asyncio.to_thread(pipe.recv)  # "connected"
                peak = _RssPeak(pid)
                pipe.send("go")
                await asyncio.to_thread(pipe.recv)  # "launched"
                fill_s = await _full(endpoints.metrics[setup["primary"]], model, setup["slots"])
                start = time.perf_counter()
                requests = [
                    rate_request(p, args.quiet_tokens, f"quiet-{i}", model, fallback=False)
                    for i, p in enumerate(setup["quiet"])
                ]
                results = await asyncio.gather(
                    *(
                        _at(due, send(stub, i, request, args.timeout, due=due, metadata=quiet))
                        for i, request in enumerate(requests)
                        for due in [start + i * args.quiet_gap]
                    )
                )
                pipe.send("stop")
                outcome = await asyncio.to_thread(pipe.recv)
            finally:
                process.join(60)
            rss_peak = peak.stop()
            rss_after = _rss(pid)
            delta = bucket_delta(decisions, await scrape_decisions(metrics)) if decisions and metrics else {}
    ttfts = [r.ttft_s for r in results if r.status == "OK" and r.ttft_s is not None]
    return {
        "quiet": {
            "ttft_s": ttfts,
            "statuses": [r.status for r in results],
            "refused": [r.message for r in results if r.status != "OK"],
        },
        "flood": {
            "admitted": outcome.admitted,
            "statuses": outcome.statuses,
            "calls": outcome.calls,
            "connect_s": outcome.connect_s,
            "launch_s": outcome.launch_s,
            "fill_s": fill_s,
            "refusal_gateway_ms_p99": _p99_ms(outcome.refusal_gateway_s),
            "refusal_client_ms_p99": _p99_ms(outcome.refusal_client_s),
            "refusal_gateway_s": outcome.refusal_gateway_s,
        },
        "admission_decisions": decision_summary(delta) if delta else None,
        "gateway_rss_mib": {
            "before": rss_before / MIB,
            "peak": rss_peak / MIB,
            "after": rss_after / MIB,
        },
    }


async def _at(when: float, call: Any) -> Any:
    """`call` awaited at `when` (time.perf_counter()): the quiet tenant's schedule."""
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    return await call


def _p99_ms(values: list[float]) -> float | None:
    return 1000.0 * percentile(values, 99) if values else None


def contestant_summary(rounds: list[dict[str, Any]], contestant: str) -> dict[str, Any]:
    """One contestant over its rounds, every round's requests together: the quiet tenant's TTFT p99,
    requests sent and refused, the flood's refusals' p99 inside the gateway and at the client, its
    calls by outcome and the gateway's RSS (medians of the rounds)."""
    mine = [r for r in rounds if r["contestant"] == contestant]
    outcomes: dict[str, list[int]] = {}
    for r in mine:
        for status, count in r["flood"]["statuses"].items():
            outcomes.setdefault(status, []).append(count)
    rss = {
        key: statistics.median(r["gateway_rss_mib"][key] for r in mine) for key in ("before", "peak", "after")
    }
    return {
        "rounds": len(mine),
        "quiet_ttft_p99_ms": _p99_ms([t for r in mine for t in r["quiet"]["ttft_s"]]),
        "quiet_sent": sum(len(r["quiet"]["statuses"]) for r in mine),
        "quiet_refused": sum(len(r["quiet"]["refused"]) for r in mine),
        "flood_refusal_gateway_p99_ms": _p99_ms([t for r in mine for t in r["flood"]["refusal_gateway_s"]]),
        "flood_refusal_client_p99_ms": statistics.median(
            r["flood"]["refusal_client_ms_p99"] or 0.0 for r in mine
        ),
        "flood_calls_median": statistics.median(r["flood"]["calls"] for r in mine),
        "flood_outcomes_median": {
            status: statistics.median(counts) for status, counts in sorted(outcomes.items())
        },
        "gateway_rss_mib_median": rss,
    }


def _targets(rounds: list[dict[str, Any]], slo_ms: float) -> list[dict[str, Any]]:
    product = contestant_summary(rounds, "fair")
    ttft_p99 = product["quiet_ttft_p99_ms"]
    refused = product["quiet_refused"]
    refusal_p99 = product["flood_refusal_gateway_p99_ms"]
    return [
        {
            "target": f"quiet TTFT p99 <= the SLO {slo_ms:g} ms",
            "figure": f"{ttft_p99:.0f} ms" if ttft_p99 is not None else "none",
            "met": ttft_p99 is not None and ttft_p99 <= slo_ms,
        },
        {"target": "no quiet request refused", "figure": f"{refused} refused", "met": refused == 0},
        {
            "target": f"flood refusals p99 <= {TARGET_REFUSAL_P99_MS:g} ms inside the gateway",
            "figure": f"{refusal_p99:.1f} ms" if refusal_p99 is not None else "none",
            "met": refusal_p99 is not None and refusal_p99 <= TARGET_REFUSAL_P99_MS,
        },
    ]


def _compact(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds as the record keeps them: each refusal's time in the gateway (tens of thousands a
    round) pooled into the contestants' p99 already, so a round keeps their count and p99 only."""
    kept = []
    for r in rounds:
        flood = {key: value for key, value in r["flood"].items() if key != "refusal_gateway_s"}
        flood["refusals_timed_in_gateway"] = len(r["flood"]["refusal_gateway_s"])
        kept.append({**r, "flood": flood})
    return kept


def _copy(args: argparse.Namespace, directory: Path, contestant: str) -> tuple[Path, str]:
    """The contestant's config copy (the two tenants, its fair_queuing) and the primary's model."""
    section = read_config(args.config.resolve()).get("gateway") or {}
    routes = [dict(route) for route in section.get("routes") or []]
    if not routes:
        raise BenchError(f"{args.config} has no gateway routes to flood")
    tenants = [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]
    folder = directory / contestant.replace(", ", "-").replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    fair, reserve = CONTESTANTS[contestant]
    if reserve is not None:
        routes = [{**route, "fair_reserve_share": reserve} for route in routes]
    overrides = {"tenants": tenants, "fair_queuing": fair, "routes": routes}
    config = write_config(args.config, folder, "stack", {"gateway": overrides})
    return config, str(routes[0]["model"])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    directory = Path(tempfile.mkdtemp(prefix="strata-bench-flood-"))
    copies = {name: _copy(args, directory, name) for name in CONTESTANTS}
    model = copies["fair"][1]
    worker = primary_worker(args.config.resolve(), model)
    workers = read_config(args.config.resolve()).get("workers") or []
    index = next((i for i, w in enumerate(workers) if w.get("model_name") == model), None)
    if worker is None or index is None:
        raise BenchError(f"{args.config} has no worker for the route {model!r}")
    slo_ms, slo_source = route_slo_ms(args.config.resolve(), model)
    tokenizer = load_tokenizer(worker.model_path)
    setup = {
        "primary": f"worker {index}",
        "slots": worker.engine.max_num_seqs,
        "warm": build_prompts(tokenizer, 4, args.quiet_prompt_tokens, "flood/warm"),
        "flood": build_prompts(tokenizer, 1, args.flood_prompt_tokens, "flood/flood")[0],
        "quiet": build_prompts(tokenizer, args.quiet_requests, args.quiet_prompt_tokens, "flood/quiet"),
    }
    provenance = start_provenance()
    rounds = []
    for run in range(args.runs):
        order = list(CONTESTANTS) if run % 2 == 0 else list(reversed(CONTESTANTS))
        for contestant in order:
            config, _ = copies[contestant]
            print(f"bench.flood: round {run + 1}/{args.runs}, {contestant}", file=sys.stderr, flush=True)
            phase = asyncio.run(_phase(args, config, model, setup))
            rounds.append({"round": run + 1, "contestant": contestant, **phase})
    record = {
        "provenance": provenance,
        "benchmark": "flood",
        "workload": {key: getattr(args, key) for key in WORKLOAD_KEYS},
        "model": model,
        "ttft_slo_ms": slo_ms,
        "ttft_slo_source": slo_source,
        "contestants": {name: contestant_summary(rounds, name) for name in CONTESTANTS},
        "targets": _targets(rounds, slo_ms),
        "rounds": _compact(rounds),
    }
    save_record(record, args.json)
    print_targets("bench.flood", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
