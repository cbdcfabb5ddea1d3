"""The two tenants of `python -m bench.tenants` and what each of them sends.

A noisy tenant with long prompts (`--noisy-prompt-tokens`, 512) and a quiet one with short prompts
(`--quiet-prompt-tokens`, 32), of equal weight, each naming itself by its API key (call metadata
`authorization: Bearer <key>`, keys that exist only in the configs the benchmark writes). Each
offers its factor (`--noisy-factor` 5, `--quiet-factor` 0.3) times its own shape's measured capacity,
on its own seeded Poisson schedule of `--duration` seconds of arrivals; its requests are distinct
prompts of exactly its length (bench/stack_prompts.py), greedy with ignore_eos, interactive and
no_fallback (bench/rate.py's `rate_request`), so the primary alone serves them. This module builds
the tenants' settings, schedules and requests and describes them for the record; it must not send
anything nor start a stack (bench/tenant_run.py does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.rate import arrival_offsets, arrivals_per_phase, rate_request
from bench.stack_prompts import build_prompts
from strata.client import auth_metadata

if TYPE_CHECKING:
    import argparse

    from tokenizers import Tokenizer

    from bench.driver import Metadata
    from strata.v1 import gateway_pb2

TENANTS = ("noisy", "quiet")
API_KEYS = {"noisy": "bench-tenants-noisy", "quiet": "bench-tenants-quiet"}
WEIGHT = 1.0


def tenant_metadata(tenant: str) -> Metadata:
    """The call metadata that names `tenant` to the gateway."""
    return auth_metadata(API_KEYS[tenant])


def gateway_overrides(fair_queuing: bool) -> dict[str, Any]:
    """The gateway keys a contestant's config copy sets: the queue discipline and the two tenants."""
    tenants = [{"name": name, "api_keys": [API_KEYS[name]], "weight": WEIGHT} for name in TENANTS]
    return {"fair_queuing": fair_queuing, "tenants": tenants}


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, float]]:
    """Each tenant's prompt length and its offered rate as a multiple of that shape's capacity."""
    return {
        "noisy": (args.noisy_prompt_tokens, args.noisy_factor),
        "quiet": (args.quiet_prompt_tokens, args.quiet_factor),
    }


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's part of every phase: its key, prompt length, rate, schedule and requests."""

    name: str
    metadata: Metadata
    prompt_tokens: int
    rate_rps: float
    offsets: list[float]
    requests: list[gateway_pb2.GenerateRequest]


def build_requests(
    tokenizer: Tokenizer, args: argparse.Namespace, primary: str, tenant: str, count: int, tag: str
) -> list[gateway_pb2.GenerateRequest]:
    """`count` distinct requests of the tenant's shape, the same for the same seed and `tag`."""
    tokens = shapes(args)[tenant][0]
    prompts = build_prompts(tokenizer, count, tokens, f"{args.seed}/{tenant}/{tokens}/{tag}")
    return [
        rate_request(p, args.new_tokens, f"bench-tenants-{tenant}-{tag}-{i}", primary, fallback=False)
        for i, p in enumerate(prompts)
    ]


def build_load(
    tokenizer: Tokenizer, args: argparse.Namespace, primary: str, tenant: str, capacity_rps: float
) -> TenantLoad:
    """The tenant's schedule at its factor times `capacity_rps`, and one request per arrival."""
    tokens, factor = shapes(args)[tenant]
    rate = factor * capacity_rps
    count = arrivals_per_phase(rate, args.duration, None)
    return TenantLoad(
        name=tenant,
        metadata=tenant_metadata(tenant),
        prompt_tokens=tokens,
        rate_rps=rate,
        offsets=arrival_offsets(rate, count, "poisson", f"{args.seed}/{tenant}/arrivals"),
        requests=build_requests(tokenizer, args, primary, tenant, count, "phase"),
    )


def rates_record(
    args: argparse.Namespace, loads: list[TenantLoad], capacity: dict[str, Any]
) -> dict[str, Any]:
    """Each tenant's offered rate, the capacity it came from, its schedule and its offered token cost."""
    return {
        load.name: {
            "prompt_tokens": load.prompt_tokens,
            "capacity_rps": capacity["shapes"][load.name]["requests_per_s"],
            "factor": shapes(args)[load.name][1],
            "rate_rps": load.rate_rps,
            "arrivals_per_phase": len(load.offsets),
            "schedule_s": load.offsets[-1],
            "offered_cost_tok_s": load.rate_rps * (load.prompt_tokens + args.new_tokens),
        }
        for load in loads
    }


def tenants_record(args: argparse.Namespace) -> dict[str, Any]:
    """Each tenant's key, weight, prompt length and capacity factor."""
    return {
        name: {
            "api_key": API_KEYS[name],
            "weight": WEIGHT,
            "prompt_tokens": tokens,
            "capacity_factor": factor,
        }
        for name, (tokens, factor) in shapes(args).items()
    }
