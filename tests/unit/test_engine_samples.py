"""Samples of one prompt in the engine, as the gateway submits them for n > 1 (gateway/samples.py):
the later samples take the first one's cached prompt blocks, and under a cache too small for all of
them, preemption of sequences sharing blocks still gives each sample the tokens it draws alone.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from gateway.samples import sample_seed
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from strata.sampling import SamplingParams
from tests.scheduler_invariants import check_invariants

if TYPE_CHECKING:
    from pathlib import Path

VOCAB = 384


def test_shared_prompt_blocks_survive_preemption(tiny_llama_dir: Path) -> None:
    rng = random.Random(6)
    prompt = [rng.randrange(2, VOCAB) for _ in range(50)]
    params = [
        SamplingParams(
            max_new_tokens=40, temperature=1.0, top_k=40, seed=sample_seed(99, i), presence_penalty=0.5
        )
        for i in range(4)
    ]
    roomy = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=8))
    alone = [roomy.generate([prompt], p)[0] for p in params]

    # 4 samples of 50 + 40 tokens need 4 x 12 blocks unshared; 20 blocks hold the shared prompt's 6
    # full blocks plus each sample's own tail only until they grow: preemption must happen.
    tight = LLMEngine.from_model_dir(tiny_llama_dir, EngineConfig(num_blocks=20, block_size=8))
    outputs: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}
    tight.add_request("s0", prompt, params[0])
    started = False
    while tight.has_work():
        for out in tight.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if not started and out.request_id == "s0":
                started = True
                hits_before = tight.stats().prefix_hit_blocks
                for i in range(1, 4):
                    tight.add_request(f"s{i}", prompt, params[i])
        check_invariants(tight.scheduler)
    stats = tight.stats()
    assert stats.prefix_hit_blocks - hits_before >= 3 * (len(prompt) - 1) // 8
    assert stats.num_preemptions > 0
    assert [outputs[f"s{i}"] for i in range(4)] == alone
    # Evictable blocks count as free: every block is back, the shared prompt still cached.
    assert stats.num_free_blocks == 20 and stats.num_evictable_blocks > 0
