"""The int8 KV cache's targets, judged from a bench/kv_cache.py record: one line per target with its
figure and whether it was met. Arithmetic on the record only; it must not measure anything.
"""

from __future__ import annotations

from typing import Any


def _ratio(record: dict[str, Any], shape: str, key: str) -> float:
    rates = record["speed"][shape]
    return float(rates["int8"][key]["median"] / rates["float32"][key]["median"])


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: {"target", "figure", "met"}."""
    capacity = record["capacity_kv_tokens"]
    stored = capacity["int8"] / capacity["float32"]
    shapes = record["workload"]["shapes"]
    many, one = shapes[0], shapes[1]
    perplexity = record["quality"]["perplexity"]
    worse = perplexity["int8"]["perplexity"] / perplexity["float32"]["perplexity"]
    greedy = record["quality"]["greedy"]
    room = record["headroom"]
    streams = record["workload"]["headroom_streams"]
    crowd = room.get(f"int8@{4 * streams}", {})
    lines = [
        ("KV tokens at one budget, int8 / float32 >= 3.5x", f"{stored:.2f}x", stored >= 3.5),
        (f"{many} tokens/s, int8 / float32 >= 1.2x", f"{_ratio(record, many, 'tok_s'):.2f}x "
         f"(decode phase {_ratio(record, many, 'decode_tok_s'):.2f}x)", _ratio(record, many, "tok_s") >= 1.2),
        (f"{one} tokens/s, int8 / float32 >= 0.97x", f"{_ratio(record, one, 'tok_s'):.2f}x",
         _ratio(record, one, "tok_s") >= 0.97),
        ("perplexity, int8 cache at most 1% above float32", f"{perplexity['int8']['perplexity']:.3f} vs "
         f"{perplexity['float32']['perplexity']:.3f} ({100 * (worse - 1):+.2f}%)", worse <= 1.01),
        ("greedy tokens equal >= 95%, every divergence a near tie", f"{100 * greedy['agreement']:.1f}%, "
         f"{greedy['divergences']} divergences, near ties: {greedy['every_divergence_a_near_tie']}",
         greedy["agreement"] >= 0.95 and greedy["every_divergence_a_near_tie"]),
        (f"{4 * streams} int8 sequences at full context in the budget of {streams} float32 ones, no "
         "preemption", f"{room['int8_full_context_sequences_that_fit']} fit; at {4 * streams}: peak "
         f"{crowd.get('peak_running')} running, {crowd.get('preemptions')} preemptions",
         crowd.get("preemptions") == 0 and crowd.get("peak_running") == 4 * streams),
    ]  # fmt: skip
    return [{"target": target, "figure": figure, "met": bool(met)} for target, figure, met in lines]
