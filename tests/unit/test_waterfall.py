"""The `--timing` waterfall: rows, bar placement and length on the time axis, the TTFT mark, colour."""

from __future__ import annotations

import re

import pytest

from strata.cli.waterfall import RULER_START, STAGE_COLORS, TTFT_MARK, render_waterfall
from strata.v1 import common_pb2

STAGES = ("network", "preprocess", "queue", "forward", "decode")
EIGHTHS = " ▏▎▍▌▋▊▉█"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _timing(
    network: float = 1.2,
    preprocess: float = 3.4,
    queue: float = 0.5,
    forward: float = 50.0,
    decode: float = 6.6,
    ttft: float = 20.1,
    total: float | None = None,
) -> common_pb2.Timing:
    parts_sum = network + preprocess + queue + forward + decode
    return common_pb2.Timing(
        network_ms=network,
        preprocess_ms=preprocess,
        queue_ms=queue,
        forward_ms=forward,
        decode_ms=decode,
        time_to_first_token_ms=ttft,
        total_ms=parts_sum if total is None else total,
    )


def _rows(text: str) -> dict[str, str]:
    return {line.split()[0]: line for line in ANSI.sub("", text).splitlines()}


def _bar(text: str, stage: str) -> tuple[int, int]:
    """A row's bar as (start cell, length in eighths of a cell) on the axis the total row's ruler begins."""
    rows = _rows(text)
    origin = rows["total"].index(RULER_START)
    bar = rows[stage][origin:]
    body = bar.lstrip(" ")
    assert set(body) <= set(EIGHTHS[1:]), bar
    assert all(char == "█" for char in body[:-1]), bar
    length8 = 8 * (len(body) - 1) + EIGHTHS.index(body[-1]) if body else 0
    return len(bar) - len(body), length8


def test_rows_come_in_the_order_the_request_meets_them_with_their_values() -> None:
    text = render_waterfall(_timing(), trace_id="")
    names = [line.split()[0] for line in text.splitlines()]
    assert names == [*STAGES, "TTFT", "total"]
    rows = _rows(text)
    for stage, ms, share in [
        ("network", "1.2", "1.9%"),
        ("preprocess", "3.4", "5.5%"),
        ("queue", "0.5", "0.8%"),
        ("forward", "50.0", "81.0%"),
        ("decode", "6.6", "10.7%"),
        ("TTFT", "20.1", "32.6%"),
        ("total", "61.7", "100.0%"),
    ]:
        assert rows[stage].split()[1:4] == [ms, "ms", share], rows[stage]
    ms_columns = {rows[name].index(" ms ") for name in rows}
    assert len(ms_columns) == 1, "milliseconds are right-aligned in one column"


@pytest.mark.parametrize("width", [20, 60, 97])
def test_bars_are_proportional_and_each_starts_where_the_previous_parts_end(width: int) -> None:
    timing = _timing(network=4.0, preprocess=7.0, queue=120.0, forward=800.0, decode=25.0)
    text = render_waterfall(timing, width=width)
    eighths_per_ms = width * 8 / timing.total_ms
    bars = {stage: _bar(text, stage) for stage in STAGES}
    assert max(bars, key=lambda stage: bars[stage][1]) == "forward"
    elapsed = 0.0
    for stage in STAGES:
        start, length8 = bars[stage]
        ms = getattr(timing, f"{stage}_ms")
        assert abs(start - elapsed * eighths_per_ms / 8) <= 1, (stage, start, elapsed)
        assert abs(length8 - ms * eighths_per_ms) <= 1, (stage, length8, ms)
        elapsed += ms
    end_cell = (bars["decode"][0] * 8 + bars["decode"][1]) / 8
    assert width - 1 <= end_cell <= width


def test_the_ttft_mark_sits_at_its_share_of_the_axis() -> None:
    timing = _timing(network=0.0, preprocess=10.0, queue=90.0, forward=880.0, decode=20.0, ttft=250.0)
    width = 40
    rows = _rows(render_waterfall(timing, width=width))
    origin = rows["total"].index(RULER_START)
    column = rows["TTFT"].index(TTFT_MARK) - origin
    assert abs(column - 0.25 * width) <= 1, column
    assert "first token" in rows["TTFT"]


def test_zero_parts_have_no_bar_and_a_tiny_part_still_shows() -> None:
    timing = _timing(network=0.0, preprocess=1.0, queue=0.0, forward=1990.0, decode=9.0)
    text = render_waterfall(timing, width=60)
    rows = _rows(text)
    for stage in ("network", "queue"):
        assert not set(rows[stage]) & set(EIGHTHS[1:]), rows[stage]
        assert rows[stage].split()[1:] == ["0.0", "ms", "0.0%"]
    start, length8 = _bar(text, "preprocess")
    assert (start, length8) == (0, 1)
    assert rows["preprocess"].endswith("▏")
    assert _bar(text, "decode")[1] >= 1


def test_an_empty_timing_renders_rows_without_bars() -> None:
    text = render_waterfall(common_pb2.Timing())
    assert [line.split()[0] for line in text.splitlines()] == [*STAGES, "TTFT", "total"]
    assert not set(text) & set(EIGHTHS[1:] + TTFT_MARK + RULER_START)


def test_the_trace_line_appears_only_with_a_trace_id() -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with_trace = render_waterfall(_timing(), trace_id=trace_id).splitlines()
    assert with_trace[-1] == f"trace {trace_id}: open it in Jaeger"
    without = render_waterfall(_timing())
    assert "trace" not in without
    assert "Jaeger" not in without


def test_colour_adds_ansi_codes_only_when_asked() -> None:
    plain = render_waterfall(_timing(), trace_id="ab" * 16)
    assert "\x1b" not in plain
    coloured = render_waterfall(_timing(), color=True, trace_id="ab" * 16)
    for stage in STAGES:
        assert STAGE_COLORS[stage] in _raw_row(coloured, stage)
    assert ANSI.sub("", coloured) == plain


def _raw_row(text: str, stage: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(stage))
