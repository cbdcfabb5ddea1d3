"""docs/cpu-speed.md's table of speed levers: what each lever bought, each row from its own record.

A lever's name and verdict (kept or dropped) are decisions, written here; its figures come from the
record the row names, and a row whose record cannot be quoted says it awaits a rerun. Levers measured
only by profiling, with no record, keep their description and carry no figure. This module must not
read files; docs_tables.py hands it the quotable records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from docs_tables_common import Record, Table, num, ratio, table

Figures = Callable[[dict[str, Any]], str]


def small_linear(data: dict[str, Any]) -> str:
    rows = data["by_rows"]
    one = rows["1"]
    others = ", ".join(f"M={m} {ratio(rows[m]['native_vs_f_linear'])}" for m in ("2", "4", "8") if m in rows)
    return (
        f"M=1: {one['native']['ms']:.1f} ms against F.linear's {one['f_linear']['ms']:.1f} "
        f"({ratio(one['native_vs_f_linear'])}); {others}; at M >= 16 torch's GEMM is used"
    )


def gguf_linear(data: dict[str, Any]) -> str:
    parts = []
    for name, entry in data["by_type"].items():
        rows = entry["by_rows"]
        each = ", ".join(
            f"M={m} {ratio(rows[m]['native_vs_dequantize_gemm'])}"
            for m in ("1", "8", "16", "64", "128", "512")
            if m in rows
        )
        parts.append(f"{name} ({rows['1']['native']['ms']:.1f} ms at M=1): {each}")
    return (
        "; ".join(parts)
        + " the dequantize-then-GEMM path's speed, which takes over above "
        + f"M={data['native_max_rows']} where the kernel has no tiled GEMM"
    )


def transposed(data: dict[str, Any]) -> str:
    rows = data["by_rows"]
    each = ", ".join(
        f"M={m} {ratio(rows[m]['transposed_vs_f_linear'])}" for m in ("1", "4", "8") if m in rows
    )
    return f"+{data['transposed_copy_extra_bytes'] / 2**20:.0f} MiB (the whole model again); {each} F.linear"


def native_one_stream(data: dict[str, Any]) -> str:
    on, off = data["engine_tok_s"], data["engine_torch_ops_tok_s"]
    return (
        f"{num(on)} tok/s with them against {num(off)} without: **{ratio(on / off)}**; decode alone "
        f"{num(data['engine_full_batch_decode_tok_s'])} against "
        f"{num(data['engine_torch_ops_full_batch_decode_tok_s'])}"
    )


def native_64(data: dict[str, Any]) -> str:
    on, off = data["engine_tok_s"], data["engine_torch_ops_tok_s"]
    return f"{num(on)} tok/s against {num(off)}: **{ratio(on / off)}**"


def decode_stack(data: dict[str, Any]) -> str:
    tok = data["median_tok_s"]
    return (
        f"one stream, in process: {num(tok['alone, stack on'])} tok/s with it against "
        f"{num(tok['alone, stack off'])} without (**{ratio(data['stack_on_vs_off_alone'])}**); "
        f"next to a busy fallback {num(tok['busy neighbour, stack on'])} "
        f"against {num(tok['busy neighbour, stack off'])} "
        f"({ratio(data['stack_on_vs_off_next_to_busy'])})"
    )


def int8_copies(data: dict[str, Any]) -> str:
    entry = data["summary"]["int8@1"]["tok_s"]
    return (
        f"one stream against llama.cpp's Q8_0: {num(entry['engine']['median'])} against "
        f"{num(entry['llama_cpp']['median'])} tok/s (**{ratio(entry['ratio_median'])}**)"
    )


def large_linear(data: dict[str, Any]) -> str:
    row = data["by_rows"]["64"]
    packed, onednn = row["mkl_packed"], row["onednn"]
    return (
        f"`F.linear` (MKL sgemm, packing each weight on every call) {row['f_linear']['ms']:.1f} ms, "
        f"{row['f_linear']['gflop_s']:.0f} GFLOP/s; MKL's pre-packed weights {packed['ms']:.1f} ms "
        f"({ratio(packed['vs_f_linear'])}) but +{packed['extra_bytes'] / 2**20:.0f} MiB next to the "
        f"{data['weight_bytes'] / 2**20:.0f} MiB of weights; oneDNN's blocked weights {onednn['ms']:.1f} ms "
        f"({ratio(onednn['vs_f_linear'])})"
    )


def torch_compile(data: dict[str, Any]) -> str:
    ms = data["ms_per_step_median"]
    compiled, eager = ms["torch.compile, torch's operators"], ms["eager, torch's operators"]
    return (
        f"it cannot trace the native kernels (ctypes calls), so it compiles the torch-operator path: "
        f"{data['dynamo_unique_graphs']} graphs; {compiled:.1f} ms a step against that path's "
        f"{eager:.1f} eager "
        f"({ratio(eager / compiled)}) and the native decode stack's {ms['native decode stack']:.1f}; "
        f"{data['compile_and_first_run_seconds']:.0f} s to compile"
    )


LEVERS: tuple[tuple[str, str | None, Figures | str, str], ...] = (
    (
        "native small-batch linear on the stored weight (one step's projections, each on its own weight)",
        "small-linear-cpu.json",
        small_linear,
        "kept, for M <= 8 (portable, and at the bandwidth at small M)",
    ),
    ("a second, transposed [K, N] copy for small batches", "small-linear-cpu.json", transposed, "dropped"),
    (
        "GGUF projections computed from the blocks (8-bit activations in integers up to 8 rows; above, the "
        "tiled integer GEMMs with AVX-512 VNNI on every type but Q4_1 and Q5_1, else a dequantized tile)",
        "gguf-linear-cpu.json",
        gguf_linear,
        "kept: up to NATIVE_MAX_ROWS rows, and at any M where the tiled GEMM runs",
    ),
    (
        "RMSNorm fused with the residual add (native)",
        None,
        "one pass per row instead of torch's ten or so operators per call (profiled, no record)",
        "kept",
    ),
    (
        "decode attention reading the paged blocks in place (native), the new k/v written inside it",
        None,
        "removes two gathers and two index_copy_ per layer (no record of its own)",
        "kept",
    ),
    (
        "rotary in place (native)",
        None,
        "8 torch operators per layer to one call (no record of its own)",
        "kept",
    ),
    (
        "all of the native kernels, the decode stack included, one stream (`--compare-native`)",
        "engine-cpu-1-stream.json",
        native_one_stream,
        "kept",
    ),
    (
        "the same, 64 streams (the decode stack does not apply)",
        "engine-cpu-native.json",
        native_64,
        "kept",
    ),
    (
        "every layer of a small decode-only step in one native call (`decode_stack.cpp`), "
        "one OpenMP region a step",
        "busy-neighbour-cpu.json",
        decode_stack,
        "kept",
    ),
    (
        "weight-only int8 copies of every projection for the int8 fallback's small batches",
        "peer-cpu.json",
        int8_copies,
        "kept",
    ),
    (
        "a faster GEMM for 64 streams (the decoder's projections at M=64)",
        "large-linear-cpu.json",
        large_linear,
        "neither kept: the pack costs 4x the weights",
    ),
    (
        "torch.compile (Inductor, CPU) of the decode step (one stream)",
        "torch-compile-cpu.json",
        torch_compile,
        "dropped (no setting)",
    ),
    (
        "torch's `_weight_int8pack_mm` for int8 weights",
        None,
        "slower than float32 at M=1 on the AVX2 machine where this work began (no record)",
        "not used: the native kernel reads int8 instead",
    ),
)


def levers(records: Mapping[str, Record]) -> list[str]:
    rows = []
    for lever, record, figures, verdict in LEVERS:
        if record is None:
            rows.append([lever, "-", str(figures), verdict])
        elif record not in records:
            rows.append([lever, f"`{record}`", "awaits a rerun by `make records`", verdict])
        else:
            measured = figures if isinstance(figures, str) else figures(records[record].data)
            rows.append([lever, f"`{record}`", measured, verdict])
    return table(["lever", "record", "measured", "kept?"], rows)


LEVER_RECORDS = tuple(dict.fromkeys(record for _, record, _, _ in LEVERS if record is not None))
TABLES = (Table("levers", LEVER_RECORDS, levers, partial=True),)
