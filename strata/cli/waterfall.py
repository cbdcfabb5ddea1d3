"""A terminal waterfall of one request's Timing: where its time went, stage by stage, on one time axis.

`render_waterfall` turns a strata.v1 Timing into text for `strata generate --timing`. It is a pure
function: it writes nothing, reads no environment and knows nothing of terminals; the caller decides
the width and whether to colour. It must stay cheap to import (the CLI imports it after a request):
no grpc, torch or transformers, and the protobuf module only for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from strata.v1 import common_pb2

# Left-aligned partial blocks by eighths of a cell; index 0 is an empty remainder.
_EIGHTHS = ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")
_FULL = "█"
TTFT_MARK = "│"
RULER_START, RULER_END = "├", "┤"
_RESET = "\x1b[0m"
# One colour per stage so the eye can follow a stage from its row to its place on the axis.
STAGE_COLORS = {
    "network": "\x1b[34m",
    "preprocess": "\x1b[36m",
    "queue": "\x1b[33m",
    "forward": "\x1b[32m",
    "decode": "\x1b[35m",
}
_MARK_COLOR = "\x1b[1m"


class _Row(NamedTuple):
    name: str
    ms: float
    share: str
    bar: str


def render_waterfall(
    timing: common_pb2.Timing, *, width: int = 60, color: bool = False, trace_id: str = ""
) -> str:
    """Render `timing` as rows of stage, milliseconds, share of the total and a bar on a common axis.

    Row order is the order the request meets its stages: preprocess (tokenize), queue (admission and
    the worker's queue), forward (the engine), decode (detokenize and post-process). Network is a
    total over every hop (gateway to tokenizer, to worker, and back) rather than one moment in the
    request, so it cannot be placed where it happens; it is shown as one row placed first, as the cost
    of reaching the services at all. The parts do not overlap, so each bar starts where the previous
    one ended and the bars together trace the request's critical path across the axis.

    The axis spans `width` cells for the larger of total_ms and the parts' sum (they agree within
    rounding). Bars are drawn in eighths of a cell; a bar starts in the cell where its part starts
    and has the part's length rounded to an eighth, at least one eighth when the part is nonzero so a
    1 ms stage in a 2 s request still shows. A zero part has no bar. A TTFT row marks the time to the
    first token with a column, a total row draws the axis as a ruler, and a nonempty `trace_id` adds a
    line naming the trace to open in Jaeger. `color` wraps each bar in its stage's ANSI colour.
    """
    width = max(width, 2)
    parts = [
        ("network", timing.network_ms),
        ("preprocess", timing.preprocess_ms),
        ("queue", timing.queue_ms),
        ("forward", timing.forward_ms),
        ("decode", timing.decode_ms),
    ]
    parts = [(name, max(ms, 0.0)) for name, ms in parts]
    total = max(timing.total_ms, 0.0)
    parts_sum = sum(ms for _, ms in parts)
    axis = max(total, parts_sum)
    denominator = total if total > 0 else parts_sum
    eighths_per_ms = width * 8 / axis if axis > 0 else 0.0

    rows: list[_Row] = []
    elapsed = 0.0
    for name, ms in parts:
        start8 = round(elapsed * eighths_per_ms)
        elapsed += ms
        bar = ""
        if ms > 0 and axis > 0:
            length8 = max(1, round(elapsed * eighths_per_ms) - start8)
            start_cell = min(start8 // 8, width - 1)
            bar = " " * start_cell + _paint(_blocks(length8), STAGE_COLORS[name], color)
        rows.append(_Row(name, ms, _share(ms, denominator), bar))

    ttft = max(timing.time_to_first_token_ms, 0.0)
    mark = ""
    if ttft > 0 and axis > 0:
        column = min(int(ttft * eighths_per_ms) // 8, width - 1)
        mark = " " * column + _paint(TTFT_MARK, _MARK_COLOR, color) + " first token"
    rows.append(_Row("TTFT", ttft, _share(ttft, denominator), mark))

    ruler_cells = max(2, round(total * eighths_per_ms / 8)) if total > 0 else 0
    ruler = RULER_START + "─" * (ruler_cells - 2) + RULER_END if ruler_cells else ""
    rows.append(_Row("total", total, _share(total, denominator), ruler))

    name_width = max(len(row.name) for row in rows)
    ms_width = max(len(f"{row.ms:.1f}") for row in rows)
    share_width = max(len(row.share) for row in rows)
    lines = [
        f"{row.name:<{name_width}}  {row.ms:>{ms_width}.1f} ms  {row.share:>{share_width}}  {row.bar}"
        for row in rows
    ]
    lines = [line.rstrip() for line in lines]
    if trace_id:
        lines.append(f"trace {trace_id}: open it in Jaeger")
    return "\n".join(lines)


def _blocks(length8: int) -> str:
    full, rest = divmod(length8, 8)
    return _FULL * full + _EIGHTHS[rest]


def _share(ms: float, denominator: float) -> str:
    return f"{100 * ms / denominator:.1f}%" if denominator > 0 else "0.0%"


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_RESET}" if color else text
