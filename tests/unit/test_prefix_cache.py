"""Tests of prefix caching in the block manager and the scheduler, without torch.

The scheduler cases run on the scheduler tests' fake model (tests/unit/scheduler_helpers.py): its
"K/V" are the token ids written through each sequence's block table, and each sampled token hashes
the whole context read back through that table. A sequence that starts from a wrong cached block,
or from a block another sequence overwrote, samples other tokens than the same request run with
the cache off, so every case compares outputs with the cache on against the cache off.
"""

from __future__ import annotations

import random
import weakref
import zlib
from typing import TYPE_CHECKING

import pytest

from services.worker.engine.block_hash import block_hash
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import Sequence
from strata.sampling import SamplingParams
from tests.scheduler_invariants import check_invariants
from tests.unit.scheduler_helpers import EOS, VOCAB_START, FakeModel, step

if TYPE_CHECKING:
    from collections.abc import Sequence as SequenceOf

    from services.worker.engine.block_hash import BlockHashFn


def scheduler(
    num_blocks: int = 64, *, cache: bool = True, hash_fn: BlockHashFn | None = None, **config: object
) -> Scheduler:
    engine_config = EngineConfig.model_validate({"block_size": 4, **config, "enable_prefix_caching": cache})
    bm = BlockManager(
        num_blocks, engine_config.block_size, enable_prefix_caching=cache, hash_fn=hash_fn or block_hash
    )
    return Scheduler(engine_config, bm, max_model_len=4096, eos_token_ids=[EOS])


_MODELS: weakref.WeakKeyDictionary[Scheduler, FakeModel] = weakref.WeakKeyDictionary()


def model_of(sched: Scheduler) -> FakeModel:
    """One fake model per scheduler for its whole life: its cache holds the K/V cached blocks keep."""
    bm = sched.block_manager
    return _MODELS.setdefault(sched, FakeModel(bm.num_blocks, bm.block_size))


def run_all(sched: Scheduler, seqs: list[Sequence]) -> dict[str, list[int]]:
    """Add every sequence, step until idle on the scheduler's own model; each request's tokens."""
    model = model_of(sched)
    for s in seqs:
        sched.add(s)
    streamed: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    while sched.has_work:
        _, outputs = step(sched, model)
        for out in outputs:
            streamed[out.request_id].extend(out.new_token_ids)
    return streamed


def tokens(tag: str, count: int) -> list[int]:
    return [VOCAB_START + zlib.crc32(f"{tag}:{i}".encode()) % 5000 for i in range(count)]


def seq(rid: str, prompt: SequenceOf[int], max_new: int = 6, salt: str = "") -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_new_tokens=max_new), cache_salt=salt)


def run_waves(
    sched: Scheduler, waves: list[list[tuple[str, list[int]]]], salt: str = ""
) -> dict[str, list[int]]:
    """Run each wave of (id, prompt) to completion, one wave after another (so later waves can hit)."""
    out: dict[str, list[int]] = {}
    for wave in waves:
        out.update(run_all(sched, [seq(rid, prompt, salt=salt) for rid, prompt in wave]))
    return out


def both_ways(
    waves: list[list[tuple[str, list[int]]]], **config: object
) -> tuple[dict[str, list[int]], Scheduler]:
    """Outputs with the cache on, checked equal to the cache off; and the cache-on scheduler."""
    on = scheduler(cache=True, **config)  # type: ignore[arg-type]
    got = run_waves(on, waves)
    assert got == run_waves(scheduler(cache=False, **config), waves)  # type: ignore[arg-type]
    return got, on


def idle_is_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    stats = sched.stats
    assert stats.num_free_blocks == bm.num_blocks == bm.num_free_blocks
    assert stats.free_kv_tokens == stats.total_kv_tokens
    assert stats.kv_cache_usage == 0.0
    bm.check_invariants([])


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change() -> None:
    """A second wave with the first wave's 16-token prefix computes only its own suffix (one block of
    the 16 prefix tokens at 4 per block is served: 4 full blocks), and its outputs equal the cache
    off's; the idle cache then counts every block free, with the cached ones evictable."""
    system = tokens("system", 16)
    waves = [
        [("a", system + tokens("qa", 3))],
        [("b", system + tokens("qb", 5)), ("c", system + tokens("qc", 2))],
    ]
    _, sched = both_ways(waves)
    stats = sched.stats
    # b and c each found all 4 prefix blocks: 8 of the 4 + 5 + 4 cacheable prompt blocks.
    assert stats.prefix_hit_blocks == 8
    assert stats.prefix_query_blocks == 4 + 5 + 4
    assert stats.num_evictable_blocks == stats.num_cached_blocks > 0
    idle_is_all_free(sched)


def test_hash_collisions_never_serve_wrong_blocks() -> None:
    """With a hash that maps every block to one key, every lookup collides: the token, salt and parent
    checks must turn each into a miss or a true hit, and the outputs must equal the cache off's."""
    rng = random.Random(3)
    prefixes = [tokens(f"p{i}", 12) for i in range(3)]
    waves = [
        [(f"r{w}-{i}", rng.choice(prefixes) + tokens(f"q{w}{i}", rng.randint(1, 9))) for i in range(4)]
        for w in range(4)
    ]
    on = scheduler(hash_fn=lambda parent, block: 7)
    assert run_waves(on, waves) == run_waves(scheduler(cache=False), waves)
    idle_is_all_free(on)


def test_a_colliding_hash_is_refused_by_its_tokens() -> None:
    """Direct lookup: a cached block under a colliding hash is not returned for other tokens."""
    bm = BlockManager(8, 4, enable_prefix_caching=True, hash_fn=lambda parent, block: 1)
    first = seq("first", [11, 12, 13, 14, 15])
    bm.allocate_for(first, 5)
    first.num_computed_tokens = 5
    bm.commit(first)
    assert bm.num_cached_blocks == 1
    other = seq("other", [21, 22, 23, 24, 25])
    assert bm.cached_prefix(other).blocks == []
    same = seq("same", [11, 12, 13, 14, 99])
    assert bm.cached_prefix(same).blocks == [first.block_table[0]]


def test_eviction_under_memory_pressure_keeps_outputs_right() -> None:
    """A 24-block cache serving 30 distinct 20-token prompts (each needs 7 blocks) must evict cached
    blocks to admit new ones; it never refuses for want of them and every output equals the cache off's."""
    waves = [[(f"r{i}", tokens(f"distinct{i}", 20))] for i in range(30)]
    _, sched = both_ways(waves, num_blocks=24)
    assert sched.stats.num_evictions > 0
    idle_is_all_free(sched)


def test_abort_of_a_request_whose_blocks_others_share() -> None:
    """Two requests share a cached prefix; aborting one mid-generation leaves the other's blocks (the
    shared ones included) intact: its output equals a run without the aborted request."""
    system = tokens("shared", 16)
    sched = scheduler()
    run_all(sched, [seq("warm", [*system, VOCAB_START])])
    model = model_of(sched)
    a, b = seq("a", system + tokens("qa", 3), max_new=10), seq("b", system + tokens("qb", 3), max_new=10)
    for s in (a, b):
        sched.add(s)
    for _ in range(3):
        step(sched, model)
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) == 4
    sched.abort("a")
    check_invariants(sched)
    while sched.has_work:
        step(sched, model)
    alone = scheduler(cache=False)
    assert b.output_ids == run_all(alone, [seq("b", system + tokens("qb", 3), max_new=10)])["b"]
    idle_is_all_free(sched)


def test_preemption_of_requests_that_share_blocks() -> None:
    """A cache too small for every request's growth preempts sequences whose prefix others share;
    the victims recompute from the cache and every output equals the cache off's."""
    system = tokens("sys", 8)
    wave = [(f"r{i}", system + tokens(f"q{i}", 3)) for i in range(6)]
    on = scheduler(num_blocks=14)
    got = run_waves(on, [wave])
    assert got == run_waves(scheduler(num_blocks=14, cache=False), [wave])
    assert on.stats.num_preemptions > 0
    idle_is_all_free(on)


def test_a_cached_prefix_ending_mid_block_reuses_only_full_blocks() -> None:
    """The second prompt shares 10 tokens with the first: two full blocks of 4 are served, and the
    third block, shared for only 2 of its tokens, is computed again."""
    first = tokens("first", 14)
    second = first[:10] + tokens("second", 6)
    sched = scheduler()
    run_all(sched, [seq("first", first)])
    later = seq("second", second)
    run_all(sched, [later])
    assert later.num_cached_tokens == 8
    assert run_all(scheduler(cache=False), [seq("second", second)])["second"] == later.output_ids


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    """A prompt of exactly 3 full blocks, sent twice: the second is served 2 blocks and computes the
    last block, so its first token comes from logits it computed."""
    prompt = tokens("exact", 12)
    sched = scheduler()
    run_all(sched, [seq("one", prompt)])
    again = seq("two", prompt)
    sched.add(again)
    batch = sched.schedule()
    assert [(e.start, e.num_tokens, e.sample) for e in batch.entries] == [(8, 4, True)]
    sched.postprocess(batch, model_of(sched).run(batch))
    assert again.num_cached_tokens == 8


def test_the_same_prompt_twice_in_one_step() -> None:
    """Two identical prompts admitted in the same step both compute (neither's blocks exist yet); the
    second's duplicates stay private, both outputs are right, and a third request later hits."""
    prompt = tokens("twice", 13)
    sched = scheduler()
    model = model_of(sched)
    a, b = seq("a", prompt), seq("b", prompt)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched, model)
    assert {e.seq.request_id for e in batch.entries} == {"a", "b"}
    assert not set(a.block_table) & set(b.block_table)
    while sched.has_work:
        step(sched, model)
    reference = run_all(scheduler(cache=False), [seq("a", prompt)])["a"]
    assert a.output_ids == b.output_ids == reference
    third = seq("c", prompt)
    assert run_all(sched, [third])["c"] == reference
    assert third.num_cached_tokens == 12
    idle_is_all_free(sched)


@pytest.mark.parametrize("collide", [False, True], ids=["real-hash", "colliding-hash"])
def test_two_tenants_with_one_prompt_do_not_share_blocks(collide: bool) -> None:
    """The same prompt under another cache salt finds nothing cached; under the same salt it hits.
    With every hash colliding, the salt itself (compared on each hit) still keeps tenants apart."""
    prompt = tokens("tenant", 20)
    sched = scheduler(hash_fn=(lambda parent, block: 5) if collide else None)
    run_all(sched, [seq("alice-1", prompt, salt="alice")])
    bob = seq("bob-1", prompt, salt="bob")
    run_all(sched, [bob])
    assert bob.num_cached_tokens == 0
    alice = seq("alice-2", prompt, salt="alice")
    run_all(sched, [alice])
    assert alice.num_cached_tokens == (4 if collide else 16)


def test_generated_blocks_are_cached_for_the_next_turn() -> None:
    """A chat's next turn resends the prompt and the answer: the answer's full blocks were cached as
    they were generated, so the next turn is served prompt and answer blocks alike."""
    prompt = tokens("turn1", 6)
    sched = scheduler()
    first = seq("t1", prompt, max_new=12)
    answer = run_all(sched, [first])["t1"]
    history = prompt + answer + tokens("turn2", 3)
    second = seq("t2", history)
    run_all(sched, [second])
    # Only the 17 tokens of the prompt and the first 11 answer tokens had K/V (the last is never fed).
    assert second.num_cached_tokens == 16
    assert run_all(scheduler(cache=False), [seq("t2", history)])["t2"] == second.output_ids


def test_a_hitting_request_is_budgeted_by_what_it_computes() -> None:
    """Without chunking, a 40-token prompt does not fit a 16-token step budget whole; with 36 of its
    tokens cached it computes 4 and starts at once, alongside a small request."""
    prompt = tokens("budget", 40)
    sched = scheduler(max_num_batched_tokens=16, chunked_prefill=False, max_num_seqs=4)
    run_all(sched, [seq("warm", prompt[:37])])
    hit, small = seq("hit", prompt), seq("small", tokens("small", 5))
    sched.add(hit)
    sched.add(small)
    batch = sched.schedule()
    assert [(e.seq.request_id, e.num_tokens) for e in batch.entries] == [("hit", 4), ("small", 5)]


def test_switched_off_it_caches_nothing() -> None:
    """enable_prefix_caching false: the same prompt twice is computed twice and nothing stays cached."""
    prompt = tokens("off", 20)
    sched = scheduler(cache=False)
    run_all(sched, [seq("a", prompt)])
    again = seq("b", prompt)
    run_all(sched, [again])
    assert again.num_cached_tokens == 0
    assert sched.stats.num_cached_blocks == 0


def test_invariants_after_1000_random_requests_with_shared_prefixes_and_aborts() -> None:
    """1,000 requests drawn from 5 shared prefixes with random suffixes and lengths, arriving a few per
    step into a 48-block cache, a tenth aborted at random: invariants hold after every step (the
    helper checks them, with reference counts and the evictable list), every request that finished
    got the cache off's tokens, and the idle cache counts all blocks free."""
    rng = random.Random(11)
    prefixes = [tokens(f"prefix{i}", rng.randint(4, 24)) for i in range(5)]
    requests = [
        (f"r{i}", rng.choice(prefixes) + tokens(f"s{i}", rng.randint(1, 8)), rng.randint(1, 8))
        for i in range(1000)
    ]
    sched = scheduler(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=32)
    model = model_of(sched)
    pending = list(requests)
    live: dict[str, Sequence] = {}
    streamed: dict[str, list[int]] = {}
    aborted: set[str] = set()
    while pending or sched.has_work:
        for rid, prompt, max_new in [pending.pop(0) for _ in range(min(len(pending), rng.randint(0, 3)))]:
            live[rid] = seq(rid, prompt, max_new)
            streamed[rid] = []
            sched.add(live[rid])
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(rid for rid, s in live.items() if not s.is_finished))
            if sched.abort(victim):
                aborted.add(victim)
        if sched.has_work:
            _, outputs = step(sched, model)
            for out in outputs:
                streamed[out.request_id].extend(out.new_token_ids)
        live = {rid: s for rid, s in live.items() if not s.is_finished}
    assert sched.stats.prefix_hit_blocks > 0
    assert sched.stats.num_evictions > 0
    idle_is_all_free(sched)
    finished = [r for r in requests if r[0] not in aborted]
    reference = scheduler(cache=False, num_blocks=256)
    expected = run_all(reference, [seq(rid, prompt, max_new) for rid, prompt, max_new in finished[:200]])
    for rid, tokens_out in expected.items():
        assert streamed[rid] == tokens_out, rid
