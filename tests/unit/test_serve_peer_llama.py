"""bench.serve_peer_llama: llama-server's command and log lines, and the real server when it is built.

The command and the log parsing are checked on their own. Where bench/peer_setup.py has already
built llama-server and converted the F32 GGUF into its cache (`make bench-peer` or
`make bench-serve-peer` does; this test never builds), the real server is started on a free port,
waited for through /health, sent a streamed request through the benchmark's own runner, and stopped
with SIGTERM: it must exit cleanly, and its stream must give what the benchmark counts.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.peer_setup import cache_root
from bench.serve_peer_llama import (
    LlamaServer,
    ServerOptions,
    listening_url,
    probe_system_info,
    server_command,
    system_info,
)
from bench.serve_peer_plan import LLAMA, STRATA, Level, Shape
from bench.serve_peer_run import Runner, Target, fresh_connection_client
from bench.stack_prompts import build_prompts, load_tokenizer
from bench.stats import DEFAULT_MODEL

if TYPE_CHECKING:
    from typing import Any


def test_the_command_gives_a_free_port_a_whole_request_per_slot_and_our_threads() -> None:
    options = ServerOptions(Path("/opt/llama-server"), Path("/m.gguf"), threads=2, slots=64, slot_tokens=640)
    command = server_command(options)
    pairs = dict(zip(command[1::2], command[2::2], strict=False))
    assert command[0] == "/opt/llama-server" and "--cont-batching" in command
    assert pairs["-m"] == "/m.gguf" and pairs["--port"] == "0" and pairs["--host"] == "127.0.0.1"
    assert (pairs["-t"], pairs["-tb"], pairs["-np"], pairs["-c"]) == ("2", "2", "64", str(64 * 640))
    with pytest.raises(ValueError, match="slots=0"):
        ServerOptions(Path("b"), Path("m"), threads=2, slots=0, slot_tokens=640)


def test_the_address_and_system_info_are_read_from_the_log() -> None:
    log = (
        "cmn  common_init: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 |\n"
        "srv  init: initializing, n_slots = 64\nmain: server is ready\n"
        "srv  main: listening on http://127.0.0.1:39421\n"
    )
    assert listening_url(log) == "http://127.0.0.1:39421"
    assert system_info(log) == "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 |"
    assert listening_url("srv  load_model: loading model") is None and system_info("") is None


def _built() -> tuple[Path, Path] | None:
    root = cache_root()
    binaries = sorted(root.glob("build-*/bin/llama-server"))
    gguf = root / "gguf" / f"{DEFAULT_MODEL.name}-f32.gguf"
    return (binaries[0], gguf) if binaries and gguf.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(
    _built() is None, reason="llama-server or its F32 GGUF is not built yet (make bench-peer)"
)
def test_the_real_server_starts_streams_what_the_benchmark_counts_and_stops_cleanly(tmp_path: Path) -> None:
    built = _built()
    assert built is not None
    options = ServerOptions(built[0], built[1], threads=1, slots=2, slot_tokens=64)
    assert "n_threads = 1" in probe_system_info(options, tmp_path / "probe.log")
    level = Level(Shape(16, 8), 2, 2)
    prompts = build_prompts(load_tokenizer(DEFAULT_MODEL), 2, 16, "serve-peer-test")
    with LlamaServer(options, tmp_path / "server.log") as server:
        url = server.wait_ready(timeout_s=120)
        me = lambda: [server.pid]  # noqa: E731
        targets = {
            LLAMA: Target(f"{url}/v1/completions", "m", None, me),
            STRATA: Target(f"{url}/v1/completions", "m", None, lambda: [os.getpid()]),
        }

        async def go() -> tuple[dict[str, Any], dict[str, Any]]:
            # The benchmark's client: a pooled connection llama-server closed fails the next request.
            async with fresh_connection_client(level.concurrency) as client:
                runner = Runner(client, targets, 60.0)
                figures, _ = await runner.level(LLAMA, level, prompts)
                return figures, await runner.prompt_check(LLAMA, prompts[0])

        figures, check = asyncio.run(go())
        assert server.stop() == 0
    assert figures["errors"] == 0 and figures["token_mismatches"] == 0, figures
    assert figures["output_tokens"] == 16 and figures["ttft_ms_p50"] is not None
    assert figures["itl_ms_p50"] is not None and figures["chunks_per_token"] > 0.5
    assert figures["server_cpu_s"] > 0
    # The same text prompt is the same number of tokens under llama.cpp's tokenizer and ours.
    assert check["prompt_tokens"] == 16
