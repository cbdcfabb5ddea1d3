"""A fallback that is a smaller quantization of the primary's own model, as a route declares it: the
tiny serving checkpoint written as a Q8_0 GGUF (the primary) and a Q4_0 GGUF (the fallback), the same
tokenizer files beside both, served as stored by real workers behind the real gateway
(tests/integration/fallback_harness.py).

A primary dying mid-stream is continued on the fallback: every token before `failover_at_token` is
the primary's greedy choice, every one after it the fallback's own greedy continuation of the prompt
plus the tokens so far: none lost, none repeated.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import pytest

from services.worker.model import native
from strata.v1 import common_pb2, gateway_pb2
from tests.conftest import build_tiny_model
from tests.gguf_blocks import T
from tests.gguf_files import write_gguf
from tests.integration.fallback_harness import FALLBACK, PRIMARY, PROMPT, Stack
from tests.tiny_tokenizer import write_tiny_tokenizer

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels are not built here")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _quantized(checkpoint: Path, folder: Path, qtype: T) -> Path:
    """`checkpoint` as a GGUF of one type, with its tokenizer files and nothing else."""
    for name in TOKENIZER_FILES:
        shutil.copyfile(checkpoint / name, folder / name)
    write_gguf(checkpoint, folder / "tiny.gguf", "llama", lambda _: qtype)
    return folder


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Weights 12x the usual init: greedy output varies token to token (the usual tiny model repeats one
    # token, where a lost or repeated token would pass unseen), and the two quantizations disagree.
    checkpoint = write_tiny_tokenizer(
        build_tiny_model(tmp_path_factory.mktemp("tiny-varied"), "llama", seed=4, initializer_range=0.25)
    )
    primary = _quantized(checkpoint, tmp_path_factory.mktemp("tiny-q8_0"), T.Q8_0)
    fallback = _quantized(checkpoint, tmp_path_factory.mktemp("tiny-q4_0"), T.Q4_0)
    with Stack(primary, fallback, fallback) as stack:
        yield stack


def test_a_q8_0_primary_dying_mid_stream_is_continued_token_exact_by_its_q4_0(stack: Stack) -> None:
    primary = stack.start_primary()
    primary.host.engine.engine.faults.set_step_delay(0.05)
    _, stub = stack.start_gateway(primary.address)
    total = 32
    prompt = stack.prompt_ids()
    expected = stack.greedy(PRIMARY, prompt, total)
    assert len(set(expected)) > total // 2 and expected != stack.greedy(FALLBACK, prompt, total)
    sampling = common_pb2.SamplingParams(max_new_tokens=total)
    request = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling, request_id="quantized-failover")
    call = stub.GenerateStream(request, timeout=120)
    messages: list[gateway_pb2.GenerateStreamResponse] = []
    while sum(len(m.token_ids) for m in messages) < 6:
        messages.append(next(call))
    stack.crash(primary)
    messages.extend(call)
    final = messages[-1].final
    ids = [token for message in messages for token in message.token_ids]
    cut = final.failover_at_token
    assert final.model == FALLBACK and "mid-stream" in final.fallback_reason
    assert cut >= 6 and ids == list(final.token_ids) and len(ids) == total
    assert ids[:cut] == expected[:cut]
    assert ids[cut:] == stack.greedy(FALLBACK, prompt + ids[:cut], total - cut)
