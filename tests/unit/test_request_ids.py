"""A request's id and its forms (gateway/request_ids.py): one id per request, every other form made
from it, and wire ids never repeated on a stream, even for two requests that share a caller's id."""

from __future__ import annotations

from gateway.request_ids import new_request_id, or_new, response_id, wire_id


def test_a_missing_id_is_made_and_a_given_one_kept() -> None:
    made = {or_new("") for _ in range(100)}
    assert len(made) == 100 and all(len(value) == 32 for value in made)
    assert or_new("caller-7") == "caller-7"
    assert new_request_id() != new_request_id()


def test_every_submission_gets_its_own_wire_id_that_names_its_request() -> None:
    first, second = wire_id("same"), wire_id("same")
    assert first != second
    assert first.partition("#")[0] == second.partition("#")[0] == "same"


def test_the_http_response_id_is_openais_prefix_and_the_request_id() -> None:
    assert response_id("abc", chat=True) == "chatcmpl-abc"
    assert response_id("abc", chat=False) == "cmpl-abc"
