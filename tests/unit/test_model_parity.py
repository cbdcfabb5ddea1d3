"""Our forward pass of every family against transformers on tiny random models, in float32.

Covers, for each family (Llama in three configurations, Qwen2, Qwen3, Mistral, Gemma 3 text, Phi-3;
conftest.py says what each tiny config exercises), a whole-prompt prefill, and a sequence of mixed
steps over the paged cache (decodes with equal and unequal contexts, prefills split into chunks that
read earlier chunks' cached blocks as a prefix-cache hit does, a one-token chunk, shuffled
non-contiguous block ids, contexts longer than the sliding windows) whose every token's logits must
match transformers' full-sequence forward within 1e-4; then batched greedy generation (through the
native decode stack where the family takes it), RoPE frequencies, the attention metadata and the
cache sizing. transformers runs its eager attention, the reference formula.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache
from services.worker.model.loader import load_model
from services.worker.model.registry import config_from_dict, load_config
from services.worker.model.rope import inverse_frequencies
from tests.parity import assert_greedy_parity, assert_logits_close, hf_greedy_reference, paged_greedy_generate

if TYPE_CHECKING:
    from pathlib import Path

MODEL_FIXTURES = [
    "tiny_llama_dir",
    "tiny_llama_untied_dir",
    "tiny_llama_linear_mqa_dir",
    "tiny_qwen2_dir",
    "tiny_qwen3_dir",
    "tiny_mistral_dir",
    "tiny_gemma3_dir",
    "tiny_phi3_dir",
]
BLOCK_SIZE = 4

# Per sequence its total length; per step its (sequence, start, end) spans, decodes first.
LENGTHS = {"A": 14, "B": 12, "C": 9, "D": 11, "E": 7, "F": 7}
STEPS: list[tuple[int, list[tuple[str, int, int]]]] = [
    (0, [("A", 0, 6), ("B", 0, 9), ("C", 0, 7), ("D", 0, 5), ("E", 0, 5), ("F", 0, 5)]),
    (4, [("B", 9, 10), ("C", 7, 8), ("E", 5, 6), ("F", 5, 6), ("A", 6, 13), ("D", 5, 10)]),
    (3, [("A", 13, 14), ("C", 8, 9), ("D", 10, 11), ("B", 10, 11)]),  # B: a one-token prefill chunk
    (2, [("E", 6, 7), ("F", 6, 7)]),  # equal contexts: the unmasked decode path
    (1, [("B", 11, 12)]),
]


def _load_pair(directory: Path) -> tuple[Any, Any]:
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    return load_model(directory).model, hf


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_whole_prompt_prefill_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    ours, hf = _load_pair(request.getfixturevalue(fixture))
    ids = torch.randint(0, ours.config.vocab_size, (23,), generator=torch.Generator().manual_seed(5))
    cache = KVCache.allocate(ours.config, 16, BLOCK_SIZE, torch.float32, "cpu")
    meta = AttentionMetadata.build([23], [23], [[9, 2, 14, 5, 0, 11]], BLOCK_SIZE, "cpu", 0)
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]
        hidden = ours(ids, torch.arange(23), meta, cache)
        got = ours.compute_logits(hidden)
        # The engine projects only the rows it samples from; they must be the same rows.
        rows = torch.tensor([22, 4])
        selected = ours.compute_logits(hidden.index_select(0, rows))
    assert got.dtype == torch.float32
    assert_logits_close(got, expected, context=fixture)
    assert_logits_close(selected, expected[rows], context=f"{fixture} selected rows")


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_mixed_paged_steps_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    ours, hf = _load_pair(request.getfixturevalue(fixture))
    gen = torch.Generator().manual_seed(7)
    tokens = {
        name: torch.randint(0, ours.config.vocab_size, (n,), generator=gen) for name, n in LENGTHS.items()
    }
    pool = list(range(40))
    random.Random(3).shuffle(pool)
    tables = {}
    for name, n in LENGTHS.items():
        count = -(-n // BLOCK_SIZE) + (1 if name == "A" else 0)  # A owns a spare, unused block
        tables[name], pool = pool[:count], pool[count:]
    cache = KVCache.allocate(ours.config, 40, BLOCK_SIZE, torch.float32, "cpu")
    with torch.inference_mode():
        reference = {name: hf(ids[None]).logits[0] for name, ids in tokens.items()}
        for number, (num_decodes, spans) in enumerate(STEPS):
            meta = AttentionMetadata.build(
                query_lens=[end - start for _, start, end in spans],
                context_lens=[end for _, _, end in spans],
                block_tables=[tables[name] for name, _, _ in spans],
                block_size=BLOCK_SIZE,
                device="cpu",
                num_decodes=num_decodes,
            )
            ids = torch.cat([tokens[name][start:end] for name, start, end in spans])
            positions = torch.cat([torch.arange(start, end) for _, start, end in spans])
            got = ours.compute_logits(ours(ids, positions, meta, cache))
            expected = torch.cat([reference[name][start:end] for name, start, end in spans])
            assert_logits_close(got, expected, context=f"{fixture} step {number}")


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_batched_greedy_generation_matches_generate(fixture: str, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(fixture)
    ours, hf = _load_pair(directory)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    got = paged_greedy_generate(ours, prompts, max_new_tokens=12, block_size=BLOCK_SIZE)
    for index, prompt in enumerate(prompts):
        ref, logits = hf_greedy_reference(hf, prompt, 12)
        assert len(ref) == 12
        assert_greedy_parity(got[index], ref, logits, context=f"{fixture} prompt {index}")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_frequencies_equal_transformers(rope: dict[str, Any]) -> None:
    hf_config = LlamaConfig(
        hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=rope
    )
    ours = config_from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert ours.rope.rope_type == rope["rope_type"]
    expected = LlamaRotaryEmbedding(hf_config).inv_freq
    assert torch.equal(inverse_frequencies(ours.rope, ours.head_dim), expected)


def test_metadata_slots_and_layout() -> None:
    meta = AttentionMetadata.build(
        query_lens=[1, 1, 3],
        context_lens=[5, 2, 6],
        block_tables=[[7, 3], [4], [9, 1, 8]],
        block_size=4,
        device="cpu",
        num_decodes=2,
    )
    # Decode 0 writes position 4 (block 3, offset 0); decode 1 position 1; the chunk positions 3..5.
    assert meta.slot_mapping.tolist() == [12, 17, 39, 4, 5]
    assert meta.block_tables.tolist() == [[7, 3, 0], [4, 0, 0], [9, 1, 8]]
    assert meta.last_token_indices.tolist() == [0, 1, 4]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5]
    assert meta.num_tokens == 5
    assert meta.decode_kv_len == 5
    assert meta.decode_mask is not None
    assert meta.decode_mask[:, 0, 0].tolist() == [[True] * 5, [True, True, False, False, False]]
    (chunk,) = meta.prefills
    assert (chunk.start, chunk.end, chunk.context_len) == (2, 5, 6)
    assert chunk.mask is not None
    assert chunk.mask[0, 0].sum(dim=1).tolist() == [4, 5, 6]


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables", "num_decodes", "message"),
    [
        ([2], [2], [[0]], 1, "query_len 1"),
        ([3], [2], [[0]], 0, "query_len=3"),
        ([1], [9], [[0, 1]], 1, "cannot hold"),
        ([1, 1], [1], [[0]], 0, "equal length"),
    ],
)
def test_metadata_rejects_inconsistent_steps(
    query_lens: list[int], context_lens: list[int], tables: list[list[int]], num_decodes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, context_lens, tables, 4, "cpu", num_decodes)


def test_kv_cache_sizes(tiny_llama_dir: Path) -> None:
    config = load_config(tiny_llama_dir)[1]
    cache = KVCache.allocate(config, num_blocks=6, block_size=8, dtype=torch.float32, device="cpu")
    assert (cache.num_blocks, cache.block_size, cache.num_layers) == (6, 8, 3)
    assert cache.layer(2)[0].shape == (6, 8, 2, 16)
    per_block = KVCache.bytes_per_block(config, 8, torch.float32)
    assert per_block == 2 * 8 * 2 * 16 * 4 * 3
    assert cache.nbytes() == 6 * per_block
    assert KVCache.bytes_per_block(config, 8, torch.bfloat16) == per_block // 2


def test_same_results_in_and_out_of_inference_mode(tiny_llama_dir: Path) -> None:
    # The backend reuses gather buffers; one made under inference_mode must not break a no_grad call.
    model = load_model(tiny_llama_dir).model
    cache = KVCache.allocate(model.config, 8, BLOCK_SIZE, torch.float32, "cpu")
    prefill = AttentionMetadata.build([5, 6], [5, 6], [[3, 2], [1, 6]], BLOCK_SIZE, "cpu", 0)
    ids = torch.arange(11) + 7
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5])
    decode = AttentionMetadata.build([1, 1], [6, 7], [[3, 2], [1, 6]], BLOCK_SIZE, "cpu", 2)
    results = []
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            model(ids, positions, prefill, cache)
            hidden = model(torch.tensor([9, 4]), torch.tensor([5, 6]), decode, cache)
            results.append(model.compute_logits(hidden))
    assert torch.equal(results[0], results[1])
