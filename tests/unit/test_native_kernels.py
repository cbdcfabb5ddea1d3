"""The native CPU kernels against torch's own operators: the small-batch linear, paged decode
attention read in place, and RMSNorm with its fused residual add; and when each is (not) used.

The kernels are compiled on first use (services/worker/model/native.py); every machine these tests
run on has a compiler, so a missing library is a failure here, not a skip.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker.model import native, small_linear
from services.worker.model.attention import AttentionMetadata, TorchAttention
from services.worker.model.layers import RMSNorm
from services.worker.model.rope import apply_rotary
from services.worker.model.small_int8 import SmallBatchInt8, quantize_rows


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_enabled", True)


def test_the_library_builds_and_picks_an_instruction_set_of_this_cpu() -> None:
    assert native.library() is not None
    assert native.isa() in {"avx512", "avx2", "portable"}
    assert native.library_path().exists()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (13, 70), (7, 16), (5, 3)])
def test_small_linear_matches_a_float64_reference(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    for bias in (b, None):
        expected = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = small_linear.linear(x, w, bias)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert float((got.double() - expected).abs().max()) < 1e-4 * max(1.0, k**0.5)


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (13, 70), (7, 16), (5, 3)])
def test_small_linear_int8_matches_a_float64_reference_of_its_int8_weight(rows: int, n: int, k: int) -> None:
    """The int8 kernel computes x . (int8 * scale)^T + bias exactly up to float32 rounding."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    linear = torch.nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    module = SmallBatchInt8(linear)
    dequantized = module.weight_int8.double() * module.scale.double()[:, None]
    expected = F.linear(x.double(), dequantized, linear.bias.detach().double())
    with torch.inference_mode():
        got = module(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert float((got.double() - expected).abs().max()) < 1e-4 * max(1.0, k**0.5)
    # And it is the int8 copy, not the float32 weight, that was read.
    exact = F.linear(x.double(), linear.weight.detach().double(), linear.bias.detach().double())
    assert float((got.double() - exact).abs().max()) > 1e-3


def test_quantize_rows_keeps_each_rows_peak_and_zero_rows() -> None:
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]])
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == torch.int8
    assert quantized.abs().amax(dim=1).tolist() == [127, 0, 127]
    assert torch.allclose(quantized.float() * scale[:, None], weight, atol=float(scale.max()) / 2)


def test_small_batch_int8_runs_its_large_module_above_max_rows() -> None:
    calls: list[int] = []

    class Large(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().forward(x)

    module = SmallBatchInt8(Large(16, 32))
    with torch.inference_mode():
        module(torch.randn(small_linear.MAX_ROWS, 16))
        module(torch.randn(small_linear.MAX_ROWS + 1, 16))
    assert calls == [small_linear.MAX_ROWS + 1]


def test_small_linear_calls_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    library = native.library()
    assert library is not None
    calls: list[int] = []
    kernel = library.small_linear

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(library, name)

        def small_linear(self, *args: object) -> None:
            calls.append(1)
            kernel(*args)

    monkeypatch.setattr(native, "library", Counting)
    w = torch.randn(32, 16)
    small_linear.linear(torch.randn(small_linear.MAX_ROWS, 16), w)
    assert len(calls) == 1
    small_linear.linear(torch.randn(small_linear.MAX_ROWS + 1, 16), w)  # a GEMM: torch's
    small_linear.linear(torch.randn(1, 16, dtype=torch.bfloat16), w.bfloat16())
    small_linear.linear(torch.randn(1, 16, requires_grad=True), w)
    small_linear.linear(torch.randn(1, 32), w.t())  # not contiguous
    assert len(calls) == 1


@pytest.mark.parametrize("cap", ["avx2", "portable"])
def test_every_kernel_matches_torch_on_each_lower_instruction_set(cap: str) -> None:
    """STRATA_NATIVE_ISA caps the instruction set: this file's kernel tests, the decode stack's
    bit-equality tests and the GGUF kernels' tests rerun on each lower one, so the AVX2 and portable
    code paths are checked even on an AVX-512 machine."""
    if cap == "avx2" and native.isa() == "portable":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "STRATA_NATIVE_ISA": cap, "STRATA_NATIVE_ISA_CHECKED": cap}
    others = [
        str(Path(__file__).with_name(name)) for name in ("test_decode_stack.py", "test_gguf_kernels.py")
    ]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *others]
    # Not this test again, nor the switch test, which starts a process of its own for nothing new here.
    command += ["-k", "not lower_instruction and not environment_switch"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


def test_the_instruction_set_cap_is_the_one_chosen() -> None:
    cap = os.environ.get("STRATA_NATIVE_ISA_CHECKED")
    if cap is None:
        pytest.skip("runs inside the capped reruns above")
    assert native.isa() == cap


def test_the_environment_switch_turns_the_kernels_off() -> None:
    probe = "from services.worker.model import native; print(native.library() is None)"
    env = {**os.environ, "STRATA_NATIVE_KERNELS": "off"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def test_switched_off_the_projection_is_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_enabled", False)
    assert native.library() is None
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert torch.equal(small_linear.linear(x, w), F.linear(x, w))


def _decode_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks, size, kv_heads, dim, heads = 48, 16, 3, 64, 9
    keys, values = torch.randn(blocks, size, kv_heads, dim), torch.randn(blocks, size, kv_heads, dim)
    lens = [rng.randint(1, 80) for _ in range(6)]
    pool = rng.sample(range(blocks), blocks)
    tables = []
    for n in lens:
        count = -(-n // size)
        tables.append(pool[:count])
        pool = pool[count:]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, size, "cpu", len(lens))
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim)
    return qkv, keys, values, meta


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_decode_attention_reads_blocks_in_place_like_the_gather(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    qkv, keys, values, meta = _decode_case(seed)
    q, k, v = qkv[:, :9], qkv[:, 9:12].contiguous(), qkv[:, 12:].contiguous()
    backend = TorchAttention()
    with torch.inference_mode():
        native_out = backend.forward(q, k, v, (keys.clone(), values.clone()), meta, 0.125)
        monkeypatch.setattr(native, "_enabled", False)
        gathered = backend.forward(q, k, v, (keys.clone(), values.clone()), meta, 0.125)
    assert float((native_out - gathered).abs().max()) < 1e-5


def test_paged_decode_attention_is_the_kernel_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails if the decode path silently took the gather: the kernel is the one that ran."""
    qkv, keys, values, meta = _decode_case(3)
    library = native.library()
    assert library is not None
    ran: list[int] = []
    kernel = library.paged_decode_attention

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(library, name)

        def paged_decode_attention(self, *args: object) -> None:
            ran.append(1)
            kernel(*args)

    monkeypatch.setattr(native, "library", Counting)
    with torch.inference_mode():
        TorchAttention().forward(
            qkv[:, :9], qkv[:, 9:12].contiguous(), qkv[:, 12:].contiguous(), (keys, values), meta, 0.125
        )
    assert ran == [1]


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_and_its_fused_residual_add_match_torch(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(rows, 576), torch.randn(rows, 576)
    with torch.inference_mode():
        alone = norm(x)
        normed, summed = norm.add(x, residual)
        monkeypatch.setattr(native, "_enabled", False)
        expected_alone = norm(x)
        expected_normed, expected_sum = norm.add(x, residual)
    assert torch.equal(summed, expected_sum)
    assert float((alone - expected_alone).abs().max()) < 1e-5
    assert float((normed - expected_normed).abs().max()) < 1e-5
    assert not torch.equal(residual, summed)  # the residual input is left as it was


def test_rotary_in_place_matches_torch() -> None:
    torch.manual_seed(5)
    qkv = torch.randn(7, 15, 64)
    positions = torch.arange(7) * 13
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    expected = apply_rotary(qkv[:, :12], cos, sin)
    library = native.library()
    assert library is not None
    rotated = qkv.clone()
    library.rotary(rotated.data_ptr(), cos.data_ptr(), sin.data_ptr(), 7, 15, 12, 64)
    assert float((rotated[:, :12] - expected).abs().max()) < 1e-6
    assert torch.equal(rotated[:, 12:], qkv[:, 12:])
