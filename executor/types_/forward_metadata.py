"""ForwardMetaData: what attention reads in one packed (TND) forward pass.

The engine builds it once per step (through the ops backend's builder, which adds what that
backend's attention reads) and passes it down explicitly; no layer keeps it. In a decode-shaped step
every shape depends only on the number of rows, so a padded graph bucket keeps one shape for life.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CacheGroupTables:
    """Where one cache group's K/V live for the step's rows."""

    # [rows, max_blocks_per_request] int32 physical block ids; fixed width, 0 (the null block) past the real ones.
    block_table: torch.Tensor
    # [T] int64 slot (block_id * block_size + offset) each new token's K/V is written to.
    slot_mapping: torch.Tensor


@dataclass(slots=True)
class ForwardMetaData:
    """The part every ops backend reads; backends subclass it with their own fields."""

    max_query_len: int  # longest query of the step: 1 in decode, k+1 in a verify step
    groups: list[CacheGroupTables]  # indexed by the layers' cache group id

    @property
    def is_decode_shaped(self) -> bool:
        """The one definition, used by every backend: each request has one query token."""
        return self.max_query_len == 1
