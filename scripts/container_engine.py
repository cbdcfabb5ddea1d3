"""A Docker Engine for `make images` and `make compose-test`: the machine's own, or one provisioned.

docker-compose.yml needs Docker Engine 25 or later (its healthchecks' `start_interval`) and the
compose v2 plugin; builds need BuildKit (the buildx plugin) for their secret mount of the host's CA
bundle. `engine()` uses the machine's daemon when `docker` reaches one that new with both plugins.
Otherwise, as root on Debian, it provisions a private engine under the cache directory
(~/.cache/strata/docker, outside any clone, so a rerun reuses its layers): Debian trixie's docker.io,
docker-cli, containerd, tini, docker-buildx and docker-compose packages and bookworm's runc
(trixie's needs a newer glibc than bookworm's), downloaded with apt from Debian's mirror and unpacked
with `dpkg -x`; only iptables, which dockerd runs for its networks' NAT and embedded DNS, is
installed system-wide, from the machine's own release, when missing. A dockerd of its own listens on
a socket of its own, started once and left running for later calls. Podman 4.3 (bookworm's) is not
used: podman-compose 1.6 rejects the healthchecks' start interval.

It returns the environment that points `docker` at that engine; it must not build or run images.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("STRATA_DOCKER_CACHE") or Path.home() / ".cache" / "strata" / "docker")
MIRROR = "http://deb.debian.org/debian"
# By suite: trixie's Docker 26 (its Go binaries need glibc 2.34, which bookworm has); bookworm's runc,
# as trixie's is linked against glibc 2.38.
PACKAGES = {
    "trixie": ("docker.io", "docker-cli", "containerd", "tini", "docker-buildx", "docker-compose"),
    "bookworm": ("runc",),
}
MIN_ENGINE = (25, 0)
SOCKET = Path("/run/strata-docker/docker.sock")
START_TIMEOUT_S = 120.0


def apt_install(*names: str) -> None:
    """Install Debian packages on this machine (as root), refreshing its package lists if they are stale."""
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *names]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(command, env=env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(command, env=env, check=True)


class EngineError(RuntimeError):
    """No engine could be found or provisioned; the message says what to do."""


@dataclass(frozen=True)
class Engine:
    """How to reach a Docker Engine: the environment for `docker` and where it came from."""

    env: dict[str, str]
    origin: str
    """"the machine's" or "provisioned under <dir>"."""
    version: str

    def docker(
        self,
        *args: str,
        check: bool = True,
        capture: bool = True,
        cwd: Path | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`docker args...` against this engine; raises subprocess.TimeoutExpired past `timeout`."""
        return subprocess.run(
            ["docker", *args],
            env=self.env,
            check=check,
            capture_output=capture,
            text=True,
            cwd=cwd,
            timeout=timeout,
        )


def _version(env: dict[str, str]) -> str | None:
    """The server version `docker` reaches with `env`, or None when it reaches none."""
    if shutil.which("docker", path=env.get("PATH")) is None:
        return None
    result = subprocess.run(
        ["docker", "version", "--format", "{{json .Server.Version}}"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if result.returncode != 0:
        return None
    return str(json.loads(result.stdout.strip() or '""')) or None


def _new_enough(version: str) -> bool:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return parts >= MIN_ENGINE


def _has_plugins(env: dict[str, str]) -> bool:
    return all(
        subprocess.run(["docker", plugin, "version"], env=env, capture_output=True, check=False).returncode
        == 0
        for plugin in ("compose", "buildx")
    )


def _private_env() -> dict[str, str]:
    root = CACHE / "root"
    path = os.pathsep.join(
        [str(root / "usr" / "bin"), str(root / "usr" / "sbin"), os.environ.get("PATH", "")]
    )
    config = CACHE / "config"
    return {**os.environ, "PATH": path, "DOCKER_HOST": f"unix://{SOCKET}", "DOCKER_CONFIG": str(config)}


def _apt(suite: str, *args: str, cwd: Path | None = None) -> None:
    state = CACHE / "apt" / suite
    (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (state / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    sources = state / "sources.list"
    sources.write_text(f"deb {MIRROR} {suite} main\n")
    options = [
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={state / 'lists'}",
        f"-oDir::Cache={state}",
        "-oAPT::Get::List-Cleanup=0",
        "-oDebug::NoLocking=1",
        # The cache is root's: apt's unprivileged download user could not write there.
        "-oAPT::Sandbox::User=root",
    ]
    subprocess.run(["apt-get", "-q", *options, *args], cwd=cwd, check=True)


def _unpack() -> None:
    """Download the packages (once) and unpack them into CACHE/root."""
    debs = CACHE / "debs"
    root = CACHE / "root"
    # What was unpacked, so a changed package list unpacks again instead of reusing a partial root.
    marker = root / ".strata-packages"
    wanted = repr(PACKAGES)
    if marker.exists() and marker.read_text() == wanted:
        return
    shutil.rmtree(root, ignore_errors=True)
    for suite, names in PACKAGES.items():
        where = debs / suite
        where.mkdir(parents=True, exist_ok=True)
        if not all(any(where.glob(f"{name}_*.deb")) for name in names):
            _apt(suite, "update")
            _apt(suite, "download", *names, cwd=where)
        # In PACKAGES' order, so bookworm's runc is the one left in place.
        for name in names:
            for deb in sorted(where.glob(f"{name}_*.deb")):
                subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    plugins = CACHE / "config" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    for plugin in (root / "usr" / "libexec" / "docker" / "cli-plugins").iterdir():
        link = plugins / plugin.name
        if not link.exists():
            link.symlink_to(plugin)
    marker.write_text(wanted)


def _start_daemon(env: dict[str, str]) -> None:
    """dockerd on SOCKET with its data under CACHE; returns once it answers."""
    SOCKET.parent.mkdir(parents=True, exist_ok=True)
    log = (CACHE / "dockerd.log").open("ab")
    command = [
        "dockerd",
        f"--data-root={CACHE / 'data'}",
        f"--exec-root={SOCKET.parent / 'exec'}",
        f"--pidfile={SOCKET.parent / 'dockerd.pid'}",
        f"--host=unix://{SOCKET}",
        "--storage-driver=overlay2",
        # tini from the same packages, for `init: true`.
        f"--init-path={CACHE / 'root' / 'usr' / 'bin' / 'tini-static'}",
    ]
    subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _version(env) is None:
        if time.monotonic() > deadline:
            tail = (CACHE / "dockerd.log").read_text(errors="replace")[-2000:]
            raise EngineError(f"dockerd did not answer on {SOCKET} within {START_TIMEOUT_S:.0f} s:\n{tail}")
        time.sleep(0.5)


def engine() -> Engine:
    """The machine's Docker Engine when it is new enough, else the private one (provisioned once)."""
    own = {**os.environ}
    machine = _version(own)
    if machine and _new_enough(machine) and _has_plugins(own):
        # A shell that took this module's exports reaches the private engine through DOCKER_HOST.
        ours = own.get("DOCKER_HOST") == f"unix://{SOCKET}"
        return Engine(own, f"provisioned under {CACHE}" if ours else "the machine's", machine)
    env = _private_env()
    version = _version(env)
    if version is None:
        if os.getuid() != 0 or shutil.which("apt-get") is None:
            found = (
                f"Docker {machine} (or without the compose and buildx plugins)"
                if machine
                else "no Docker Engine"
            )
            raise EngineError(
                f"found {found}; docker-compose.yml needs Docker Engine {MIN_ENGINE[0]} or later with the "
                "compose and buildx plugins: install them, or run `make images` as root on Debian, "
                "which provisions a private engine"
            )
        if shutil.which("iptables") is None:
            apt_install("iptables")
        _unpack()
        _start_daemon(env)
        version = _version(env)
    assert version is not None
    return Engine(env, f"provisioned under {CACHE}", version)


def main() -> int:
    found = engine()
    print(f"Docker Engine {found.version}, {found.origin}")
    # For a shell that wants the same engine: eval "$(python scripts/container_engine.py | tail -1)".
    variables = {
        name: found.env[name] for name in ("DOCKER_HOST", "DOCKER_CONFIG", "PATH") if name in found.env
    }
    print("export " + " ".join(f"{name}={value}" for name, value in variables.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
