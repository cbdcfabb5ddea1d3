"""Attention over the paged KV cache for a batch that mixes decode tokens and prefill chunks.

This module owns the per-step attention metadata (built once per engine step, shared by every
layer) and the attention backend interface with its portable implementation (sliding windows
included): `TorchAttention`
attends decodes in place on the CPU from a float32 or int8 cache (the native kernel of
csrc/paged_attention.cpp reads each sequence's blocks where they lie, int8 rows dequantized in
registers), and elsewhere gathers each sequence's blocks, converts them from the cache's format
(kv_format.py) to the step's dtype and calls torch's scaled_dot_product_attention, on CPU or CUDA, as
it does for prefill chunks. The cache's format is its tensors' dtype's (kv_format.stored_in). A
fused paged-attention GPU kernel replaces it by implementing `AttentionBackend` against the same
metadata. It must not decide which blocks a sequence owns (the engine does) nor touch weights.

Layout of a step's T tokens: the first `num_decodes` sequences contribute one token each, then each
prefill chunk contributes its `query_len` consecutive tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from services.worker.model import kv_format, native

if TYPE_CHECKING:
    from services.worker.model.kv_format import KVFormat


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prefill chunk's share of the step, with its index tensors ready on the device."""

    start: int  # first token of the chunk in the step's token order
    end: int
    context_len: int
    # None when the chunk starts the sequence: it then attends to its own new k/v, causally.
    block_ids: Tensor | None
    mask: Tensor | None  # [1, 1, query_len, context_len] bool, True where a query may look


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where every token of a step reads and writes the cache. Build it with `build`, once per step."""

    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    slot_mapping: Tensor  # [T] int64
    block_tables: Tensor  # [S, max_blocks] int64, padded with block 0 (never read unmasked)
    block_size: int
    num_tokens: int
    # Decodes read one padded gather: their blocks flattened [num_decodes * decode_blocks].
    decode_block_ids: Tensor | None
    decode_kv_len: int
    decode_mask: Tensor | None  # [num_decodes, 1, 1, decode_kv_len] bool; None when lengths are equal
    prefills: tuple[PrefillChunk, ...]
    last_token_indices: Tensor  # [S] int64: each sequence's last token in the step (logits rows)
    query_start_loc: Tensor  # [S + 1] int32, cumulative query_lens, for varlen GPU kernels
    seq_lens: Tensor  # [S] int32, context_lens on the device

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: str | torch.device,
        num_decodes: int,
    ) -> AttentionMetadata:
        """Validate a step's layout and derive every index tensor and mask its layers need."""
        _validate(query_lens, context_lens, block_tables, block_size, num_decodes)
        slots: list[int] = []
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - qlen, ctx))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for qlen in query_lens:
            starts.append(starts[-1] + qlen)

        decode_ids, decode_len, decode_mask = _decode_layout(
            context_lens[:num_decodes], block_tables[:num_decodes], block_size, device
        )
        prefills = tuple(
            _prefill_chunk((starts[s], starts[s + 1]), context_lens[s], block_tables[s], block_size, device)
            for s in range(num_decodes, len(query_lens))
        )
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
            block_size=block_size,
            num_tokens=starts[-1],
            decode_block_ids=decode_ids,
            decode_kv_len=decode_len,
            decode_mask=decode_mask,
            prefills=prefills,
            last_token_indices=torch.tensor([e - 1 for e in starts[1:]], dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        )


def _validate(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
) -> None:
    if not query_lens or not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
            f"({len(block_tables)}) must be non-empty and of equal length"
        )
    if not 0 <= num_decodes <= len(query_lens) or any(q != 1 for q in query_lens[:num_decodes]):
        raise ValueError(f"num_decodes={num_decodes}: the first num_decodes sequences must have query_len 1")
    for s, (qlen, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        if qlen < 1 or ctx < qlen:
            raise ValueError(f"sequence {s}: query_len={qlen} must be >= 1 and <= context_len={ctx}")
        if len(table) * block_size < ctx:
            raise ValueError(
                f"sequence {s}: {len(table)} blocks of {block_size} cannot hold context_len={ctx}"
            )


def _decode_layout(
    context_lens: list[int], block_tables: list[list[int]], block_size: int, device: str | torch.device
) -> tuple[Tensor | None, int, Tensor | None]:
    if not context_lens:
        return None, 0, None
    longest = max(context_lens)
    blocks = -(-longest // block_size)
    ids = [t[:blocks] + [0] * (blocks - min(blocks, len(t))) for t in block_tables]
    block_ids = torch.tensor(ids, dtype=torch.int64, device=device).reshape(-1)
    if all(c == longest for c in context_lens):
        return block_ids, longest, None
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
    mask = torch.arange(longest, device=device)[None, :] < lens[:, None]
    return block_ids, longest, mask[:, None, None, :]


def _prefill_chunk(
    span: tuple[int, int], context_len: int, table: list[int], block_size: int, device: str | torch.device
) -> PrefillChunk:
    start, end = span
    query_len = end - start
    if query_len == context_len:
        return PrefillChunk(start, end, context_len, None, None)
    blocks = -(-context_len // block_size)
    block_ids = torch.tensor(table[:blocks], dtype=torch.int64, device=device)
    # Query i sits at position context_len - query_len + i and sees every key up to it: a lower
    # triangle shifted right by the cached prefix (tril_ is ~10x cheaper than a broadcast compare).
    mask = torch.ones(query_len, context_len, dtype=torch.bool, device=device).tril_(context_len - query_len)
    return PrefillChunk(start, end, context_len, block_ids, mask[None, None])


class AttentionBackend(Protocol):
    """Writes a step's new k/v into the cache, then attends. q [T, nh, hd], k/v [T, kvh, hd]."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> Tensor:
        """Return the attention output [T, nh * hd] in the step's token order.

        With `window`, a query sees only the last `window` keys up to itself (its own included).
        """
        ...


class TorchAttention:
    """Gather + scaled_dot_product_attention: decodes in one batched call, prefill chunks one each.

    Holds reusable gather buffers, so one instance serves one model driven from one thread.
    """

    def __init__(self) -> None:
        self._workspace: dict[torch.dtype, Tensor] = {}
        self._window_mask: tuple[tuple[int, int], AttentionMetadata, Tensor] | None = None

    def _buffers(self, like: Tensor, rows: int) -> tuple[Tensor | None, Tensor | None]:
        """Two [rows, block elements] gather targets reused across layers and steps, on CPU only.

        Reuse matters on CPU: a fresh gather above glibc's 32 MiB mmap threshold is page-faulted
        in and zeroed on every layer, which costs more than the copy itself at long contexts. On
        CUDA the caching allocator is already cheap, and a buffer that outlived a CUDA-graph capture
        and was then regrown would leave the graph writing into freed memory: allocate afresh there.
        """
        if like.device.type != "cpu":
            return None, None
        width = like[0].numel()
        space = self._workspace.get(like.dtype)
        # An inference-mode tensor cannot be written outside inference mode (e.g. under no_grad).
        stale = space is not None and space.is_inference() and not torch.is_inference_mode_enabled()
        if space is None or stale or space.numel() < 2 * rows * width:
            space = torch.empty(2 * rows * width, dtype=like.dtype, device=like.device)
            self._workspace[like.dtype] = space
        pair = space[: 2 * rows * width].view(2, rows, width)
        return pair[0], pair[1]

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> Tensor:
        key_cache, value_cache = layer_cache
        fmt = kv_format.stored_in(key_cache.dtype)
        kv_heads, width = key_cache.shape[2], key_cache.shape[3]
        heads, head_dim = q.shape[1], q.shape[2]
        parts: list[Tensor] = []
        decodes = meta.num_decodes
        # A window no decode's context reaches changes nothing: the kernel's full attention is exact.
        plain = window is None or max(meta.context_lens[:decodes], default=0) <= window
        kernels = native.library() if decodes and plain and _reads_in_place(q, key_cache) else None
        # A decode-only step's kernel writes each decode's k/v itself: no separate cache write.
        fused_write = (
            kernels is not None
            and not meta.prefills
            and _reads_in_place(k, key_cache)
            and v.stride() == k.stride()
        )
        if not fused_write:
            _write(key_cache.view(-1, kv_heads, width), meta.slot_mapping, fmt.pack(k))
            _write(value_cache.view(-1, kv_heads, width), meta.slot_mapping, fmt.pack(v))
        if kernels is not None:
            new_kv = (k, v) if fused_write else None
            parts.append(
                _paged_decode(kernels, q[:decodes], key_cache, value_cache, meta, scale, new_kv, fmt)
            )
        elif meta.decode_block_ids is not None:
            # GQA without copying K/V per query head: each kv head's query-head group becomes the
            # query-length axis of one SDPA row, which the [B, 1, 1, L] padding mask broadcasts over.
            key_rows, value_rows = self._buffers(key_cache, meta.decode_block_ids.shape[0])
            keys = _gather(key_cache, meta.decode_block_ids, decodes, meta.decode_kv_len, key_rows)
            values = _gather(value_cache, meta.decode_block_ids, decodes, meta.decode_kv_len, value_rows)
            keys, values = fmt.unpack(keys, q.dtype), fmt.unpack(values, q.dtype)
            grouped = q[:decodes].view(decodes, kv_heads, heads // kv_heads, head_dim)
            mask = self._decode_mask(meta, window)
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
            parts.append(attended.reshape(decodes, heads * head_dim))
        for chunk in meta.prefills:
            query = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.block_ids is None:
                keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
                values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            else:
                key_rows, value_rows = self._buffers(key_cache, chunk.block_ids.shape[0])
                keys = _gather(key_cache, chunk.block_ids, 1, chunk.context_len, key_rows)
                values = _gather(value_cache, chunk.block_ids, 1, chunk.context_len, value_rows)
                keys, values = fmt.unpack(keys, q.dtype), fmt.unpack(values, q.dtype)
            if window is None:
                attended = F.scaled_dot_product_attention(
                    query,
                    keys,
                    values,
                    attn_mask=chunk.mask,
                    is_causal=chunk.block_ids is None,
                    scale=scale,
                    enable_gqa=heads != kv_heads,
                )
            else:
                # [1, kv_heads, group * query_len, dim]: each kv head's query heads side by side.
                query_len = chunk.end - chunk.start
                grouped = query.reshape(1, kv_heads, -1, head_dim)
                mask = _chunk_mask(query_len, chunk.context_len, window, query.device)
                tiled = mask.repeat(heads // kv_heads, 1)[None, None]
                attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=tiled, scale=scale)
                attended = attended.view(1, heads, query_len, -1)
            parts.append(attended[0].transpose(0, 1).reshape(-1, heads * head_dim))
        # A decode-only or single-prefill step (the common cases) needs no concatenation copy.
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_mask(self, meta: AttentionMetadata, window: int | None) -> Tensor | None:
        """The decodes' [decodes, 1, 1, kv_len] mask: padding only, or padding and the window; the
        windowed one is built once per step and window, and reused by every layer that has it."""
        if window is None or max(meta.context_lens[: meta.num_decodes]) <= window:
            return meta.decode_mask
        key = (id(meta), window)
        if self._window_mask is None or self._window_mask[0] != key:
            lens = torch.tensor(meta.context_lens[: meta.num_decodes], device=meta.slot_mapping.device)
            keys = torch.arange(meta.decode_kv_len, device=lens.device)[None, :]
            mask = (keys < lens[:, None]) & (keys >= lens[:, None] - window)
            # The metadata is held with its mask, so its id cannot be reused by a later step's.
            self._window_mask = (key, meta, mask[:, None, None, :])
        return self._window_mask[2]


def _chunk_mask(query_len: int, context_len: int, window: int | None, device: torch.device) -> Tensor:
    """[query_len, context_len] bool: query i, at position context_len - query_len + i, sees key j
    when j is at most its position and, with a window, more than its position minus the window."""
    positions = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    keys = torch.arange(context_len, device=device)[None, :]
    mask = keys <= positions
    return mask & (keys > positions - window) if window is not None else mask


def _reads_in_place(rows: Tensor, cache: Tensor) -> bool:
    """Whether the native kernel can read these [tokens, heads, dim] rows (q, or the new k and v) and
    this cache: float32 rows on the CPU, each token's heads dense, and a float32 or int8 cache."""
    return (
        rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and kv_format.stored_in(cache.dtype).native_id is not None
        and rows.stride(2) == 1
        and rows.stride(1) == rows.shape[2]
        and cache.is_contiguous()
    )


def _paged_decode(
    kernels: native.Library,
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[Tensor, Tensor] | None,
    fmt: KVFormat,
) -> Tensor:
    """The decodes' attention [decodes, heads * head_dim], reading their blocks where they lie; with
    `new_kv` (the step's k and v, decodes only) the kernel first writes them at their slots, in the
    cache's format."""
    decodes, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty(decodes, heads * head_dim, dtype=q.dtype)
    new_k, new_v = new_kv if new_kv is not None else (None, None)
    kernels.paged_decode_attention(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        meta.block_tables.data_ptr(),
        meta.seq_lens.data_ptr(),
        out.data_ptr(),
        decodes,
        q.stride(0),
        heads,
        kv_heads,
        head_dim,
        block_size,
        meta.block_tables.shape[1],
        scale,
        new_k.data_ptr() if new_k is not None else None,
        new_v.data_ptr() if new_v is not None else None,
        new_k.stride(0) if new_k is not None else 0,
        meta.slot_mapping.data_ptr(),
        fmt.native_id,
    )
    return out


def _write(cache_rows: Tensor, slots: Tensor, rows: Tensor) -> None:
    """cache_rows[slots] = rows, as bytes for the one-byte floats (float8 has no index_copy_)."""
    if cache_rows.dtype == torch.float8_e4m3fn:
        cache_rows, rows = cache_rows.view(torch.uint8), rows.view(torch.uint8)
    cache_rows.index_copy_(0, slots, rows)


def _gather(cache: Tensor, block_ids: Tensor, sequences: int, length: int, out: Tensor | None) -> Tensor:
    """Blocks of `sequences` sequences as stored, [sequences, kv_heads, length, row_width] (a strided
    view)."""
    num_blocks, _, kv_heads, width = cache.shape
    flat = cache.view(num_blocks, -1)
    if flat.dtype == torch.float8_e4m3fn:
        flat, out = flat.view(torch.uint8), out.view(torch.uint8) if out is not None else None
    rows = flat.index_select(0, block_ids) if out is None else torch.index_select(flat, 0, block_ids, out=out)
    return rows.view(cache.dtype).view(sequences, -1, kv_heads, width)[:, :length].transpose(1, 2)
