"""bench.lora on a tiny random Llama: the adapters it makes are served, both engines alternate on both
workloads, the load test measures a load between steps, and the verdicts read the record's figures."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from bench.lora import main, verdicts

if TYPE_CHECKING:
    from pathlib import Path


def test_a_small_run_writes_a_record_whose_verdicts_read_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    argv = ["--model", str(tiny_llama_dir), "--adapters", "2", "--rank", "4", "--streams", "4"]
    argv += ["--load-streams", "2", "--prompt-tokens", "8", "--new-tokens", "24", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    many, one = record["many_streams"], record["one_stream"]
    assert (many["streams"], one["streams"]) == (4, 1)
    assert [len(many[side]["runs"]) for side in ("base", "adapters")] == [5, 5]
    assert all(run["tokens"] == 4 * 24 for run in many["adapters"]["runs"])
    stall = record["load_stall"]
    assert len(stall["load_ms"]["values"]) == 5 and stall["load_ms"]["low"] > 0
    assert stall["longest_gap_ms"]["low"] >= stall["load_ms"]["low"], "the gap holds the load"
    lines = verdicts(record)
    assert [line["met"] for line in lines] == [
        many["ratio"]["median"] >= 0.8,
        one["ratio"]["median"] >= 0.85,
        stall["longest_gap_steps"]["high"] <= 2.0,
    ]
    assert record["targets"] == lines
