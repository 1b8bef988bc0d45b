"""One request's KV, out of and into an engine's cache tensors, whatever the cache kinds.

The copier walks the worker's cache groups and, in each, every layer's bound tensors by spec name
(full and sliding-window K/V, MLA latents, a sparse indexer's keys, compressed entries, int8 values
and their scales, recurrent and conv states), so a new cache kind needs nothing here. A paged
group's tensors are indexed by the request's block ids, a recurrent group's by its state slots.
`gather` packs every selected part into one flat byte buffer (one send per request) and describes
each part; `scatter` checks that description against its own cache and writes the parts into the
receiving request's rows. Paged parts are written entry by entry, so the two sides' block sizes
may differ (the receiver takes as many entries as its rows hold).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from executor.core.model_worker import ModelWorker


@dataclass(frozen=True, slots=True)
class PartMeta:
    """One cache tensor's selected rows in a gathered buffer."""

    key: str  # "<layer>.<tensor name>"
    group_id: int
    dtype: str  # torch dtype name, e.g. "float32" (plain data: it crosses processes)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class _CacheTensor:
    key: str
    group_id: int
    recurrent: bool
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
                    yield _CacheTensor(key, group_id, group.spec.is_recurrent, caches[spec.name])

    @torch.inference_mode()
    def gather(self, rows: list[list[int]]) -> tuple[list[PartMeta], torch.Tensor]:
        """The rows (`rows[g]`: block ids or state slots of group g) of every cache tensor: their
        descriptions and one flat uint8 buffer holding them in that order, on the cache's device."""
        metas: list[PartMeta] = []
        parts: list[torch.Tensor] = []
        for cache in self._tensors():
            index = torch.tensor(rows[cache.group_id], dtype=torch.long, device=cache.tensor.device)
            part = cache.tensor.index_select(0, index).contiguous()
            metas.append(PartMeta(cache.key, cache.group_id, str(part.dtype).removeprefix("torch."), tuple(part.shape)))
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
        buffer = buffer.to(caches[0].tensor.device) if caches else buffer
        offset = 0
        for cache, meta in zip(caches, metas, strict=True):
            dtype = str(cache.tensor.dtype).removeprefix("torch.")
            per_row = tuple(cache.tensor.shape[2:] if not cache.recurrent else cache.tensor.shape[1:])
            sent_per_row = meta.shape[2:] if not cache.recurrent else meta.shape[1:]
            if meta.key != cache.key or meta.dtype != dtype or sent_per_row != per_row:
                raise ValueError(
                    f"KV cache tensor {meta.key} ({meta.dtype} {meta.shape}) does not match this instance's "
                    f"{cache.key} ({dtype} [rows, {', '.join(map(str, cache.tensor.shape[1:]))}])"
                )
            part = buffer[offset : offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)
            offset += meta.nbytes
            _write_rows(cache, part, rows[cache.group_id])
        if offset != buffer.numel():
            raise ValueError(f"the KV buffer holds {buffer.numel()} bytes, its parts {offset}")


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
