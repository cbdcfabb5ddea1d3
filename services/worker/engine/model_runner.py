"""The model runner: turns one scheduled batch into one forward pass over the paged KV cache.

It owns the device tensors (weights through the model, the KV cache) and the sampler. It knows
nothing of queues, priorities or request lifetimes: the scheduler decides what runs, the runner only
computes it. Decode-only batches on CUDA are replayed from graphs captured here, when the runner is
built during the worker's warm-up (cuda_graphs.py); `graph_capture` reports that capture. Rows whose
sequences carry a grammar get its mask (grammar_mask.py) between the logits and the sampler. Where the
engine serves LoRA adapters, each step first writes the adapters newly given slots and tells the
model each row's slot (lora_serving.py); a step with adapter rows runs eagerly, never from a graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.worker.engine.logits_processors import banned_until_min_tokens
from services.worker.engine.logprobs import prompt_logprobs, token_logprobs
from services.worker.engine.sampler import Sampler, SampleRow
from services.worker.model import kv_format
from services.worker.model.attention import AttentionMetadata
from services.worker.model.kv_cache import KVCache

if TYPE_CHECKING:
    from services.worker.engine.cuda_graphs import CaptureReport, CudaGraphRunner
    from services.worker.engine.grammar_mask import GrammarMasker
    from services.worker.engine.grammar_matcher import GrammarMatcher
    from services.worker.engine.lora_serving import LoraServing
    from services.worker.engine.sequence import ScheduledBatch, TokenLogprobs
    from services.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardResult:
    """What one forward pass produced: one token per sampled row, in entry order, and the log
    probabilities of the rows that asked for them."""

    tokens: list[int]
    """One per sampled row: a speculative decode has one per position, its drafts' verdicts."""
    logprobs: list[TokenLogprobs | None] | None = None
    """Aligned with tokens; None when no entry asked."""
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """Entry index -> the logprobs of the prompt tokens after its chunk's positions (start + 1, ...)."""


class ModelRunner:
    """Runs scheduled batches of one model; one instance per engine, used from one thread."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        use_cuda_graphs: bool = True,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
        lora: LoraServing | None = None,
    ) -> None:
        """max_num_seqs and max_model_len bound the CUDA graphs captured here, before any request;
        kv_cache_dtype is engine.kv_cache_dtype (kv_format.resolve); lora: the adapters, if served."""
        self.loaded = loaded
        self.lora = lora
        self.model = loaded.model
        self.device = torch.device(loaded.device)
        self.block_size = block_size
        self.sampler = Sampler()
        self.masker: GrammarMasker | None = None
        """Built at the first constrained row: a worker that never sees one never loads it."""
        self.graphs: CudaGraphRunner | None = None
        self.graph_capture: CaptureReport | None = None
        graphs = use_cuda_graphs and self.device.type == "cuda"
        if graphs:
            from services.worker.engine.cuda_graphs import captures

            graphs = captures(self.model)
            if not graphs:
                log.info(
                    "no CUDA graphs: %s has sliding-window layers or runs over several ranks; decodes "
                    "run eagerly",
                    loaded.family,
                )
        # Graph padding rows need one scratch block that the block manager never hands out.
        total_blocks = num_blocks + 1 if graphs else num_blocks
        fmt = kv_format.resolve(kv_cache_dtype, loaded.dtype, self.device)
        self.cache = KVCache.allocate(loaded.config, total_blocks, block_size, fmt, self.device)
        if graphs:
            from services.worker.engine.cuda_graphs import BATCH_BUCKETS, CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self.model, self.cache, block_size, self.device, pad_block=num_blocks
            )
            self.graph_capture = self.graphs.capture_all(
                max_num_seqs or BATCH_BUCKETS[-1], max_model_len or loaded.config.max_position_embeddings
            )

    def run(self, batch: ScheduledBatch) -> list[int]:
        """Forward the batch and return one sampled token per sampled row, in entry order."""
        return self.run_step(batch).tokens

    def run_step(self, batch: ScheduledBatch) -> ForwardResult:
        """Forward the batch, sample, and take the log probabilities its entries asked for."""
        with torch.inference_mode():
            adapter_rows = None
            if self.lora is not None:
                self.lora.install_pending()
                adapter_rows = self.lora.rows(batch)
                self.lora.slots.set_rows(adapter_rows)
            hidden, logits_indices = self._forward(batch, graphs=adapter_rows is None)
            result = ForwardResult([], prompt_logprobs=self._prompt_logprobs(batch, hidden))
            if not logits_indices:
                return result
            index = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            rows = self._sample_rows(batch)
            tops = [row.params.logprobs for row in rows]
            wants = any(top is not None for top in tops)
            # Log probabilities are the model's, before any processor: a grammar's mask must not reach
            # them, so the raw logits are kept when both meet in one step.
            raw = logits.clone() if wants and self._has_grammar(batch) else logits
            self._mask_grammars(logits, batch)
            result.tokens = self.sampler(logits, rows)
            if wants:
                result.logprobs = token_logprobs(raw, result.tokens, tops)
            return result

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        """Logits of every prompt position of the entries whose prompts need them (their chunk's rows)."""
        found: dict[int, list[TokenLogprobs]] = {}
        offset = 0
        for i, entry in enumerate(batch.entries):
            seq = entry.seq
            if seq.needs_prompt_logits and seq.params.prompt_logprobs is not None:
                # Position p's logits give the prompt's token p + 1; the last prompt position's give
                # the first output token, which is not the prompt's.
                end = min(entry.start + entry.num_tokens, seq.num_prompt_tokens - 1)
                if end > entry.start:
                    logits = self.model.compute_logits(hidden[offset : offset + end - entry.start])
                    nexts = seq.prompt_ids[entry.start + 1 : end + 1]
                    found[i] = prompt_logprobs(logits, nexts, seq.params.prompt_logprobs)
            offset += entry.num_tokens
        return found

    @staticmethod
    def _has_grammar(batch: ScheduledBatch) -> bool:
        return any(entry.seq.grammar is not None for entry in batch.entries if entry.sample)

    def _mask_grammars(self, logits: torch.Tensor, batch: ScheduledBatch) -> None:
        rows: list[tuple[int, GrammarMatcher, list[int]]] = []
        row = 0
        for entry in batch.entries:
            if entry.seq.grammar is not None and entry.sample:
                rows.append((row, entry.seq.grammar, entry.drafts))
            row += entry.num_sampled_rows
        if not rows:
            return
        if self.masker is None:
            from services.worker.engine.grammar_mask import GrammarMasker

            self.masker = GrammarMasker()
        self.masker.apply(logits, rows)

    def _forward(self, batch: ScheduledBatch, graphs: bool) -> tuple[torch.Tensor, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        logits_indices: list[int] = []
        for index, entry in enumerate(batch.entries):
            input_ids.extend(entry.token_ids)
            positions.extend(range(entry.start, entry.start + entry.num_tokens))
            table = entry.seq.block_table
            if index < batch.num_decodes:
                # A decode row per position: a speculative decode's rows are the decodes its tokens
                # would have been one step at a time, so each computes the same bits as that decode.
                rows = range(entry.start + 1, entry.start + entry.num_tokens + 1)
                query_lens.extend(1 for _ in rows)
                context_lens.extend(rows)
                block_tables.extend(table for _ in rows)
                logits_indices.extend(range(len(input_ids) - entry.num_tokens, len(input_ids)))
                continue
            query_lens.append(entry.num_tokens)
            context_lens.append(entry.start + entry.num_tokens)
            block_tables.append(table)
            if entry.sample:
                logits_indices.append(len(input_ids) - 1)
        num_decode_rows = sum(e.num_tokens for e in batch.entries[: batch.num_decodes])
        if graphs and self.graphs is not None and batch.num_decodes == len(batch.entries):
            hidden = self.graphs.run_decode(input_ids, positions, context_lens, block_tables)
            if hidden is not None:
                return hidden, logits_indices
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            device=self.device,
            num_decodes=num_decode_rows,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(ids, pos, meta, self.cache), logits_indices

    def _sample_rows(self, batch: ScheduledBatch) -> list[SampleRow]:
        """One row per sampled position: a speculative decode's row i draws its output position as
        if drafts[:i] were already its output."""
        eos = self.loaded.config.eos_token_ids
        rows = []
        for entry in batch.entries:
            seq = entry.seq
            params = seq.params
            drafts = entry.drafts
            for i in range(entry.num_sampled_rows):
                output_ids = seq.output_ids + drafts[:i] if i else seq.output_ids
                # Only the penalties read the history; greedy rows skip building it.
                needs_history = params.repetition_penalty != 1.0 or params.no_repeat_ngram_size > 0
                history = seq.prompt_ids + output_ids if needs_history else ()
                output: list[int] = []
                if params.presence_penalty or params.frequency_penalty:
                    # A failover's prior output is the tail of the engine's prompt and counts as generated.
                    prior = seq.prompt_ids[len(seq.prompt_ids) - params.prior_output_tokens :]
                    output = prior + output_ids if params.prior_output_tokens else output_ids
                rows.append(
                    SampleRow(
                        params=params,
                        seed=seq.seed,
                        position=len(output_ids),
                        history=history,
                        output=output,
                        banned=banned_until_min_tokens(params, len(output_ids), eos),
                    )
                )
        return rows
