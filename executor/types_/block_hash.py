"""BlockHash: the identity of a full KV block's contents, for prefix caching."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockHash:
    """A full block's tokens and the hash of everything before it. Keys compare by value, so two
    blocks match only if their own tokens really are equal (and, but for a 64-bit collision of the
    chained prefix hash, their prefixes)."""

    parent: int | None
    token_ids: tuple[int, ...]

    def chain(self) -> int:
        """What the next block's `parent` is."""
        return hash((self.parent, self.token_ids))
