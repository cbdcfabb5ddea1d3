"""The memory limit a worker finds: the machine's available memory against its cgroups' limits.

Most tests point the real reader (`CgroupFiles`) at a copy of /proc/self and the cgroup tree in a
temporary folder, laid out as a Kubernetes pod (cgroup v2) or a Docker container (cgroup v1) shows
them. One test runs the reader in a child process inside a real cgroup v1 memory cgroup that it
creates, where this machine lets it (root, a writable v1 memory hierarchy); otherwise it is skipped
with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from services.worker.memory_limit import CgroupFiles, cpu_limit
from tests.cgroup_files import fake_cgroups

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]


def test_a_pod_limit_below_available_memory_is_the_limit(tmp_path: Path) -> None:
    """cgroup v2: the pod's memory.max (2 GiB) is chosen over 64 GiB available, less what the rest of
    the cgroup holds beyond this process (its working set: usage less inactive page cache)."""
    # The pod's usage is this process's resident set plus 1 GiB held by others: the test process's own
    # size (large after a long test session) must not decide the answer.
    own = psutil.Process().memory_info().rss
    files = fake_cgroups(
        tmp_path,
        "v2",
        "/kubepods/pod1/worker",
        {
            "/": {},
            "/kubepods/pod1": {
                "memory.max": str(2 * GIB),
                "memory.current": str(own + GIB),
                "memory.stat": "",
            },
            "/kubepods/pod1/worker": {
                "memory.max": "max",
                "memory.current": str(GIB),
                "memory.stat": f"anon 1\ninactive_file {GIB // 2}\n",
            },
        },
    )
    limit = cpu_limit(files, available=64 * GIB)
    assert limit.source == "cgroup v2 memory.max of /kubepods/pod1"
    # 2 GiB less what the others hold: the pod's working set less this process's own RSS, 1 GiB (within
    # what this process allocated between the two readings of its RSS).
    assert abs(limit.bytes - GIB) < 64 * 2**20
    assert dict(limit.candidates)["machine available memory"] > 64 * GIB  # available plus its own RSS


def test_available_memory_below_the_limit_is_the_limit(tmp_path: Path) -> None:
    """A container limit larger than what the machine has free does not count: available wins."""
    files = fake_cgroups(
        tmp_path, "v1", "/docker/abc", {"/docker/abc": {"memory.limit_in_bytes": str(32 * GIB)}}
    )
    limit = cpu_limit(files, available=GIB)
    assert limit.source == "machine available memory"
    assert dict(limit.candidates)["cgroup v1 memory.limit_in_bytes of /docker/abc"] == 32 * GIB


def test_v1_unlimited_and_v2_max_are_no_limit(tmp_path: Path) -> None:
    """v1 writes "no limit" as 9223372036854771712; it must not be read as a 8 EiB ceiling."""
    files = fake_cgroups(
        tmp_path, "v1", "/docker/abc", {"/docker/abc": {"memory.limit_in_bytes": "9223372036854771712"}}
    )
    limit = cpu_limit(files, available=GIB)
    assert [name for name, _ in limit.candidates] == ["machine available memory"]


def test_a_parent_cgroup_limit_binds_a_child_without_one(tmp_path: Path) -> None:
    """v1 hierarchy: the container's own cgroup has no limit, its parent has 3 GiB: the parent's binds."""
    files = fake_cgroups(
        tmp_path,
        "v1",
        "/limited/child",
        {
            "/limited": {"memory.limit_in_bytes": str(3 * GIB)},
            "/limited/child": {"memory.limit_in_bytes": "9223372036854771712"},
        },
    )
    limit = cpu_limit(files, available=16 * GIB)
    assert limit.source == "cgroup v1 memory.limit_in_bytes of /limited"
    assert limit.bytes == 3 * GIB


def _v1_memory_cgroup() -> Path | None:
    """This process's v1 memory cgroup directory, when the machine has a writable one."""
    files = CgroupFiles()
    mounts, paths = files.mounts(), files.paths()
    if "v1" not in mounts or "v1" not in paths:
        return None
    directory = mounts["v1"][0] / paths["v1"].lstrip("/")
    return directory if directory.is_dir() and os.access(directory, os.W_OK) else None


def test_inside_a_real_cgroup_the_limit_is_its_memory_limit() -> None:
    """A child process moved into a real v1 memory cgroup limited to 1 GiB finds that limit, by the
    same code the worker runs."""
    parent = _v1_memory_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory hierarchy here (needs root); the copies above stand in")
    child = parent / f"strata-test-{os.getpid()}"
    child.mkdir()
    try:
        (child / "memory.limit_in_bytes").write_text(str(GIB))
        code = (
            "import json, os, sys\n"
            f"open({str(child / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from services.worker.memory_limit import cpu_limit\n"
            "limit = cpu_limit()\n"
            "print(json.dumps({'bytes': limit.bytes, 'source': limit.source}))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
        )
        found = json.loads(done.stdout)
    finally:
        child.rmdir()
    assert found["source"].startswith("cgroup v1 memory.limit_in_bytes of /")
    assert found["source"].endswith(child.name)
    assert GIB - 64 * 2**20 <= found["bytes"] <= GIB


def test_on_cuda_the_limit_is_the_smaller_of_total_and_free_plus_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU that another process half fills: free (30 GiB) plus what torch holds here (10 GiB) is below
    the device's 80 GiB, so it is the limit. torch's CUDA queries are replaced: CI has no GPU."""
    import torch

    from services.worker.memory_limit import cuda_limit

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * GIB)
    limit = cuda_limit("cuda:0")
    assert limit.bytes == 40 * GIB
    assert limit.source == "cuda:0 free memory plus this process's"
    assert dict(limit.candidates)["cuda:0 total memory"] == 80 * GIB
