"""`python -m bench.rate_compare`: two `strata bench --rate` records compared rate by rate, every figure
read from them; and the rate plot, one column per rate. The records are built from fake results with
tests/unit/bench_rate_helpers.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from bench.plots import write_rate_plot
from bench.rate_compare import compare, main, rate_key
from tests.unit.bench_rate_helpers import FALLBACK, NEW, entry, failed, ok, record, refused

if TYPE_CHECKING:
    from pathlib import Path


def _served(count: int, itl_s: float) -> list[list[Any]]:
    """One round of `count` requests in time, each with inter-token gaps of `itl_s`."""
    return [[ok(i, 0.1, itl_s=[itl_s] * (NEW - 1)) for i in range(count)]]


def _records() -> tuple[dict[str, Any], dict[str, Any]]:
    before = record(
        [entry(4.0, _served(2, 0.020), _served(4, 0.020)), entry(8.0, _served(2, 0.010), _served(6, 0.010))],
        checkout={"tree": "/before", "commit": "1111111", "dirty": False},
    )
    after = record(
        [
            # At 4/s the change halved fallback-off goodput and slowed its tokens by half.
            entry(4.0, _served(1, 0.030), _served(4, 0.020)),
            entry(8.0, _served(2, 0.011), _served(6, 0.010)),
            entry(16.0, _served(1, 0.010), _served(1, 0.010)),
        ],
        checkout={"tree": "/after", "commit": "2222222", "dirty": True},
    )
    return before, after


def test_each_rate_in_both_is_compared_by_ratios_read_from_the_records() -> None:
    before, after = _records()
    result = compare(before, after)
    assert [rate["rate"] for rate in result["rates"]] == ["4", "8"]
    assert result["only_before"] == [] and result["only_after"] == ["16"]
    four, eight = result["rates"]
    assert four["off_goodput"]["before_tok_s"] == pytest.approx(2 * NEW / 2.0)
    assert four["off_goodput"]["after_tok_s"] == pytest.approx(NEW / 2.0)
    assert four["off_goodput"]["ratio"] == pytest.approx(0.5) and four["off_goodput"]["pass"] is False
    assert four["itl_p99"]["off"]["ratio"] == pytest.approx(1.5) and four["itl_p99"]["off"]["pass"] is False
    assert four["itl_p99"]["on"]["ratio"] == pytest.approx(1.0) and four["itl_p99"]["on"]["pass"] is True
    # The after record's own on/off goodput and its bound: 4 requests in time against 1.
    assert four["after_goodput_on_off"] == {"value": pytest.approx(4.0), "min": 1.5, "pass": True}
    assert four["pass"] is False
    assert eight["off_goodput"]["ratio"] == pytest.approx(1.0)
    assert eight["itl_p99"]["off"]["ratio"] == pytest.approx(1.1) and eight["itl_p99"]["off"]["pass"] is True
    assert eight["after_goodput_on_off"]["value"] == pytest.approx(3.0) and eight["pass"] is True
    assert result["pass"] is False


def test_auto_rates_match_each_other_whatever_capacity_each_run_measured() -> None:
    assert rate_key({"rate_source": "auto: 2 x capacity", "rate_rps": 13.7}) == "auto"
    assert rate_key({"rate_source": "--rate", "rate_rps": 14.0}) == "14"
    old = record([entry(13.7, _served(2, 0.02), _served(4, 0.02), source="auto: 2 x capacity")])
    new = record([entry(15.1, _served(2, 0.02), _served(4, 0.02), source="auto: 2 x capacity")])
    rates = compare(old, new)["rates"]
    assert len(rates) == 1 and rates[0]["rate_rps"] == {"before": 13.7, "after": 15.1}


def test_the_command_writes_the_comparison_with_both_commits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = _records()
    paths = {name: tmp_path / f"{name}.json" for name in ("before", "after")}
    for name, data in (("before", before), ("after", after)):
        paths[name].write_text(json.dumps(data))
    out = tmp_path / "compare" / "out.json"
    assert main([str(paths["before"]), str(paths["after"]), "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["before"]["commit"] == "1111111" and written["after"]["commit"] == "2222222"
    assert written["after"]["dirty"] is True and written["targets"]["off_goodput_ratio_min"] == 0.9
    assert [rate["rate"] for rate in written["rates"]] == ["4", "8"]
    text = capsys.readouterr().out
    assert "2222222+dirty" in text and "0.50 FAIL" in text and "1.50 FAIL" in text
    assert "only in after: 16" in text and "all compared rates: FAIL" in text
    # A record of another benchmark, or of the older one-rate shape, is refused.
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps({"benchmark": "strata bench --rate", "phases": {}}))
    with pytest.raises(SystemExit, match="no `strata bench --rate` record"):
        main([str(stale), str(paths["after"])])
    # No rate in common: nothing was compared.
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps(record([entry(32.0, _served(1, 0.01), _served(1, 0.01))])))
    assert main([str(lone), str(paths["before"])]) == 1


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
