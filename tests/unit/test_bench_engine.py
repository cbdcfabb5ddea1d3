"""The engine benchmark: a smoke run on a tiny random model, and the rules' building blocks."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
import torch

from bench.ceiling import nominal_step_log
from bench.engine import main
from bench.engine_options import parse_args
from bench.provenance import schema_problems
from bench.stats import PARITY_TOP2_GAP, Reference, check_parity, make_prompts, summarize
from tests.parity import TIE_GAP

if TYPE_CHECKING:
    from pathlib import Path

REQUESTS, NEW_TOKENS = 4, 8


def test_smoke_run_checks_every_contestant_and_writes_the_record(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    argv = [
        "--random-weights", "tiny", "--requests", str(REQUESTS), "--prompt-tokens", "16",
        "--new-tokens", str(NEW_TOKENS), "--naive-requests", "2", "--runs", "1", "--smoke",
        # One thread: on a shared 2-core machine a busy neighbour stalls every OpenMP barrier.
        "--threads", "1", "--json", str(out),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads(out.read_text())

    for key in (
        "naive_tok_s", "hf_cb_tok_s", "engine_tok_s", "ceiling_tok_s", "naive_spread", "hf_cb_spread",
        "engine_spread", "engine_vs_ceiling", "engine_vs_hf_cb", "provenance", "config", "parity",
    ):  # fmt: skip
        assert key in record, key
    assert record["smoke"] is True
    assert record["valid"] is False, "a --smoke record must never pass as a result"
    parity = record["parity"]
    assert parity["ok"] is True
    # Warm-up plus one timed run, each checked against the reference.
    assert parity["naive"]["checked"] == 2 * 2
    assert parity["hf_cb"]["checked"] == 2 * REQUESTS
    assert parity["engine"]["checked"] == 2 * REQUESTS
    assert parity["engine_asyncio"]["checked"] == REQUESTS
    assert record["engine_steps"] >= NEW_TOKENS
    assert max(logits for _, logits in record["engine_step_log"]) == REQUESTS, "all admitted at once"
    assert record["hf_cb_all_admitted_at_once"] is True
    # Linear layers alone cannot be slower than a whole engine running them.
    assert record["ceiling_tok_s"] > record["engine_tok_s"]
    assert record["engine_asyncio"]["probe_ticks"] > 0
    low, high = record["engine_spread"]
    assert low <= record["engine_tok_s"] <= high
    assert record["provenance"]["machine"]["threads"] == 1 and schema_problems(record) == []


def test_fewer_than_three_runs_need_smoke(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--runs", "1", "--json", str(tmp_path / "x.json")])
    assert parse_args(["--runs", "1", "--smoke", "--json", str(tmp_path / "x.json")]).runs == 1


def test_tie_gap_is_the_parity_rules() -> None:
    assert PARITY_TOP2_GAP == TIE_GAP


def _reference() -> Reference:
    # Position 1 is a near tie (5e-4), position 2 an exact three-way tie, positions 0 and 3 are wide.
    return Reference(
        tokens=[[5, 6, 7, 2]],
        top_ids=[[[5, 9, 1], [6, 8, 4], [7, 3, 1], [2, 9, 8]]],
        top_logits=[[[2.0, 1.0, 0.0], [1.0, 0.9995, 0.5], [1.0, 1.0, 1.0], [3.0, 1.0, 0.0]]],
    )


@pytest.mark.parametrize(
    ("ours", "identical", "ties", "failures"),
    [
        ([5, 6, 7, 2], 1, 0, 0),  # identical
        ([5, 8, 0, 0], 0, 1, 0),  # diverges at a near tie to the runner-up; the rest is not compared
        ([5, 6, 1, 2], 0, 1, 0),  # picks the third of an exact three-way tie
        ([5, 4, 7, 2], 0, 0, 1),  # diverges at a near tie, but not to a tied token
        ([9, 6, 7, 2], 0, 0, 1),  # picks the runner-up where the gap is wide
        ([5, 6, 7], 0, 0, 1),  # too short: EOS must not have stopped it
    ],
)
def test_parity_rule(ours: list[int], identical: int, ties: int, failures: int) -> None:
    report = check_parity([ours], _reference())
    assert (report.checked, report.identical, report.tie_divergences) == (1, identical, ties)
    assert len(report.failures) == failures
    assert report.ok is (failures == 0)


def test_a_wider_gap_forgives_more() -> None:
    assert not check_parity([[9, 6, 7, 2]], _reference(), tolerance=0.5).ok
    assert check_parity([[9, 6, 7, 2]], _reference(), tolerance=1.5).ok


def test_prompts_are_seeded_and_avoid_special_ids() -> None:
    excluded = set(range(10))
    prompts = make_prompts(8, 32, 20, excluded, seed=3)
    assert prompts == make_prompts(8, 32, 20, excluded, seed=3)
    assert prompts != make_prompts(8, 32, 20, excluded, seed=4)
    assert all(len(p) == 32 and all(10 <= t < 20 for t in p) for p in prompts)


def test_nominal_schedule_covers_every_token() -> None:
    steps = nominal_step_log(num_requests=5, prompt_tokens=10, new_tokens=4, max_batched_tokens=16)
    assert sum(tokens for tokens, _ in steps) == 5 * 10 + 5 * 3
    assert sum(logits for _, logits in steps) == 5 * 4  # one logit row per generated token
    assert max(tokens for tokens, _ in steps) <= 16


def test_summarize_reports_median_and_spread() -> None:
    spread = summarize([3.0, 1.0, 2.0])
    assert (spread.median, spread.low, spread.high) == (2.0, 1.0, 3.0)
