"""The contract tooling: buf lint passes, buf breaking catches a breaking change, stubs are current."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"


def _buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_buf_lint_passes_with_comments_required() -> None:
    result = _buf("lint", "protos")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_flags_an_uncommented_field(tmp_path: Path) -> None:
    protos = shutil.copytree(ROOT / "protos", tmp_path / "protos")
    gateway = protos / "strata/v1/gateway.proto"
    text = gateway.read_text()
    text = text.replace("  // Raw text, tokenized as is (no chat template).\n", "")
    gateway.write_text(text)
    result = _buf("lint", str(protos))
    assert result.returncode != 0
    assert "COMMENT_FIELD" in result.stdout + result.stderr or "comment" in result.stdout.lower()


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    protos = shutil.copytree(ROOT / "protos", tmp_path / "protos")
    gateway = protos / "strata/v1/gateway.proto"
    gateway.write_text(gateway.read_text().replace("string model = 3;", "string model = 30;"))
    same = _buf("breaking", str(ROOT / "protos"), "--against", str(ROOT / "protos"))
    assert same.returncode == 0, same.stdout + same.stderr
    broken = _buf("breaking", str(protos), "--against", str(ROOT / "protos"))
    assert broken.returncode != 0
    assert "model" in broken.stdout + broken.stderr


@pytest.mark.slow
def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    generated = sorted(p.name for p in (tmp_path / "strata/v1").iterdir())
    assert "gateway_pb2.py" in generated and "worker_pb2_grpc.pyi" in generated
    match, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "strata/v1", ROOT / "strata/v1", generated, shallow=False
    )
    assert not mismatch and not errors, f"stale generated code {mismatch + errors}: run `make protos`"
    assert sorted(match) == generated
