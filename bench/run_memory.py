"""`python -m bench.run_memory`: the resident memory of `make run`'s whole stack, service by service.

It starts the stack of `--config` (default configs/local.yaml, what `make run` starts) through the
launcher, as `strata up` does, sends `--requests` greedy requests of `--new-tokens` tokens to its
default model so every service has served, then reads each service process's resident set
(/proc/PID/status VmRSS, and its high-water mark VmHWM) and its proportional share (PSS, from
/proc/PID/smaps_rollup: shared libraries counted once across the processes), and each worker's KV
cache as it reports it. It writes bench/results/run-memory-cpu.json. This module measures; it must
not change the config it starts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.stats import save_record

DEFAULT_CONFIG = Path("configs/local.yaml")
TARGET_BYTES = 3_000_000_000
"""What `make run` may hold in all, each page counted once (PSS)."""
PROMPT = "What is the capital of France?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run_memory", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and PSS of one process, in bytes."""
    fields: dict[str, int] = {}
    for path, keys in ((f"/proc/{pid}/status", ("VmRSS", "VmHWM")), (f"/proc/{pid}/smaps_rollup", ("Pss",))):
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in keys:
                fields[name.lower()] = int(value.split()[0]) * 1024
    return {"rss_bytes": fields["vmrss"], "hwm_bytes": fields["vmhwm"], "pss_bytes": fields["pss"]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from strata.cli.launcher import start_stack
    from strata.client import StrataClient

    with tempfile.TemporaryDirectory(prefix="strata-run-memory-") as logs:
        stack = start_stack(args.config, log_dir=Path(logs), ready_timeout_s=600)
        try:
            with StrataClient(stack.addresses.gateway) as client:
                for _ in range(args.requests):
                    client.generate(PROMPT, max_new_tokens=args.new_tokens, ignore_eos=True, timeout=120)
                models = {model.name: model for model in client.list_models(timeout=30).models}
            services = {name: process_memory(pid) for name, pid in stack.pids.items()}
            caches = {
                name: {
                    "kv_cache_bytes": m.memory.kv_cache_bytes,
                    "kv_tokens": m.memory.kv_tokens,
                    "sized_by": m.memory.sized_by,
                }
                for name, m in models.items()
            }
        finally:
            stack.stop(timeout=60)
    return {
        "services": services,
        "kv_caches": caches,
        "total_rss_bytes": sum(s["rss_bytes"] for s in services.values()),
        "total_pss_bytes": sum(s["pss_bytes"] for s in services.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.provenance import finish_provenance, start_provenance

    provenance = start_provenance()
    measured = measure(args)
    record = {
        "provenance": finish_provenance(provenance),
        # Memory only: no figure depends on the machine's load.
        "timed": False,
        "benchmark": "bench.run_memory",
        "config": str(args.config),
        "workload": {"requests": args.requests, "new_tokens": args.new_tokens},
        "target": {"total_pss_bytes": TARGET_BYTES, "met": measured["total_pss_bytes"] <= TARGET_BYTES},
        **measured,
    }
    save_record(record, args.json)
    for name, entry in measured["services"].items():
        print(
            f"{name:12} RSS {entry['rss_bytes'] / 2**20:7.0f} MiB  PSS {entry['pss_bytes'] / 2**20:7.0f} MiB"
        )
    rss, pss = measured["total_rss_bytes"] / 1e9, measured["total_pss_bytes"] / 1e9
    print(f"{'in all':12} RSS {rss:7.2f} GB   PSS {pss:7.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
