"""The tokenizer fingerprint: what decides ids counts, the chat template and the file's layout do not."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from strata.fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:
    from pathlib import Path


def _folder(directory: Path, config: dict[str, str], vocab: dict[str, int]) -> Path:
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def test_the_chat_template_and_the_json_layout_leave_the_fingerprint_alone(tmp_path: Path) -> None:
    vocab = {"a": 0, "b": 1}
    base = {"eos_token": "b", "chat_template": "{{ messages }}"}
    first = tokenizer_fingerprint(_folder(tmp_path / "first", base, vocab))
    other_template = {"chat_template": "{{ messages | tojson }}", "eos_token": "b"}
    assert tokenizer_fingerprint(_folder(tmp_path / "template", other_template, vocab)) == first
    assert tokenizer_fingerprint(_folder(tmp_path / "eos", {**base, "eos_token": "a"}, vocab)) != first
    assert tokenizer_fingerprint(_folder(tmp_path / "vocab", base, {"a": 0, "c": 1})) != first
