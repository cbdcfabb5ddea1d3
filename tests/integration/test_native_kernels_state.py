"""The native CPU kernels' state is reported, not buried in a log: a worker says in GetWorkerInfo, the
gateway's ListModels and its metrics whether they serve it (and with which instruction set), a worker
that wanted them and cannot build them warns at start and reports why, and a library built by one
user (an image's root) loads for another (the image's runtime user).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from services.worker.model import native
from services.worker.server import SERVICE_NAME
from strata.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from tests.gguf_blocks import T
from tests.integration.tiny_stack import tiny_stack
from tests.integration.worker_harness import ENGINE, WAIT_S, async_stub, worker_process
from tests.polling import announced_address, wait_for

REPO = Path(__file__).resolve().parents[2]


def listed_model(model_dir: Path) -> gateway_pb2.ModelInfo:
    """ListModels' one entry for a tiny stack serving `model_dir`."""

    async def main() -> gateway_pb2.ModelInfo:
        async with (
            tiny_stack(model_dir) as stack,
            grpc.aio.insecure_channel(stack.gateway.address) as channel,
        ):
            stub = gateway_pb2_grpc.GatewayStub(channel)
            reply: gateway_pb2.ListModelsResponse = await stub.ListModels(
                gateway_pb2.ListModelsRequest(), timeout=WAIT_S
            )
            (model,) = reply.models
            return model

    return asyncio.run(main())


def test_list_models_and_the_metrics_say_the_kernels_serve_the_worker(tiny_serving_dir: Path) -> None:
    if not native.enabled():
        pytest.skip("STRATA_NATIVE_KERNELS=off in this run: nothing to report as on")

    model = listed_model(tiny_serving_dir)
    state = native.status()
    assert state == f"on ({native.isa()})"
    assert list(model.native_kernels) == [state]
    assert REGISTRY.get_sample_value("strata_native_kernels", {"model": "tiny", "state": state}) == 1.0


def test_list_models_names_the_family_the_weights_and_the_native_paths_it_takes(
    tiny_serving_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Qwen3 model (q/k norms: no native decode stack) says so beside the default Llama one; a GGUF
    file and an AWQ checkpoint served through the whole stack name their types as stored."""
    from tests.conftest import build_tiny_model
    from tests.gguf_files import write_gguf
    from tests.int4_files import Int4Layout, write_int4
    from tests.tiny_tokenizer import write_tiny_tokenizer

    qwen3 = write_tiny_tokenizer(
        build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-serving"), "qwen3", seed=9)
    )
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("tiny-gguf-source"), "llama", seed=3)
    gguf = write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-gguf-serving"))
    write_gguf(checkpoint, gguf / "tiny.gguf", "llama", lambda name: T.Q4_0 if "mlp" in name else T.Q8_0)
    awq = tmp_path_factory.mktemp("tiny-awq-serving")
    write_int4(checkpoint, awq, tmp_path_factory.mktemp("tiny-awq-reference"), Int4Layout("awq", 32))
    llama, qwen, served = listed_model(tiny_serving_dir), listed_model(qwen3), listed_model(gguf)
    int4 = listed_model(write_tiny_tokenizer(awq))
    assert (llama.model_family, list(llama.native_paths)) == ("llama", ["native decode stack and kernels"])
    assert list(llama.weights_format) == ["float32"]
    assert qwen.model_family == "qwen3"
    assert list(qwen.native_paths) == ["kernels per operator; no native decode stack (q/k norms)"]
    # Per layer (3) the fused q/k/v and o in Q8_0, gate/up and down in Q4_0; embeddings and lm_head Q8_0.
    assert list(served.weights_format) == ["GGUF as stored: Q4_0 x6, Q8_0 x8"]
    # The four projections of each of 3 layers repacked into Q4_1 blocks; embeddings stay float.
    assert list(int4.weights_format) == ["AWQ int4 (groups of 32) as stored: Q4_1 x12"]
    assert list(int4.native_paths) == ["native decode stack and kernels"]


def _metrics(announce: Path) -> str:
    written = announce.with_name(announce.name + ".metrics")
    address = wait_for(
        lambda: written.read_text().strip() if written.exists() else None,
        WAIT_S,
        f"the metrics address in {written}",
    )
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=WAIT_S) as reply:
        return str(reply.read().decode())


@pytest.mark.slow
def test_a_worker_that_cannot_build_its_kernels_warns_and_reports_why(
    tiny_serving_dir: Path, tmp_path: Path
) -> None:
    """A compiler that fails (CXX=false) and an empty kernel cache: the worker still serves, through
    torch's operators, and says so loudly at start, in GetWorkerInfo and in its metrics."""
    worker = {"model_name": "tiny", "model_path": str(tiny_serving_dir), "device": "cpu", "engine": ENGINE}
    failing = {"CXX": "false", "STRATA_KERNEL_CACHE": str(tmp_path / "kernels")}
    process, announce = worker_process(worker, tmp_path, failing)

    async def info(address: str) -> worker_pb2.GetWorkerInfoResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            while (
                await asyncio.wait_for(watch.read(), WAIT_S)
            ).status != health_pb2.HealthCheckResponse.SERVING:
                continue
            watch.cancel()
            info: worker_pb2.GetWorkerInfoResponse = await async_stub(channel).GetWorkerInfo(
                worker_pb2.GetWorkerInfoRequest(), timeout=WAIT_S
            )
            return info

    try:
        reply = asyncio.run(info(announced_address(process, announce, WAIT_S)))
        metrics = _metrics(announce)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert reply.native_kernels.startswith("off (building the native kernels with false failed (exit 1)")
    assert "NATIVE CPU KERNELS OFF" in stderr and "install a C++ compiler or set CXX" in stderr
    line = f'strata_native_kernels{{model="tiny",state="{reply.native_kernels}"}} 0.0'
    assert line in metrics.splitlines()
    assert not list((tmp_path / "kernels").glob("*.so")), "a failed build left a library behind"


SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")


def _as(user: pwd.struct_passwd, **env: str) -> dict[str, Any]:
    """subprocess.run's arguments to run as `user` with this checkout and its venv's packages on the
    path, through the system's Python of the same version: the venv's interpreter may live where only
    root can read (a pyenv under /root), its packages do not."""
    packages = [path for path in sys.path if path.endswith("site-packages") and path.startswith(sys.prefix)]
    return {
        "user": user.pw_uid,
        "group": user.pw_gid,
        "cwd": REPO,
        "env": {
            "PATH": os.environ["PATH"],
            "HOME": user.pw_dir,
            "PYTHONPATH": os.pathsep.join([str(REPO), *packages]),
            **env,
        },
    }


@pytest.mark.slow
def test_a_library_built_by_root_loads_for_another_user() -> None:
    """An image builds the kernels as root and runs the worker as another user: the library must be
    readable and executable by all, found in the root-owned cache (not rebuilt), and that user's own
    builds, were there any, would go to a cache of its own."""
    if os.getuid() != 0:
        pytest.skip("needs root, to build as root and load as another user")
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"{SYSTEM_PYTHON} is missing: another user needs a Python it can run")
    nobody = pwd.getpwnam("nobody")
    probe = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import torch, services"], check=False, capture_output=True, **_as(nobody)
    )
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot import this checkout and its packages: {probe.stderr[-300:]!r}")
    cache = Path(tempfile.mkdtemp(prefix="strata-kernels-root-"))
    # One compiler name on both sides: it is part of the library's name, and the two Pythons'
    # sysconfig may name the same g++ differently.
    compiler = {"CXX": "g++", "STRATA_KERNEL_CACHE": str(cache)}
    try:
        cache.chmod(0o755)
        subprocess.run(
            [sys.executable, "-m", "services.worker.model.native"],
            cwd=REPO,
            env={**os.environ, **compiler},
            capture_output=True,
            text=True,
            check=True,
        )
        (library,) = cache.glob("strata_kernels-*.so")
        assert library.stat().st_mode & 0o777 == 0o755
        script = (
            "from services.worker.model import native; "
            "print(native.status()); print(native.library_path()); print(*native.cache_dirs(), sep='\\n')"
        )
        ran = subprocess.run(
            [str(SYSTEM_PYTHON), "-c", script],
            capture_output=True,
            text=True,
            check=True,
            **_as(nobody, **compiler),
        )
        state, loaded, *directories = ran.stdout.splitlines()
        assert state.startswith("on ("), ran.stderr
        assert loaded == str(library), "the other user did not use the library root built"
        assert directories[0] == str(cache) and len(directories) == 2 and directories[1] != str(cache)
    finally:
        shutil.rmtree(cache)
