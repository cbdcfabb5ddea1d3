"""Scenario 10: greedy outputs of 32 concurrent requests through the stack equal their solo outputs.

A real stack (separate processes) runs 32 greedy requests of mixed prompt lengths at once; the
worker's token budget per step is small, so long prompts are chunked and prefills share steps with
decodes. Each output must equal what transformers generates for that prompt alone, under the parity
rule of tests/parity.py (identical, or a divergence only at a near tie of the reference).
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import grpc
import torch
from transformers import AutoModelForCausalLM

from strata.cli.launcher import start_stack
from strata.v1 import gateway_pb2_grpc
from tests.parity import assert_greedy_parity, hf_greedy_reference
from tests.reliability.harness import prompt_ids, request, write_config

if TYPE_CHECKING:
    from pathlib import Path

    from tests.figures import Figure

COUNT = 32
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def test_concurrent_greedy_outputs_equal_their_solo_outputs(
    tiny_serving_dir: Path, tmp_path: Path, full: bool, figure: Figure
) -> None:
    new_tokens = 48 if full else 16
    rng = random.Random(10)
    prompts = [
        f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 18))) for i in range(COUNT)
    ]
    engine = {"num_blocks": 256, "max_num_seqs": COUNT, "max_num_batched_tokens": 64}
    config = write_config(
        tmp_path / "stack.yaml", tiny_serving_dir, engine=engine, worker={"max_requests": COUNT}
    )
    with start_stack(config, log_dir=tmp_path / "logs", ready_timeout_s=300) as stack:

        async def run_all() -> list[list[int]]:
            async with grpc.aio.insecure_channel(stack.addresses.gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def one(prompt: str) -> list[int]:
                    tokens: list[int] = []
                    async for message in stub.GenerateStream(request(prompt, new_tokens), timeout=300):
                        tokens.extend(message.token_ids)
                    return tokens

                return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

        got = asyncio.run(run_all())
        ids = [prompt_ids(stack.addresses.tokenizer, prompt) for prompt in prompts]

    hf = AutoModelForCausalLM.from_pretrained(tiny_serving_dir, dtype=torch.float32).eval()
    identical = 0
    failures: list[str] = []
    for index, (prompt, tokens) in enumerate(zip(ids, got, strict=True)):
        alone, logits = hf_greedy_reference(hf, prompt, new_tokens)
        identical += tokens == alone
        try:
            assert_greedy_parity(
                tokens, alone, logits, context=f"request {index} ({len(prompt)} prompt tokens)"
            )
        except AssertionError as error:
            failures.append(str(error))
    figure(10, "concurrent greedy requests", COUNT, f"{new_tokens} new tokens each")
    figure(10, "equal to their solo outputs (parity rule)", COUNT - len(failures), f"of {COUNT}")
    figure(10, "token for token identical", identical, f"of {COUNT}")
    figure(10, "prompt lengths", f"{min(map(len, ids))}-{max(map(len, ids))} tokens")
    assert not failures, "\n".join(failures)
    assert all(len(tokens) == new_tokens for tokens in got)
