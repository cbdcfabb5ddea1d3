"""Counting the native decode stack's calls, for tests that must show a step went through it.

It wraps the loaded library's `decode_stack` entry for one test (monkeypatch undoes it); it must not
change what the kernel computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.model import native

if TYPE_CHECKING:
    import pytest


def count_decode_stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one entry at every call of the native decode stack."""
    library = native.library()
    assert library is not None
    calls: list[int] = []
    kernel = library.decode_stack

    def counted(*args: object) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(library, "decode_stack", counted)
    return calls
