"""What memory a worker process may use: the machine's, its container's, or its GPU's.

On the CPU the ceiling is the smallest of the machine's available memory and the memory limit of
every cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) from the process's own up to the root of
its hierarchy, each less what the rest of that cgroup already holds; on CUDA, the smaller of the
device's total memory and what is free plus what this process already holds. Each figure counts what
this process holds now, so a worker that measures after loading its weights still counts them as its
own. The cgroup files are read through `CgroupFiles`, whose roots tests point at a copy. This module
only measures: it must not decide what the memory is spent on (memory_budget.py does) nor import torch
at module level (the CPU path never needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything at least this
# large is no limit (v2 writes "max").
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The most memory this process may hold, and every ceiling it was the smallest of."""

    bytes: int
    source: str
    """Which ceiling it is, e.g. "cgroup v2 memory.max of /kubepods/pod1" or "machine available"."""
    candidates: tuple[tuple[str, int], ...]
    """(source, bytes) of each ceiling found, the chosen one among them."""

    def describe(self) -> str:
        others = ", ".join(f"{name} {human(size)}" for name, size in self.candidates if name != self.source)
        return f"{human(self.bytes)} ({self.source}{'; also ' + others if others else ''})"


@dataclass(frozen=True, slots=True)
class CgroupFiles:
    """Where the cgroup files are: /proc/self and / in production, a copied tree in tests."""

    proc_self: Path = Path("/proc/self")
    root: Path = Path("/")

    def mounts(self) -> dict[str, tuple[Path, str]]:
        """(mount point, the hierarchy's path it shows) of cgroup v2 ("v2") and v1's memory ("v1")."""
        found: dict[str, tuple[Path, str]] = {}
        for line in (self.proc_self / "mountinfo").read_text().splitlines():
            # id parent major:minor root mount-point options [optional fields] - fstype source super
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            # A mount whose root is not "/" (a container's own subtree) shows that subtree only.
            mount = (self.root / fields[4].lstrip("/"), fields[3])
            if tail[0] == "cgroup2":
                found.setdefault("v2", mount)
            elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
                found.setdefault("v1", mount)
        return found

    def paths(self) -> dict[str, str]:
        """This process's cgroup path in the v2 hierarchy ("v2") and the v1 memory one ("v1")."""
        found: dict[str, str] = {}
        for line in (self.proc_self / "cgroup").read_text().splitlines():
            number, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if number == "0" and controllers == "":
                found["v2"] = path
            elif "memory" in controllers.split(","):
                found["v1"] = path
        return found


def cgroup_limits(files: CgroupFiles, own_bytes: int) -> list[tuple[str, int]]:
    """(source, bytes this process may hold) for each cgroup on its path that sets a memory limit."""
    limits: list[tuple[str, int]] = []
    mounts, paths = files.mounts(), files.paths()
    for version, limit_file, usage_file in (
        ("v2", "memory.max", "memory.current"),
        ("v1", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        if version not in mounts or version not in paths:
            continue
        for directory, name in _ancestors(mounts[version], paths[version]):
            limit = _read_limit(directory / limit_file)
            if limit is None:
                continue
            # The others in the cgroup (a sidecar, the launcher) keep what they hold; reclaimable page
            # cache does not count, as the kernel drops it before it kills anyone.
            others = max(0, _working_set(directory, usage_file, version) - own_bytes)
            limits.append((f"cgroup {version} {limit_file} of {name}", max(0, limit - others)))
    return limits


def _ancestors(mount: tuple[Path, str], path: str) -> list[tuple[Path, str]]:
    """(directory, cgroup path) from the process's cgroup up to the mount's root, where each exists.

    A mount of a subtree shows `path` less the subtree's own path; a directory that does not exist
    (a path from outside the container's cgroup namespace) is skipped."""
    point, shown = mount
    shown_parts = [part for part in shown.split("/") if part]
    parts = [part for part in path.split("/") if part]
    if parts[: len(shown_parts)] == shown_parts:
        parts = parts[len(shown_parts) :]
    found = []
    for depth in range(len(parts), -1, -1):
        directory = point.joinpath(*parts[:depth])
        if directory.is_dir():
            found.append((directory, "/" + "/".join([*shown_parts, *parts[:depth]])))
    return found


def _read_limit(file: Path) -> int | None:
    if not file.is_file():
        return None
    text = file.read_text().strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _working_set(directory: Path, usage_file: str, version: str) -> int:
    usage_path = directory / usage_file
    if not usage_path.is_file():
        return 0
    usage = int(usage_path.read_text().strip())
    stat = directory / "memory.stat"
    inactive_key = "inactive_file" if version == "v2" else "total_inactive_file"
    if stat.is_file():
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                return max(0, usage - int(value))
    return usage


def cpu_limit(files: CgroupFiles | None = None, available: int | None = None) -> MemoryLimit:
    """What this process may hold on the CPU: the smallest of the machine's and its cgroups' ceilings."""
    own = int(psutil.Process().memory_info().rss)
    free = int(psutil.virtual_memory().available) if available is None else available
    candidates = [("machine available memory", free + own), *cgroup_limits(files or CgroupFiles(), own)]
    source, size = min(candidates, key=lambda item: item[1])
    return MemoryLimit(size, source, tuple(candidates))


def cuda_limit(device: str) -> MemoryLimit:
    """What this process may hold on `device`: its total memory, or what is free plus what it holds."""
    import torch

    index = torch.device(device)
    free, total = torch.cuda.mem_get_info(index)
    held = int(torch.cuda.memory_reserved(index))
    candidates = [
        (f"{device} total memory", int(total)),
        (f"{device} free memory plus this process's", int(free) + held),
    ]
    source, size = min(candidates, key=lambda item: item[1])
    return MemoryLimit(size, source, tuple(candidates))


def memory_limit(device: str) -> MemoryLimit:
    """The ceiling for a worker on `device` ("cpu", "cuda", "cuda:N")."""
    return cuda_limit(device) if device.startswith("cuda") else cpu_limit()


def human(size: int) -> str:
    """MiB below a GiB, GiB above: a tiny model's figures stay readable next to a real one's."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
