"""The default stack with its primary worker over two tensor-parallel ranks, through `strata up`.

The real default model split over two processes (gloo over loopback, one thread each) answers the
Paris question over the gateway; rank 1 killed with SIGKILL mid-stream makes the worker exit, the
stream continues on the fallback model, and `strata up` restarts the worker, which starts its rank
again and serves. Real processes, real signals, the real gateway.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import grpc
import pytest

from strata.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.test_supervision import served_by
from tests.integration.up_harness import default_config, running_up
from tests.polling import seconds_until, wait_for

if TYPE_CHECKING:
    from pathlib import Path

    import psutil

    from tests.integration.up_harness import Up

pytestmark = pytest.mark.slow

QUESTION = [common_pb2.ChatMessage(role="user", content="What is the capital of France?")]


def rank_one(up: Up) -> psutil.Process:
    """The primary worker's rank 1 (a process of services.worker.model.ranks)."""
    return wait_for(
        lambda: next(
            (p for p in up.children() if "services.worker.model.ranks" in " ".join(p.cmdline())), None
        ),
        60,
        "the primary's rank 1",
    )


def test_a_two_rank_primary_answers_fails_over_and_comes_back(tmp_path: Path, real_model_dir: Path) -> None:
    """Paris from the two-rank primary, which ListModels reports as split; its rank 1 killed mid-stream:
    the stream ends on the fallback (failover_at_token > 0); the primary serves again after strata up
    restarts it with a new rank 1."""
    two_ranks = {"tensor_parallel_size": 2, "threads": 1, "tensor_parallel_timeout_s": 30.0}
    path, config = default_config(tmp_path, {0: two_ranks})
    primary, fallback = (worker["model_name"] for worker in config["workers"])
    env = {key: value for key, value in os.environ.items() if not key.startswith("STRATA_")}
    with running_up(path, tmp_path / "up.stderr", env=env, ready_s=600) as (up, _):
        gateway = up.gateway or ""
        with grpc.insecure_channel(gateway) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            greedy = common_pb2.SamplingParams(max_new_tokens=24, temperature=0.0)
            answer = stub.Generate(
                gateway_pb2.GenerateRequest(messages=QUESTION, sampling=greedy), timeout=120
            )
            assert "Paris" in answer.text and answer.model == primary
            listed = {info.name: info for info in stub.ListModels(gateway_pb2.ListModelsRequest()).models}
            assert "tensor parallel over 2 ranks" in listed[primary].weights_format[0]
            assert "no native decode stack (tensor parallel)" in listed[primary].native_paths[0]
            long = common_pb2.SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
            stream = stub.GenerateStream(
                gateway_pb2.GenerateRequest(messages=QUESTION, sampling=long), timeout=300
            )
            first = next(stream)
            assert first.token_ids  # tokens flow from the primary
            killed = rank_one(up)
            killed.send_signal(signal.SIGKILL)
            signalled = time.monotonic()
            final = next(message.final for message in stream if message.HasField("final"))
        assert final.model == fallback and final.failover_at_token > 0
        assert final.usage.output_tokens == 200
        on_primary = seconds_until(
            lambda: served_by(gateway, 5.0) == primary, 300, "the primary serves again"
        )
        assert rank_one(up).pid != killed.pid
        assert time.monotonic() - signalled < 300 and on_primary < 300
