"""The family registry and each family through the engine, against transformers.

Per family (the tiny configs of conftest.py): the engine, with prefix caching on and prefill chunks of
8 tokens, serves a request whose prompt shares 16 tokens with an earlier one; the later one must hit
the cache and both must give transformers' greedy tokens under the parity rule (tests/parity.py).
The Llama-shaped families must take the native decode stack (counted), the others must say why not.
The registry refuses an unknown architecture by listing the six it knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.model.config import ModelLoadError
from services.worker.model.loader import load_model
from services.worker.model.registry import SUPPORTED_ARCHITECTURES, family_of
from strata.sampling import SamplingParams
from tests.native_calls import count_decode_stack_calls
from tests.parity import assert_greedy_parity, hf_greedy_reference, paged_greedy_generate

if TYPE_CHECKING:
    from pathlib import Path

FAMILY_FIXTURES = {
    "tiny_llama_dir": ("llama", ""),
    "tiny_qwen2_dir": ("qwen2", ""),
    "tiny_qwen3_dir": ("qwen3", "q/k norms"),
    "tiny_mistral_dir": ("mistral", ""),
    "tiny_gemma3_dir": ("gemma3", "q/k norms"),
    "tiny_phi3_dir": ("phi3", "partial RoPE"),
}
NEW_TOKENS = 10


def test_the_registry_knows_six_families_and_names_them_when_refusing() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
    }
    assert family_of({"model_type": "qwen3"}).name == "qwen3"
    with pytest.raises(ModelLoadError) as info:
        family_of({"architectures": ["FalconForCausalLM"]})
    assert "FalconForCausalLM" in str(info.value)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
def test_each_family_says_which_native_paths_it_takes(fixture: str, request: pytest.FixtureRequest) -> None:
    family, reason = FAMILY_FIXTURES[fixture]
    loaded = load_model(request.getfixturevalue(fixture))
    assert loaded.family == family
    paths = loaded.model.native_paths
    assert paths.decode_stack == (reason == "")
    assert paths.reason == reason
    assert (loaded.model.stack_layers() is not None) == paths.decode_stack


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_llama_shaped_families_decode_through_the_native_stack(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(request.getfixturevalue(fixture)).model
    calls = count_decode_stack_calls(monkeypatch)
    paged_greedy_generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=4)
    # One prefill step, then three decode steps of two rows each.
    assert len(calls) == 3


def test_a_window_no_context_reaches_keeps_the_native_stack(
    tiny_mistral_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral's window is 5 keys: decodes at contexts up to 5 take the stack, longer ones do not."""
    model = load_model(tiny_mistral_dir).model
    calls = count_decode_stack_calls(monkeypatch)
    paged_greedy_generate(model, [[5, 6]], max_new_tokens=6)
    # Decode steps at contexts 3, 4, 5 take the stack; at 6 and 7 the window cuts keys: torch's path.
    assert len(calls) == 3


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
def test_each_family_through_the_engine_with_a_prefix_hit_and_chunked_prefill(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    gen = torch.Generator().manual_seed(13)
    shared = torch.randint(3, 384, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 384, (n,), generator=gen).tolist() for n in (7, 3)]
    config = EngineConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True, max_num_seqs=4
    )
    engine = LLMEngine.from_model_dir(directory, config)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    hits = []
    for prompt in prompts:
        (tokens,) = engine.generate([prompt], params)
        outputs.append(tokens)
        hits.append(engine.scheduler.stats.prefix_hit_blocks)
    # The 16 shared tokens are 4 full blocks of 4: none hit for the first prompt, all for the second.
    assert hits == [0, 4], f"prefix-cache hits after each prompt: {hits}"
    for index, (prompt, tokens) in enumerate(zip(prompts, outputs, strict=True)):
        ref, logits = hf_greedy_reference(hf, prompt, NEW_TOKENS)
        assert_greedy_parity(tokens, ref, logits, context=f"{fixture} prompt {index}")


GEMMA3_4X = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "query_pre_attn_scalar": 16,
    "final_logit_softcapping": None,
}


def test_gemma3_reads_the_4x_layout_of_its_config() -> None:
    """Checkpoints written by transformers 4.x name the pattern and the local RoPE base instead."""
    config = family_of(GEMMA3_4X).config(GEMMA3_4X)
    assert config.layer_windows == (512, 512, 512, 512, 512, None, 512)
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("linear", 1_000_000.0, 8.0)
    assert config.sliding_rope is not None and config.sliding_rope.theta == 10_000.0
    assert config.sliding_rope.rope_type == "default"
    assert config.attention_scale == 16**-0.5 and config.final_softcap is None
    assert config.embedding_scale == 8.0 and config.activation == "gelu_tanh"


def test_families_refuse_what_they_cannot_serve_with_the_reason() -> None:
    phi3 = {**GEMMA3_4X, "architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "longrope"}}
    with pytest.raises(ModelLoadError, match="RoPE scaling type 'longrope' is not supported"):
        family_of(phi3).config(phi3)
    bidirectional = {**GEMMA3_4X, "use_bidirectional_attention": True}
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        family_of(bidirectional).config(bidirectional)
    mistral = {**GEMMA3_4X, "architectures": ["MistralForCausalLM"], "layer_types": ["full_attention"] * 7}
    with pytest.raises(ModelLoadError, match="layer_types"):
        family_of(mistral).config(mistral)
