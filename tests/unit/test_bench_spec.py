"""bench.spec on a tiny random Llama: both engines alternate, the texts are compared token for token,
the speculating engine's counters are recorded per run, and the verdicts read the record's figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from bench.spec import alternate, engine, parse_args, verdicts
from services.worker.model.loader import load_model
from strata.sampling import SamplingParams
from tests.engine_runs import pin_draft_cost

if TYPE_CHECKING:
    from pathlib import Path


def test_alternated_runs_compare_texts_and_count_drafts(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir)
    engines = {"off": engine(loaded, None, 8), "on": pin_draft_cost(engine(loaded, {"method": "ngram"}, 8))}
    prompts = [[7, 8, 9, 10, 11, 12] * 4, [100, 101, 102, 103] * 5]
    params = SamplingParams(max_new_tokens=24)
    one = alternate(engines, lambda _: prompts, params, 2, True, "one stream")
    many = alternate(engines, lambda _: prompts, params, 2, False, "two streams")
    assert one["identical_text"] and many["identical_text"]
    assert [r["tokens"] for r in one["off"]["runs"]] == [48, 48]
    assert all(r["draft_tokens"] > 0 for r in one["on"]["runs"])
    assert all(r["draft_tokens"] == 0 for r in one["off"]["runs"])
    assert 0 < one["acceptance_rate"] <= 1
    workload = {"model": "models/SmolLM2-135M-Instruct", "method": "ngram", "streams": 2}
    record = {"workload": workload, "one_stream": one, "many_streams": many}
    lines = verdicts(record)
    assert [line["met"] for line in lines] == [
        one["ratio"]["median"] >= 1.8,
        many["ratio"]["median"] >= 0.97,
    ]
    # Another model is held to its own bar; without the many-streams part there is one target.
    qwen = {**workload, "model": "models/Qwen2.5-Coder-1.5B-Instruct", "streams": 0}
    alone = verdicts({"workload": qwen, "one_stream": one, "many_streams": None})
    assert [line["met"] for line in alone] == [one["ratio"]["median"] >= 1.5]
    assert ">= 1.5x" in alone[0]["target"]


def test_fewer_than_five_rounds_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "4"])


_LOOKUP_LOG = """0.01.043.432 I encoded   24 tokens in    0.100 seconds, speed:  408.806 t/s
0.01.043.440 I decoded   17 tokens in    0.286 seconds, speed:   59.446 t/s
0.01.043.440 I
0.01.043.440 I n_draft      = 4
0.01.043.440 I n_predict    = 17
0.01.043.441 I n_drafted    = 16
0.01.043.442 I n_accept     = 11
0.01.043.442 I accept       = 68.750%
"""


def test_llama_lookups_log_gives_its_seconds_and_draft_counts() -> None:
    from bench.spec_peer import parse_lookup

    found = parse_lookup(_LOOKUP_LOG)
    assert found == {"seconds": pytest.approx(0.386), "n_predict": 17, "n_drafted": 16, "n_accept": 11}
    with pytest.raises(RuntimeError, match="printed no timings"):
        parse_lookup(_LOOKUP_LOG.split("0.01.043.440 I n_draft", maxsplit=1)[0])


def test_two_sides_reduce_to_medians_acceptance_and_per_round_ratios() -> None:
    from bench.spec import ratio_figure, two_sides

    def side(rates: list[float], drafted: int, kept: int) -> list[dict[str, float]]:
        return [{"tok_s": r, "draft_tokens": drafted, "accepted_draft_tokens": kept} for r in rates]

    runs = {"a": side([10.0, 12.0, 11.0], 10, 8), "b": side([10.0, 10.0, 11.0], 10, 5)}
    found = two_sides(runs, "a", "b")
    assert found["a"]["tok_s"]["median"] == 11.0 and found["b"]["acceptance_rate"] == 0.5
    assert list(found["ratio"]["values"]) == pytest.approx([1.0, 1.2, 1.0])
    assert found["ratio"]["median"] == 1.0
    assert ratio_figure(found, "a", "b") == "1.00x (range 1.00-1.20), 11.0 against 10.0 tokens/s"
