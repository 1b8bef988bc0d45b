"""A checkpoint tensor not read yet: its shape and dtype, narrowed without reading, read when materialized.

Loaders yield these instead of tensors, so that a rank reads from the file only the shard it holds
(module/weights.py's load_shard narrows, then materializes). Plain torch.Tensors stay valid wherever
a CheckpointTensor is (GGUF import, the dummy loader and tests hand those over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class CheckpointTensor:
    """A tensor not read yet: `read(index)` reads the part of it that a tuple of slices (one per dim,
    as in tensor[a:b, c:d]) selects, from whatever holds it (a safetensors slice, a test's stub)."""

    __slots__ = ("_read", "_bounds", "dtype")

    def __init__(
        self,
        read: Callable[[tuple[slice, ...]], torch.Tensor],
        shape: Sequence[int],
        dtype: torch.dtype,
        _bounds: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        self._read = read
        self._bounds = _bounds if _bounds is not None else tuple((0, size) for size in shape)
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self._bounds)

    @property
    def ndim(self) -> int:
        return len(self._bounds)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """torch.Tensor.narrow's meaning; nothing is read until materialize()."""
        dim = dim % self.ndim if self.ndim else dim
        size = self.shape[dim]
        if not (0 <= start and length >= 0 and start + length <= size):
            raise IndexError(f"narrow({dim}, {start}, {length}) outside dim {dim} of size {size}")
        bounds = list(self._bounds)
        first = bounds[dim][0] + start
        bounds[dim] = (first, first + length)
        return CheckpointTensor(self._read, (), self.dtype, tuple(bounds))

    def materialize(self) -> torch.Tensor:
        """Read this range from the checkpoint, in the checkpoint's dtype."""
        return self._read(tuple(slice(start, stop) for start, stop in self._bounds))

    def __repr__(self) -> str:
        return f"CheckpointTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bounds={self._bounds})"


# What a loader hands a weight_loader: a tensor in memory, or one still in the checkpoint.
LoadedWeight = torch.Tensor | CheckpointTensor


def materialize(weight: LoadedWeight) -> torch.Tensor:
    """The tensor itself, read from the checkpoint where it is still there."""
    return weight.materialize() if isinstance(weight, CheckpointTensor) else weight
