"""The KV cache's formats (kv_format.py): int8 rows with their own scale, bfloat16, and fp8_e4m3
(CUDA's; its conversions are checked here on the CPU through the gather path, which is all CUDA runs
of it). The native decode kernel must write the very int8 rows kv_format.py writes and read them as
their dequantized values; the engine must size, fingerprint and serve an int8 cache."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch

from services.worker.engine.config import KV_CACHE_DTYPES, EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model import kv_format, native
from services.worker.model.attention import AttentionMetadata, TorchAttention
from services.worker.model.kv_format import KVFormat
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 64


def test_int8_rows_hold_each_value_within_half_a_step_of_their_scale() -> None:
    rows = torch.randn(7, KV_HEADS, DIM) * torch.linspace(0.01, 50, 7)[:, None, None]
    rows[3, 1] = 0.0
    stored = kv_format.quantize_int8(rows)
    assert stored.shape == (7, KV_HEADS, DIM + 4) and stored.dtype == torch.int8
    scale = stored[..., DIM:].view(torch.float32)
    assert torch.equal(scale, rows.abs().amax(-1, keepdim=True) * kv_format.INV_127)
    back = kv_format.dequantize_int8(stored, torch.float32)
    assert ((back - rows).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[3, 1], torch.zeros(DIM)) and float(scale[3, 1]) == 0.0
    # The largest magnitude of each row is stored as +-127: the scale is the row's own.
    assert int(stored[..., :DIM].abs().amax()) == 127


def _sylvester(n: int) -> Tensor:
    """The normalized Walsh-Hadamard matrix built as a matrix, independently of the butterflies."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(n)


@pytest.mark.parametrize("dim", [2, 64, 128])
def test_the_rotation_is_the_hadamard_matrix_and_its_own_inverse(dim: int) -> None:
    rows = torch.randn(5, KV_HEADS, dim)
    rotated = kv_format.hadamard(rows)
    torch.testing.assert_close(rotated.double(), rows.double() @ _sylvester(dim), rtol=0, atol=1e-5)
    torch.testing.assert_close(kv_format.hadamard(rotated), rows, rtol=0, atol=1e-5)


def test_int8_rows_store_the_rotated_row_and_spread_an_outlier_channel() -> None:
    """A power-of-two head_dim stores quantize_int8 of the rotated row and reads it back rotated again;
    a key row with one large channel (as real keys have) comes back far closer than with one plain
    scale per row. Another head_dim has no Hadamard matrix: its rows are stored unrotated."""
    fmt = kv_format.resolve("int8", torch.float32, "cpu")
    rows = torch.randn(32, KV_HEADS, DIM) * 0.5
    rows[..., 7] = 30.0
    stored = fmt.pack(rows)
    assert torch.equal(stored, kv_format.quantize_int8(kv_format.hadamard(rows)))
    plain = kv_format.dequantize_int8(kv_format.quantize_int8(rows), torch.float32)
    rotated_error = (fmt.unpack(stored, torch.float32) - rows).pow(2).mean()
    assert rotated_error < (plain - rows).pow(2).mean() / 10
    odd = torch.randn(3, KV_HEADS, 96)
    assert not kv_format.rotated(96)
    assert torch.equal(fmt.pack(odd), kv_format.quantize_int8(odd))
    assert torch.equal(
        fmt.unpack(fmt.pack(odd), torch.float32), kv_format.dequantize_int8(fmt.pack(odd), torch.float32)
    )


def _step(
    fmt: KVFormat, seed: int, dim: int = DIM
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, AttentionMetadata]:
    """A decode-only step of three sequences over a cache of `fmt` whose earlier tokens were written
    by kv_format (as prefill writes them): q, k, v, the caches and the metadata's pieces."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 33, 18]
    blocks_each = 3
    shape = (blocks_each * len(lengths), BLOCK, KV_HEADS, fmt.row_width(dim))
    keys, values = torch.zeros(shape, dtype=fmt.storage), torch.zeros(shape, dtype=fmt.storage)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(lengths))]
    for length, table in zip(lengths, tables, strict=True):
        for position in range(length - 1):
            slot = table[position // BLOCK] * BLOCK + position % BLOCK
            keys.view(-1, KV_HEADS, shape[-1])[slot] = fmt.pack(torch.randn(KV_HEADS, dim, generator=gen))
            values.view(-1, KV_HEADS, shape[-1])[slot] = fmt.pack(torch.randn(KV_HEADS, dim, generator=gen))
    q = torch.randn(len(lengths), HEADS, dim, generator=gen)
    k = torch.randn(len(lengths), KV_HEADS, dim, generator=gen) * 3
    v = torch.randn(len(lengths), KV_HEADS, dim, generator=gen)
    meta = AttentionMetadata.build([1] * 3, lengths, tables, BLOCK, "cpu", 3)
    return q, k, v, keys, values, meta


@pytest.mark.parametrize("dim", [DIM, 96], ids=["rotated", "unrotated"])
def test_the_kernel_writes_and_reads_the_int8_rows_kv_format_writes_and_reads(dim: int) -> None:
    """The native decode kernel rotates and quantizes each decode's new k/v into the same bytes as
    kv_format's pack (the per-operator write), and its attention over int8 rows (rotating the query
    and the output rather than each row) equals SDPA over their unpacked values within float
    rounding; the same for a head_dim whose rows are not rotated."""
    if native.library() is None:
        pytest.skip("the native kernels are not built here")
    fmt = kv_format.resolve("int8", torch.float32, "cpu")
    q, k, v, keys, values, meta = _step(fmt, seed=0, dim=dim)
    ref_keys, ref_values = keys.clone(), values.clone()
    with torch.inference_mode():
        fused = TorchAttention().forward(q, k, v, (keys, values), meta, dim**-0.5)
        previous = native.set_enabled(False)
        try:
            reference = TorchAttention().forward(q, k, v, (ref_keys, ref_values), meta, dim**-0.5)
        finally:
            native.set_enabled(previous)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fmt", "tolerance"),
    [
        (kv_format.resolve("int8", torch.float32, "cpu"), 0.03),
        (kv_format.resolve("bfloat16", torch.float32, "cpu"), 0.03),
        (KVFormat("fp8_e4m3", torch.float8_e4m3fn), 0.15),
    ],
    ids=["int8", "bfloat16", "fp8_e4m3"],
)
def test_each_format_attends_close_to_the_float32_cache(fmt: KVFormat, tolerance: float) -> None:
    """The same step over each format's cache and over float32: decodes, then a prefill chunk that
    reads its sequence's cached prefix (the gather path), within the format's precision."""
    exact = kv_format.plain(torch.float32)
    got: list[Tensor] = []
    want: list[Tensor] = []
    for chosen, out in ((fmt, got), (exact, want)):
        q, k, v, keys, values, meta = _step(chosen, seed=1)
        chunk = AttentionMetadata.build([4], [20], [[3, 4]], BLOCK, "cpu", 0)
        with torch.inference_mode():
            backend = TorchAttention()
            out.append(backend.forward(q, k, v, (keys, values), meta, DIM**-0.5))
            gen = torch.Generator().manual_seed(2)
            q2, k2, v2 = (torch.randn(4, heads, DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
            out.append(backend.forward(q2, k2, v2, (keys, values), chunk, DIM**-0.5))
    for ours, theirs in zip(got, want, strict=True):
        error = float((ours - theirs).abs().max() / theirs.abs().max())
        assert 0 < error < tolerance


def test_a_setting_that_cannot_be_served_names_itself_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' needs a CUDA device.*use int8"):
        kv_format.resolve("fp8_e4m3", torch.float32, "cpu")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='int4' is invalid.*STRATA_WORKER_ENGINE__KV_CACHE_DTYPE"
    ):
        EngineConfig(kv_cache_dtype="int4")
    assert kv_format.resolve("auto", torch.bfloat16, "cpu") == kv_format.plain(torch.bfloat16)
    # Every name the settings accept is a format here (fp8_e4m3 on CUDA only, above).
    for name in KV_CACHE_DTYPES:
        if name not in ("auto", "fp8_e4m3"):
            assert kv_format.resolve(name, torch.float32, "cpu").name == name


def test_an_int8_cache_holds_what_its_rows_cost_at_one_budget(tiny_llama_dir: Path) -> None:
    """At one kv_cache_memory_bytes an int8 engine holds float32's tokens times 4 * head_dim /
    (head_dim + 4): the scales are paid for; the start line and the block fingerprint name the format."""
    loaded = load_model(tiny_llama_dir)
    head_dim = loaded.config.head_dim
    budget = 4 << 20
    memory = {
        name: LLMEngine(loaded, EngineConfig(kv_cache_dtype=name, kv_cache_memory_bytes=budget)).memory
        for name in ("float32", "int8")
    }
    ratio = memory["int8"].kv_tokens / memory["float32"].kv_tokens
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)
    assert memory["int8"].kv_cache_dtype == "int8" and "in int8 =" in memory["int8"].describe()
    assert memory["int8"].kv_cache_bytes <= budget


def test_an_int8_engine_serves_shared_prefixes_and_preemption_and_frees_every_block(
    tiny_llama_dir: Path,
) -> None:
    """Prefix caching serves an int8 block to a second request, a cache too small for every request
    at once preempts and recomputes, and afterwards every block is free again."""
    loaded = load_model(tiny_llama_dir)
    config = EngineConfig(kv_cache_dtype="int8", num_blocks=12, block_size=BLOCK, max_num_seqs=8)
    engine = LLMEngine(loaded, config)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = list(range(3, 3 + 2 * BLOCK))
    engine.generate([prompt], params)
    engine.add_request("shared", [*prompt, 99], params)
    cached = []
    while engine.has_work():
        cached += [out.num_cached_tokens for out in engine.step() if out.num_cached_tokens]
    assert cached and cached[0] >= BLOCK
    outputs = engine.generate([[7 + i, 11, 13, 17] for i in range(6)], params)
    assert [len(out) for out in outputs] == [40] * 6
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
