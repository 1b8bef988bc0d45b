"""One request's KV, out of and into an engine's cache tensors, whatever the cache kinds.

The copier walks the worker's cache groups and, in each, every layer's bound tensors by spec name
(full and sliding-window K/V, MLA latents, a sparse indexer's keys, compressed entries, int8 values
and their scales, recurrent and conv states), so a new cache kind needs nothing here. A paged
group's tensors are indexed by the request's block ids, a recurrent group's by its state slots.
`gather` packs every selected part into one flat byte buffer (one send per request) and describes
each part; `scatter` checks that description against its own cache and writes the parts into the
receiving request's rows. Paged parts are written entry by entry, so the two sides' block sizes
may differ (the receiver takes as many entries as its rows hold).

`assemble` joins the buffers a prefill instance's attention TP ranks sent for one request into the
buffer one rank holding every head would have sent: each part split by heads is concatenated along
its heads in rank order, a part split in runs (a conv state's q, k and v channels) run by run, each
run's shares in rank order, and a part every rank holds whole is taken from the first
(docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from executor.core.model_worker import ModelWorker
from executor.types_.kv_cache_spec import KVTensorSpec, TPSplit


@dataclasses.dataclass(frozen=True, slots=True)
class PartMeta:
    """One cache tensor's selected rows in a gathered buffer."""

    key: str  # "<layer>.<tensor name>"
    group_id: int
    dtype: str  # torch dtype name, e.g. "float32" (plain data: it crosses processes)
    shape: tuple[int, ...]  # [blocks, entries, *entry] or [state slots, *entry]
    tp_split: str = TPSplit.OTHER.value  # how the sender's attention TP split it (TPSplit)
    row_dims: int = 2  # the leading dims that index rows: 2 for blocks and entries, 1 for state slots
    tp_dim: int = 0  # a SEGMENTS split's entry axis (KVTensorSpec.tp_dim)
    tp_segments: tuple[int, ...] = ()  # a SEGMENTS split's run sizes along it, on the sender's rank

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * getattr(torch, self.dtype).itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class _CacheTensor:
    key: str
    group_id: int
    recurrent: bool
    spec: KVTensorSpec
    tensor: torch.Tensor  # [num_blocks, entries per block, *shape] or [num_state_slots, *shape]


class KVCopier:
    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    def _tensors(self) -> Iterator[_CacheTensor]:
        for group_id, group in enumerate(self.worker.kv_cache_groups):
            for layer_name in group.layer_names:
                caches = self.worker.kv_cache_layers[layer_name].kv_caches()
                for spec in group.spec.tensors:
                    key = f"{layer_name}.{spec.name}"
                    yield _CacheTensor(key, group_id, group.spec.is_recurrent, spec, caches[spec.name])

    @torch.inference_mode()
    def gather(self, rows: list[list[int]]) -> tuple[list[PartMeta], torch.Tensor]:
        """The rows (`rows[g]`: block ids or state slots of group g) of every cache tensor: their
        descriptions and one flat uint8 buffer holding them in that order, on the cache's device."""
        metas: list[PartMeta] = []
        parts: list[torch.Tensor] = []
        for cache in self._tensors():
            index = torch.tensor(rows[cache.group_id], dtype=torch.long, device=cache.tensor.device)
            part = cache.tensor.index_select(0, index).contiguous()
            dtype = str(part.dtype).removeprefix("torch.")
            row_dims = 1 if cache.recurrent else 2
            spec = cache.spec
            metas.append(
                PartMeta(
                    cache.key,
                    cache.group_id,
                    dtype,
                    tuple(part.shape),
                    spec.tp_split.value,
                    row_dims,
                    spec.tp_dim,
                    spec.tp_segments,
                )
            )
            parts.append(part.view(torch.uint8).reshape(-1))
        if not parts:
            return metas, torch.empty(0, dtype=torch.uint8)
        return metas, torch.cat(parts)

    @torch.inference_mode()
    def scatter(self, metas: list[PartMeta], buffer: torch.Tensor, rows: list[list[int]]) -> None:
        """Write a gathered buffer into `rows` of this engine's caches. ValueError, naming the
        tensor, when the sender's caches do not match these (another model or layout)."""
        caches = list(self._tensors())
        if len(caches) != len(metas):
            raise ValueError(f"the sender has {len(metas)} KV cache tensors, this instance {len(caches)}")
        parts = _split_parts(metas, buffer.to(caches[0].tensor.device) if caches else buffer)
        for cache, meta, part in zip(caches, metas, parts, strict=True):
            dtype = str(cache.tensor.dtype).removeprefix("torch.")
            per_row = tuple(cache.tensor.shape[2:] if not cache.recurrent else cache.tensor.shape[1:])
            sent_per_row = meta.shape[2:] if not cache.recurrent else meta.shape[1:]
            if meta.key != cache.key or meta.dtype != dtype or sent_per_row != per_row:
                raise ValueError(
                    f"KV cache tensor {meta.key} ({meta.dtype} {meta.shape}) does not match this instance's "
                    f"{cache.key} ({dtype} [rows, {', '.join(map(str, cache.tensor.shape[1:]))}])"
                )
            _write_rows(cache, part, rows[cache.group_id])


def assemble(shards: list[tuple[list[PartMeta], torch.Tensor]]) -> tuple[list[PartMeta], torch.Tensor]:
    """One request's KV as one rank holding every head would have gathered it, from the buffers of
    a prefill instance's attention TP ranks (`shards[r]`: rank r's descriptions and buffer). A part
    split by heads is joined along its heads in rank order, one split in runs run by run (each run's
    shares in rank order), a whole one taken from rank 0; ValueError, naming the tensor, for a part
    split another way or shards that do not describe the same parts."""
    if len(shards) == 1:
        return shards[0]
    first_metas = shards[0][0]
    described = [(meta.key, meta.dtype, meta.tp_split, meta.tp_dim, meta.tp_segments) for meta in first_metas]
    for rank, (metas, _) in enumerate(shards):
        if [(meta.key, meta.dtype, meta.tp_split, meta.tp_dim, meta.tp_segments) for meta in metas] != described:
            raise ValueError(f"prefill rank {rank} sent other KV cache tensors than rank 0")
    views = [_split_parts(metas, buffer) for metas, buffer in shards]
    joined_metas: list[PartMeta] = []
    joined: list[torch.Tensor] = []
    for index, meta in enumerate(first_metas):
        rank_parts = [parts[index] for parts in views]
        segments = meta.tp_segments
        if meta.tp_split == TPSplit.WHOLE.value:
            part = rank_parts[0]
        elif meta.tp_split == TPSplit.HEADS.value:
            part = torch.cat(rank_parts, dim=meta.row_dims)
        elif meta.tp_split == TPSplit.SEGMENTS.value:
            dim = meta.row_dims + meta.tp_dim
            per_run = zip(*(rank_part.split(segments, dim=dim) for rank_part in rank_parts), strict=True)
            part = torch.cat([torch.cat(shares, dim) for shares in per_run], dim)  # run by run, each in rank order
            segments = tuple(size * len(shards) for size in segments)
        else:
            raise ValueError(
                f"KV cache tensor {meta.key} is split over the prefill instance's {len(shards)} attention TP ranks "
                "in a way not joined here (only heads, runs and whole tensors are): run its prefill at attn_tp_size 1"
            )
        joined_metas.append(dataclasses.replace(meta, shape=tuple(part.shape), tp_segments=segments))
        joined.append(part.contiguous().view(torch.uint8).reshape(-1))
    return joined_metas, torch.cat(joined) if joined else torch.empty(0, dtype=torch.uint8)


def _split_parts(metas: list[PartMeta], buffer: torch.Tensor) -> list[torch.Tensor]:
    """The parts of a gathered buffer, as views of their dtype and shape."""
    parts = []
    offset = 0
    for meta in metas:
        parts.append(buffer[offset : offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape))
        offset += meta.nbytes
    if offset != buffer.numel():
        raise ValueError(f"the KV buffer holds {buffer.numel()} bytes, its parts {offset}")
    return parts


def _write_rows(cache: _CacheTensor, part: torch.Tensor, row: list[int]) -> None:
    device = cache.tensor.device
    if cache.recurrent:  # state slots: one to one
        if len(row) != part.shape[0]:
            raise ValueError(f"{cache.key}: {part.shape[0]} state slots sent, the request holds {len(row)}")
        cache.tensor.index_copy_(0, torch.tensor(row, dtype=torch.long, device=device), part)
        return
    entries_per_block = cache.tensor.shape[1]
    blocks = torch.tensor(row, dtype=torch.long, device=device)
    slots = (blocks[:, None] * entries_per_block + torch.arange(entries_per_block, device=device)).reshape(-1)
    sent = part.flatten(0, 1)
    count = min(sent.shape[0], slots.shape[0])
    cache.tensor.view(-1, *cache.tensor.shape[2:]).index_copy_(0, slots[:count], sent[:count])  # a view: writes through
