"""`strata generate --local`: stream one answer from the engine in this process, with no services.

It is the smallest path from a prompt to streamed text: tokenizer, async engine, incremental
detokenize. It is a demonstration and a smoke check of the engine; serving goes through the gateway.
It must not grow serving features (queues, fallback, tracing): those belong to the services.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pathlib import Path


def _incremental_text(tokenizer: Any, ids: list[int], printed: int) -> tuple[str, int]:
    """Decode all ids and return the new suffix, holding back a partial UTF-8 character."""
    text: str = tokenizer.decode(ids, skip_special_tokens=True)
    if text.endswith("\ufffd"):
        return "", printed
    return text[printed:], len(text)


async def _stream(
    model_dir: Path, prompt: str, chat: bool, max_new_tokens: int, temperature: float, out: TextIO
) -> None:
    from transformers import AutoTokenizer

    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import LLMEngine
    from strata.sampling import SamplingParams

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    if chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    prompt_ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)
    # One request: a cache and a profiled step for one sequence, not for a server's 64.
    config = EngineConfig(max_num_seqs=1)
    engine = AsyncEngine(lambda: LLMEngine.from_model_dir(model_dir, config))
    await engine.start()
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        started = time.perf_counter()
        first_token_s = 0.0
        ids: list[int] = []
        printed = 0
        async for step in engine.submit(uuid.uuid4().hex, list(prompt_ids), params):
            if step.new_token_ids and not ids:
                first_token_s = time.perf_counter() - started
            ids.extend(step.new_token_ids)
            delta, printed = _incremental_text(tokenizer, ids, printed)
            out.write(delta)
            out.flush()
            if step.finished:
                elapsed = time.perf_counter() - started
                out.write("\n")
                print(
                    f"[{len(prompt_ids)} prompt tokens, {len(ids)} new, finish={step.finish_reason}, "
                    f"first token {first_token_s * 1000:.0f} ms, total {elapsed:.2f} s]",
                    file=sys.stderr,
                )
    finally:
        await engine.stop()


def generate_local(
    model_dir: Path, prompt: str, chat: bool = True, max_new_tokens: int = 64, temperature: float = 0.0
) -> None:
    asyncio.run(_stream(model_dir, prompt, chat, max_new_tokens, temperature, sys.stdout))
