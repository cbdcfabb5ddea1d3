"""The synchronous engine: one step is `schedule`, `run`, `postprocess`.

It owns one model's scheduler, block manager, runner, (with engine.speculative on) speculator, whose
drafts the schedule takes and whose cost model each step's time feeds, and (with engine.lora.max_loras
above 0) its LoRA adapters, loaded and unloaded between steps; it times the steps' cadence
(start to next start) that an inter-token SLO's caps are steered by (step_limits.py); it validates
requests, resolves seeds, and turns an out-of-memory step into load shedding instead of a crash. It has
no threads and no asyncio: async_engine.py drives it from its own thread.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.engine.adapters import NoAdapterSlotsError, UnknownAdapterError
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.draft_model import DraftModel, load_draft
from services.worker.engine.faults import FaultInjector, SimulatedOutOfMemoryError
from services.worker.engine.lora_serving import LoraServing
from services.worker.engine.memory_profile import explicit_num_blocks, size_kv_cache
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.scheduler import Scheduler, SchedulerStats
from services.worker.engine.sequence import FinishReason, Sequence, StepOutput
from services.worker.engine.speculation import Speculator
from services.worker.model.loader import load_model
from strata.fingerprint import weights_fingerprint
from strata.sampling import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from collections.abc import Sequence as SequenceOf
    from pathlib import Path

    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.memory_budget import MemoryBudget
    from services.worker.model.config import ModelConfig
    from services.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)

# Out-of-memory steps in a row, with nothing left to shed, before the running requests are failed.
MAX_FAILED_STEPS_ALONE = 3


@dataclass(frozen=True, slots=True)
class EngineStats(SchedulerStats):
    """The scheduler's snapshot plus the last step's shape; safe to hand to another thread."""

    last_batch_size: int
    last_batch_tokens: int
    last_num_decodes: int
    """Sequences of the last step that decoded (the rest of its tokens were drafts and prefill)."""
    last_num_draft_tokens: int
    """Drafted tokens the last step scored."""
    last_num_accepted_tokens: int
    """Of those, the ones kept."""

    @property
    def last_prefill_tokens(self) -> int:
        """The last step's prompt tokens: its tokens less its decodes' and their drafts'."""
        return self.last_batch_tokens - self.last_num_decodes - self.last_num_draft_tokens


def model_fingerprint(loaded: LoadedModel, kv_cache_dtype: str) -> str:
    """What besides the tokens decides a block's K/V: the weights, their dtype and quantization, and
    the cache's format (an int8 block's bytes are not a float32 block's)."""
    quantization = loaded.quantization or "none"
    return f"{weights_fingerprint(loaded.path)}:{loaded.dtype}:{quantization}:{kv_cache_dtype}"


class LLMEngine:
    """Continuous batching over a paged KV cache for one model. Not thread-safe: one caller thread."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = loaded.config
        self.max_model_len = config.resolve_max_model_len(loaded.config.max_position_embeddings)
        draft = load_draft(loaded, config.speculative)
        explicit = explicit_num_blocks(loaded, config, draft)
        if explicit and explicit * config.block_size < self.max_model_len:
            # One full-length request must always fit, or preemption could loop forever: an explicit
            # cache smaller than the context shrinks the context (a budget that small refuses to start).
            log.warning(
                "the explicit KV cache holds %d tokens, less than max_model_len=%d: requests are "
                "limited to %d tokens",
                explicit * config.block_size,
                self.max_model_len,
                explicit * config.block_size,
            )
            self.max_model_len = explicit * config.block_size
        # Adapter slots first: their memory is the model's, as the draft's is.
        self.lora = LoraServing(loaded, config.lora) if config.lora.max_loras else None
        extra = self.lora.nbytes if self.lora is not None else 0
        # Before the cache exists: the largest step is measured, and the cache gets what is left.
        self.memory: MemoryBudget = size_kv_cache(
            loaded, config, self.max_model_len, draft=draft, adapters_bytes=extra
        )
        num_blocks = self.memory.num_blocks
        self.runner = ModelRunner(
            loaded,
            num_blocks,
            config.block_size,
            use_cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            kv_cache_dtype=config.kv_cache_dtype,
            lora=self.lora,
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            model_fingerprint=model_fingerprint(loaded, self.memory.kv_cache_dtype),
        )
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            eos_token_ids=loaded.config.eos_token_ids,
            max_model_len=self.max_model_len,
            adapters=self.lora.table if self.lora is not None else None,
        )
        self.speculator: Speculator | None = None
        if config.speculative.enabled:
            drafts = None
            if draft is not None:
                vocab = loaded.config.vocab_size
                drafts = DraftModel(
                    draft, num_blocks, config.block_size, config.max_num_batched_tokens, vocab
                )
            self.speculator = Speculator(config.speculative, self.max_model_len, drafts)
        self.faults = FaultInjector(config.enable_fault_injection)
        if config.fault_step_delay_s:
            self.faults.set_step_delay(config.fault_step_delay_s)
        # Per step: (tokens computed, tokens sampled) and the step's seconds; benchmarks read them.
        self.step_log: list[tuple[int, int]] = []
        self.step_seconds: list[float] = []
        # Per step: tokens already in the cache that the step's attention read (the KV it streams).
        self.step_cached_tokens: list[int] = []
        self._arrivals = 0
        self._failed_steps = 0
        self._last_batch_size = 0
        self._last_batch_tokens = 0
        self._last_num_decodes = 0
        self._last_num_draft_tokens = 0
        self._last_num_accepted_tokens = 0
        self._unfed: tuple[int, int, float] | None = None
        """The last step's (decodes, other tokens, start) while work followed it: the next step's start
        gives its cadence, what a stream waits between two tokens (the loop's work between steps too)."""

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        quantization: str | None = None,
    ) -> LLMEngine:
        loaded = load_model(path, device=device, dtype=dtype, quantization=quantization)
        return cls(loaded, config or EngineConfig())

    def idle(self) -> None:
        """Between steps while there is no work: the model may keep its other ranks' link alive."""
        self.runner.model.idle()

    def close(self) -> None:
        """Release what the model holds outside this process (a tensor-parallel model's ranks)."""
        self.runner.model.close()

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: str = "") -> None:
        """Raise InvalidRequestError if this request can never run on this engine: the one check of a
        request's parameters, token ids and size, which every caller makes before add_request; and
        UnknownAdapterError for an adapter this engine does not serve."""
        if adapter:
            self.check_adapter(adapter)
        params.validate(len(prompt_ids), self.max_model_len)
        vocab = self.model_config.vocab_size
        for token in prompt_ids:
            if not 0 <= token < vocab:
                raise InvalidRequestError("prompt_ids", token, f"token ids must be in [0, {vocab})")
        for token, _ in params.logit_bias:
            if token >= vocab:
                raise InvalidRequestError("logit_bias", token, f"token ids must be in [0, {vocab})")
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        grammar: GrammarMatcher | None = None,
        itl_slo_s: float | None = None,
        adapter: str = "",
    ) -> Sequence:
        """Queue a request that passed `validate` (this is not checked again); it shares cached KV
        blocks only with requests of the same cache_salt (the tenant) and adapter. grammar: its compiled
        output constraint (grammar_compiler.py), already advanced past any prior output it was given.
        itl_slo_s: the inter-token latency its route promises; steps are sized to keep it. adapter: the
        LoRA adapter it runs through, "" for the base model."""
        if adapter:
            self.check_adapter(adapter)  # unloaded since `validate`: the request fails, not the scheduler
            assert self.lora is not None
            cache_salt = f"{cache_salt}\0{self.lora.table.identity(adapter)}"
        seed = params.seed if params.seed is not None else secrets.randbelow(2**63)
        self._arrivals += 1
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            priority=priority,
            arrival=self._arrivals,
            seed=seed,
            cache_salt=cache_salt,
            grammar=grammar,
            itl_slo_s=itl_slo_s,
            adapter=adapter,
        )
        self.scheduler.add(seq)
        return seq

    def check_adapter(self, name: str) -> None:
        """Raise UnknownAdapterError unless adapter `name` takes requests here."""
        if self.lora is None:
            raise UnknownAdapterError(name, ())
        self.lora.table.check(name)

    @property
    def adapter_names(self) -> list[str]:
        return self.lora.table.names() if self.lora is not None else []

    def load_adapter(self, name: str, path: Path) -> int:
        """Serve the PEFT adapter in `path` as `name` (lora_serving.py); its rank. AdapterError if it
        cannot be served, AdapterExistsError if `name` is loaded already, NoAdapterSlotsError here."""
        if self.lora is None:
            raise NoAdapterSlotsError(
                f"adapter {name!r}: this worker serves no adapters (engine.lora.max_loras is 0): set "
                "engine.lora.max_loras to the adapters it may hold at once, e.g. 8"
            )
        return self.lora.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Take no new requests for `name`; its running and waiting requests finish through it."""
        self.check_adapter(name)
        assert self.lora is not None
        self.lora.table.remove(name, self._queued_adapters())

    def _queued_adapters(self) -> list[str]:
        """The adapters of the running and waiting sequences (an unloading one stays until they end)."""
        return [seq.adapter for seq in self.scheduler.running + self.scheduler.waiting if seq.adapter]

    def _collect_adapters(self) -> None:
        if self.lora is not None and self.lora.table.unloading:
            self.lora.table.collect(self._queued_adapters())

    def abort(self, request_id: str) -> bool:
        if self.speculator is not None:
            self.speculator.release(request_id)
        aborted = self.scheduler.abort(request_id)
        self._collect_adapters()
        return aborted

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        begun = time.perf_counter()
        if self._unfed is not None:
            decodes, others, at = self._unfed
            self.scheduler.limits.paced(begun - at, decodes, others, self.scheduler.itl_slo_s)
            self._unfed = None
        failed = self._refill_adapters()
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        batch = self.scheduler.schedule(proposals)
        if batch.is_empty:
            self._collect_adapters()
            return failed
        started = time.perf_counter()
        try:
            self.faults.before_forward()
            result = self.runner.run_step(batch)
        except (SimulatedOutOfMemoryError, torch.OutOfMemoryError) as exc:
            return self._shed_load(exc)
        self._failed_steps = 0
        outputs = failed + self.scheduler.postprocess(
            batch, result.tokens, logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs
        )
        self._collect_adapters()
        if self.speculator is not None:
            for out in outputs:
                if out.finished:
                    self.speculator.release(out.request_id)
        elapsed = time.perf_counter() - started
        if self.speculator is not None:
            self.speculator.observe_step(batch.num_batched_tokens, elapsed)
        self.step_seconds.append(elapsed)
        if self.scheduler.has_work:  # the next step follows at once: its start ends this one's cadence
            self._unfed = (batch.num_decodes, batch.num_batched_tokens - batch.num_decodes, begun)
        self._last_batch_size = len(batch.entries)
        self._last_batch_tokens = batch.num_batched_tokens
        self._last_num_decodes = batch.num_decodes
        self._last_num_draft_tokens = sum(entry.num_drafts for entry in batch.entries)
        self._last_num_accepted_tokens = sum(out.num_accepted for out in outputs)
        self.step_log.append((batch.num_batched_tokens, batch.num_samples))
        self.step_cached_tokens.append(sum(entry.start for entry in batch.entries))
        return outputs

    def _shed_load(self, exc: BaseException) -> list[StepOutput]:
        """Answer an out-of-memory step by running less, never by dying."""
        self._failed_steps += 1
        shed = self.scheduler.shed_load()
        log.warning(
            "step ran out of memory (%s): preempted %d sequences, running limit now %d",
            exc,
            len(shed),
            self.scheduler.effective_max_num_seqs,
        )
        if shed or self._failed_steps < MAX_FAILED_STEPS_ALONE:
            return []
        # One sequence alone keeps failing: end it with an error rather than retry it forever.
        self._failed_steps = 0
        return [self._fail(seq) for seq in self.scheduler.running]

    def _refill_adapters(self) -> list[StepOutput]:
        """Read back the adapters waiting requests want; an adapter that cannot be read is unloaded and
        its waiting requests end with an error."""
        if self.lora is None or not self.lora.table.wanted:
            return []
        outputs: list[StepOutput] = []
        for name in self.lora.refill():
            outputs.extend(self._fail(seq) for seq in self.scheduler.waiting if seq.adapter == name)
            self.lora.table.retire(name, self._queued_adapters())
        return outputs

    def _fail(self, seq: Sequence) -> StepOutput:
        """End `seq` with an error, now."""
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        self.scheduler.abort(seq.request_id, FinishReason.ERROR)
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def reset_step_log(self) -> None:
        self.step_log = []
        self.step_seconds = []
        self.step_cached_tokens = []

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        grammars: SequenceOf[GrammarMatcher | None] | None = None,
    ) -> list[list[int]]:
        """Run these prompts to completion together and return each one's new token ids."""
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        per_grammar = grammars if grammars is not None else [None] * len(prompts)
        ids = [f"generate-{self._arrivals + i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        for prompt, p in zip(prompts, per_request, strict=True):
            self.validate(prompt, p)
        for rid, prompt, p, g in zip(ids, prompts, per_request, per_grammar, strict=True):
            self.add_request(rid, prompt, p, grammar=g)
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [outputs[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return EngineStats(
            **asdict(self.scheduler.stats),
            last_batch_size=self._last_batch_size,
            last_batch_tokens=self._last_batch_tokens,
            last_num_decodes=self._last_num_decodes,
            last_num_draft_tokens=self._last_num_draft_tokens,
            last_num_accepted_tokens=self._last_num_accepted_tokens,
        )
