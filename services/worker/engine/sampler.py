"""The engine's batched sampler: one token per row of a logits batch, each row with its own params.

Per row, in the order logits_processors.py states: logit_bias, repetition penalty and
no-repeat-ngram (penalties.py), presence/frequency penalties and min_tokens, temperature, top-k,
top-p, min_p, typical_p, then a draw whose randomness is a pure function of (seed, output position, token id)
(noise.py): a request gets the tokens transformers' processors allow, and the same tokens alone, in
any batch, in any row order and after preemption.

Cost: greedy rows without penalties are one max (no noise, no softmax); the other rows are gathered
once. Top-k/top-p search each row's top candidates (torch.topk), growing the list only for rows whose
allowed set is not inside it yet, then draw by Gumbel-max over the allowed candidates (inverse CDF
when the set is too wide to hash). Temperature-only rows use noise.head_tail_pick, which never hashes
a whole vocabulary row either. typical_p rows need the whole row's entropy: their set is found over
the whole row (logits_processors.typical_keep) and drawn by inverse CDF.

This module must not check stop tokens, EOS or max_new_tokens (the scheduler does), nor validate
params (done upstream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from services.worker.engine.logits_processors import (
    apply_logit_bias,
    apply_output_penalties,
    min_p_threshold,
    typical_keep,
)
from services.worker.engine.noise import coins, gumbel_pick, head_tail_pick, inverse_cdf_pick, row_keys
from services.worker.engine.penalties import apply_penalties

if TYPE_CHECKING:
    from collections.abc import Sequence

    from strata.sampling import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One row to sample: its params, its noise coordinates, and the ids the penalties look at."""

    params: SamplingParams
    seed: int
    position: int  # output position of the token being drawn: 0 for the first new token
    history: Sequence[int] = field(default_factory=tuple)  # prompt + output so far
    output: Sequence[int] = field(default_factory=tuple)  # generated ids: presence/frequency read them
    banned: tuple[int, ...] = ()  # ids min_tokens bans at this position


@dataclass(slots=True)
class SamplerStats:
    """Work counters, cumulative since construction: cheap to keep, and what tests assert on."""

    noise_values: int = 0  # hashed noise values drawn
    normalized_rows: int = 0  # rows whose softmax normaliser over the whole vocabulary was computed
    candidate_rounds: int = 0  # topk calls made while looking for top-k/top-p allowed sets
    tail_draws: int = 0  # temperature-only rows whose coin sent them past the top candidates
    wide_draws: int = 0  # top-k/top-p rows whose allowed set was too wide for Gumbel noise


@dataclass(frozen=True, slots=True)
class _Plan:
    """Row indices by the work they need; `union` (filtered, typical, free, greedy_penalised) is one
    gather, its sampled rows first."""

    plain: list[int]
    filtered: list[int]
    typical: list[int]
    free: list[int]
    greedy_penalised: list[int]

    @property
    def union(self) -> list[int]:
        return self.filtered + self.typical + self.free + self.greedy_penalised

    @property
    def bounds(self) -> tuple[int, int, int]:
        """Where the union's filtered, typical and free rows end."""
        nf = len(self.filtered)
        return nf, nf + len(self.typical), nf + len(self.typical) + len(self.free)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Rows (positions within the filtered block) whose allowed set is {vals >= thr} in the list."""

    rows: Tensor
    vals: Tensor
    ids: Tensor
    thr: Tensor


def _is_penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.no_repeat_ngram_size > 0


def _is_processed(row: SampleRow) -> bool:
    """Whether any processor before temperature changes this row's logits."""
    p = row.params
    return _is_penalised(p) or bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or row.banned)


def _top_k(p: SamplingParams, vocab: int) -> int:
    # top_k >= V keeps everything, as transformers' min(top_k, V) does: treat it as off.
    return p.top_k if 0 < p.top_k < vocab else 0


def _is_filtered(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min_p drop any of the row's tokens."""
    return bool(_top_k(p, vocab)) or p.top_p < 1.0 or p.min_p > 0.0


def _plan(rows: Sequence[SampleRow], vocab: int) -> _Plan:
    plan = _Plan([], [], [], [], [])
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            (plan.greedy_penalised if _is_processed(row) else plan.plain).append(i)
        elif p.typical_p < 1.0:
            plan.typical.append(i)
        elif _is_filtered(p, vocab):
            plan.filtered.append(i)
        else:
            plan.free.append(i)
    return plan


class Sampler:
    """Samples one token per row; one instance per model runner, used from one thread."""

    def __init__(self, head_size: int = 64, wide_set: int = 4096) -> None:
        # head_size: first candidate count (64 holds top_p 0.9 on most real rows); allowed sets
        # above wide_set draw by inverse CDF (one cumsum) rather than a hash per token.
        self.head_size = head_size
        self.wide_set = wide_set
        self.stats = SamplerStats()

    def __call__(self, logits: Tensor, rows: Sequence[SampleRow]) -> list[int]:
        """The next token of every row of `logits` [N, V], in row order."""
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"{n} logit rows for {len(rows)} sample rows")
        plan = _plan(rows, vocab)
        device = logits.device
        tokens = torch.zeros(n, dtype=torch.int64, device=device)
        degenerate = torch.zeros(n, dtype=torch.bool, device=device)
        if plan.plain:
            plain = torch.tensor(plan.plain, device=device)
            block = logits if len(plan.plain) == n else logits[plain]
            best, argmax = block.max(dim=-1)
            tokens[plain] = argmax
            degenerate[plain] = best.isnan()
        if plan.union:
            x = self._prepare(logits, rows, plan)
            nf, nt, ns = plan.bounds
            picked = [
                self._draw_filtered(x[:nf], [rows[i] for i in plan.filtered]),
                self._draw_typical(x[nf:nt], [rows[i] for i in plan.typical]),
                self._draw_free(x[nt:ns], [rows[i] for i in plan.free]),
                x[ns:].max(dim=-1),
            ]
            union = torch.tensor(plan.union, device=device)
            tokens[union] = torch.cat([ids for _, ids in picked])
            degenerate[union] = torch.cat([score for score, _ in picked]) == _NEG_INF
        out, bad = torch.stack([tokens, degenerate.to(torch.int64)]).tolist()
        fix = [i for i, flag in enumerate(bad) if flag]
        if fix:
            # A row left with nothing allowed (all -inf or NaN after filtering) falls back to the
            # argmax of its raw logits, NaN read as -inf, rather than failing the whole batch.
            raw = logits[torch.tensor(fix, device=device)]
            fallback = torch.nan_to_num(raw.float(), nan=_NEG_INF).argmax(-1).tolist()
            for i, tok in zip(fix, fallback, strict=True):
                out[i] = tok
        return [int(t) for t in out]

    def allowed(self, logits: Tensor, rows: Sequence[SampleRow]) -> Tensor:
        """Bool [N, V]: the tokens each row may draw after all its processors (greedy: its argmax)."""
        n, vocab = logits.shape
        plan = _plan(rows, vocab)
        mask = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
        if plan.plain:
            mask[plan.plain, logits[plan.plain].argmax(-1)] = True
        if plan.union:
            x = self._prepare(logits, rows, plan)
            nf, nt, ns = plan.bounds
            for c in self._filter(x[:nf], [rows[i] for i in plan.filtered]):
                part = torch.zeros(len(c.rows), vocab, dtype=torch.bool, device=logits.device)
                part.scatter_(1, c.ids, (c.vals >= c.thr[:, None]) & (c.vals > _NEG_INF))
                mask[torch.tensor(plan.filtered, device=logits.device)[c.rows]] = part
            if plan.typical:
                mask[plan.typical] = self._typical_allowed(x[nf:nt], [rows[i] for i in plan.typical])
            mask[plan.free] = x[nt:ns] > _NEG_INF
            greedy = x[ns:].argmax(-1)
            mask[plan.greedy_penalised, greedy] = True
        return mask

    def _prepare(self, logits: Tensor, rows: Sequence[SampleRow], plan: _Plan) -> Tensor:
        """Float32 rows of the union, penalised, temperature-scaled, NaN mapped to -inf."""
        union = plan.union
        if union == list(range(logits.shape[0])):
            source = logits.to(torch.float32)
        else:
            # Advanced indexing, not index_select: on CPU (torch 2.13) index_select of such long rows
            # measured 1.4-3x slower single-threaded, and 10x+ with two busy threads.
            source = logits[torch.tensor(union, device=logits.device)].to(torch.float32)
        params = [rows[i].params for i in union]
        if any(p.logit_bias for p in params):
            # The bias comes first and the penalties read its result: never write the caller's logits.
            source = source.clone() if source is logits else source
            apply_logit_bias(source, params)
        sampled = plan.bounds[2]
        temps = [p.temperature for p in params[:sampled]] + [1.0] * (len(union) - sampled)
        divisor = torch.tensor(temps, dtype=torch.float32, device=logits.device)
        # The division makes the working copy, so `source` stays raw for the penalties to read.
        x = source / divisor[:, None]
        if any(_is_penalised(p) for p in params):
            apply_penalties(
                x,
                [rows[i].history for i in union],
                [p.repetition_penalty for p in params],
                [p.no_repeat_ngram_size for p in params],
                source=source,
                divisor=divisor,
            )
        picked = [rows[i] for i in union]
        if any(r.banned or r.params.presence_penalty or r.params.frequency_penalty for r in picked):
            apply_output_penalties(
                x, params, [r.output for r in picked], [r.banned for r in picked], divisor=divisor
            )
        # +inf becomes the largest float so softmax and Gumbel sums stay finite.
        return torch.nan_to_num_(x, nan=_NEG_INF, posinf=torch.finfo(torch.float32).max, neginf=_NEG_INF)

    def _keys(self, rows: Sequence[SampleRow], device: torch.device) -> Tensor:
        return row_keys([r.seed for r in rows], [r.position for r in rows], device)

    def _gumbel_pick(self, keys: Tensor, vals: Tensor, ids: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
        self.stats.noise_values += ids.numel()
        return gumbel_pick(keys, vals, ids, allowed)

    def _filter(self, x: Tensor, rows: Sequence[SampleRow]) -> list[_Candidates]:
        """Allowed sets of top-k/top-p rows, found among top candidates without a full sort."""
        r, vocab = x.shape
        if r == 0:
            return []
        device = x.device
        ks = [_top_k(row.params, vocab) for row in rows]
        top_k = torch.tensor(ks, device=device)
        top_p = torch.tensor([row.params.top_p for row in rows], device=device)
        has_p = top_p < 1.0
        lse_full = torch.zeros(r, device=device)
        min_p = torch.tensor([row.params.min_p for row in rows], device=device)
        needs_full = [i for i, row in enumerate(rows) if ks[i] == 0 and row.params.top_p < 1.0]
        if needs_full:
            # Top-p without top-k normalises over the whole row: one pass, no sort.
            index = torch.tensor(needs_full, device=device)
            lse_full[index] = torch.logsumexp(x if len(needs_full) == r else x[index], dim=-1)
            self.stats.normalized_rows += len(needs_full)
        found: list[_Candidates] = []
        pending = torch.arange(r, device=device)
        size = min(vocab, max(self.head_size, *ks))
        while pending.numel():
            self.stats.candidate_rounds += 1
            block = x if pending.numel() == r else x[pending]
            # topk of a whole row is slower than a sort (x1.3 on CPU): flat rows that got this far
            # pay for one sort, which is the price of an exact top-p without any candidate bound.
            vals, ids = block.sort(dim=-1, descending=True) if size >= vocab else block.topk(size, dim=-1)
            k = top_k[pending]
            kth = vals.gather(1, (k - 1).clamp(0, size - 1)[:, None]).squeeze(1)
            thr_k = torch.where(k > 0, kth, _NEG_INF)
            kept = torch.where(vals >= thr_k[:, None], vals, _NEG_INF)
            lse = torch.where(k > 0, torch.logsumexp(kept, dim=-1), lse_full[pending])
            probs = (kept - lse[:, None]).exp()
            before = probs.cumsum(dim=-1) - probs
            # transformers keeps a token unless the mass strictly above it reaches top_p, drops
            # zero-probability tokens, and always keeps the most likely one.
            keep = (before < top_p[pending, None]) & (probs > 0)
            keep[:, 0] = True
            cut = keep.sum(dim=-1)
            thr_p = torch.where(has_p[pending], vals.gather(1, (cut - 1)[:, None]).squeeze(1), _NEG_INF)
            # min_p comes last and only drops tokens: its threshold intersects the others'.
            thr = torch.maximum(torch.maximum(thr_k, thr_p), min_p_threshold(vals[:, 0], min_p[pending]))
            last = vals[:, -1]
            # Complete when nothing outside the list can reach the threshold (ties included) and,
            # for top-k rows, the softmax above was taken over every top-k survivor; or when all
            # that is left outside is -inf, which can never be drawn.
            done = torch.where(k > 0, last < thr_k, last < thr) | (last == _NEG_INF)
            if size >= vocab:
                done = torch.ones_like(done)
            found.append(_Candidates(pending[done], vals[done], ids[done], thr[done]))
            pending = pending[~done]
            # Rows still pending are flat: grow fast, and past a quarter of the vocabulary take it all.
            size = 8 * size if 32 * size <= vocab else vocab
        return found

    def _draw_filtered(self, x: Tensor, rows: Sequence[SampleRow]) -> tuple[Tensor, Tensor]:
        score = torch.empty(x.shape[0], device=x.device)
        token = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        keys = self._keys(rows, x.device)
        for c in self._filter(x, rows):
            allowed = (c.vals >= c.thr[:, None]) & (c.vals > _NEG_INF)
            # Whether a row is wide depends on its own allowed set alone, so batch-invariant.
            wide = allowed.sum(dim=-1) > self.wide_set
            narrow = (~wide).nonzero().squeeze(1)
            if narrow.numel():
                at = c.rows[narrow]
                # Lists are sorted and the allowed entries lead them: hash only that prefix.
                width = max(1, int(allowed[narrow].sum(dim=-1).max()))
                score[at], token[at] = self._gumbel_pick(
                    keys[at], c.vals[narrow, :width], c.ids[narrow, :width], allowed[narrow, :width]
                )
            wide_rows = c.rows[wide]
            if wide_rows.numel():
                self.stats.wide_draws += wide_rows.numel()
                xw, thr = x[wide_rows], c.thr[wide]
                coin = coins(keys[wide_rows])[:, 1]
                self.stats.noise_values += 2 * wide_rows.numel()
                picked = inverse_cdf_pick(xw, xw < thr[:, None], c.vals[wide, 0], coin)
                token[wide_rows] = picked.squeeze(1)
                score[wide_rows] = xw.gather(1, picked).squeeze(1)
        return score, token

    def _typical_allowed(self, x: Tensor, rows: Sequence[SampleRow]) -> Tensor:
        """Bool [R, V]: what typical_p keeps of each row after its top-k, top-p and min_p."""
        r, vocab = x.shape
        thr = torch.full((r,), _NEG_INF, device=x.device)
        filtered = [i for i, row in enumerate(rows) if _is_filtered(row.params, vocab)]
        if filtered:
            index = torch.tensor(filtered, device=x.device)
            for c in self._filter(x[index], [rows[i] for i in filtered]):
                thr[index[c.rows]] = c.thr
        kept = torch.where(x >= thr[:, None], x, _NEG_INF)
        mass = torch.tensor([row.params.typical_p for row in rows], device=x.device)
        self.stats.normalized_rows += r
        return typical_keep(kept, mass)

    def _draw_typical(self, x: Tensor, rows: Sequence[SampleRow]) -> tuple[Tensor, Tensor]:
        r = x.shape[0]
        if r == 0:
            return torch.empty(0, device=x.device), torch.empty(0, dtype=torch.int64, device=x.device)
        allowed = self._typical_allowed(x, rows)
        coin = coins(self._keys(rows, x.device))[:, 1]
        self.stats.noise_values += 2 * r
        best = torch.where(allowed, x, _NEG_INF).max(dim=-1).values
        picked = inverse_cdf_pick(x, ~allowed, best, coin)
        score = torch.where(allowed.gather(1, picked), x.gather(1, picked), _NEG_INF).squeeze(1)
        return score, picked.squeeze(1)

    def _draw_free(self, x: Tensor, rows: Sequence[SampleRow]) -> tuple[Tensor, Tensor]:
        r, vocab = x.shape
        if r == 0:
            return torch.empty(0, device=x.device), torch.empty(0, dtype=torch.int64, device=x.device)
        score, token, tails = head_tail_pick(x, self._keys(rows, x.device), self.head_size)
        self.stats.normalized_rows += r
        self.stats.noise_values += r * (min(self.head_size, vocab) + 2)
        self.stats.tail_draws += tails
        return score, token
