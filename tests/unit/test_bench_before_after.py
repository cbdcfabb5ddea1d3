"""bench.before_after reads the right figures from a `strata bench` record and names each checkout's
commit; the bench runs themselves are `strata bench`'s (tests/unit/test_bench_stack.py)."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

import pytest

from bench.before_after import commit_of, figures, spread

if TYPE_CHECKING:
    from pathlib import Path


def _level(concurrency: int, tok_s: float, ttft_p50: float) -> dict[str, object]:
    return {"concurrency": concurrency, "output_tok_s": tok_s, "ttft_ms": {"p50": ttft_p50, "p99": 9e9}}


def test_figures_are_the_top_levels_throughput_and_the_single_streams_ttft() -> None:
    record = {"levels": [_level(1, 20.0, 150.0), _level(8, 90.0, 600.0), _level(64, 230.0, 2400.0)]}
    assert figures(record) == {"concurrency": 64, "output_tok_s": 230.0, "ttft_p50_ms_one_stream": 150.0}
    with pytest.raises(SystemExit, match="concurrency 1"):
        figures({"levels": [_level(64, 230.0, 2400.0)]})


def test_spread_is_the_median_and_the_range_of_the_rounds() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "spread": [1.0, 3.0], "rounds": [3.0, 1.0, 2.0]}


def test_commit_of_names_the_head_and_a_dirty_tree(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert commit_of(tmp_path) == ""
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert commit_of(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert commit_of(tmp_path) == f"{head}+dirty"
