"""A copy of /proc/self and a cgroup tree in a folder, for the real cgroup reader to read in tests.

Laid out as a Kubernetes pod (cgroup v2) or a Docker container (cgroup v1) shows them; the reader
(`services.worker.memory_limit.CgroupFiles`) is pointed at the copy, so its code is the one tested.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.memory_limit import CgroupFiles

if TYPE_CHECKING:
    from pathlib import Path


def fake_cgroups(
    tmp_path: Path, version: str, cgroup_path: str, files: dict[str, dict[str, str]]
) -> CgroupFiles:
    """A /proc/self and a cgroup tree under tmp_path; `files` maps cgroup paths to their files."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    if version == "v2":
        mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
        membership = f"0::{cgroup_path}\n"
        mount = tmp_path / "sys" / "fs" / "cgroup"
    else:
        mounts = (
            "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
            "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        )
        membership = f"4:memory:{cgroup_path}\n1:cpu:/\n"
        mount = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    (proc / "mountinfo").write_text("23 1 8:1 / / rw - ext4 /dev/root rw\n" + mounts)
    (proc / "cgroup").write_text(membership)
    for path, contents in files.items():
        directory = mount / path.lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (directory / name).write_text(text)
    return CgroupFiles(proc_self=proc, root=tmp_path)
