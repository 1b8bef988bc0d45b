"""The tensors inside a step's inputs (dataclasses, lists of them): listed, or swapped for others.

Graph modes need the inputs as a flat list of tensors (to copy a step into persistent buffers, to
mirror them in pinned memory, to hand an exported program its arguments) while the model reads
them as ModelInputs and backend-specific metadata; these two walks convert between the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


def _is_container(value: object) -> bool:
    """A list or tuple that may hold tensors (host lists of numbers are values, not containers)."""
    return isinstance(value, (list, tuple)) and bool(value) and not isinstance(value[0], (int, float))


def tensor_leaves(tree: object) -> list[torch.Tensor]:
    """Every tensor in `tree`, in field order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if dataclasses.is_dataclass(tree):
        return [leaf for f in dataclasses.fields(tree) for leaf in tensor_leaves(getattr(tree, f.name))]
    if _is_container(tree):
        return [leaf for item in tree for leaf in tensor_leaves(item)]  # type: ignore[attr-defined]
    return []


def map_tensors(tree: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """A copy of `tree` with every tensor replaced by fn(tensor); other values are kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)  # type: ignore[return-value]
    if dataclasses.is_dataclass(tree):
        changes = {f.name: map_tensors(getattr(tree, f.name), fn) for f in dataclasses.fields(tree)}
        return dataclasses.replace(tree, **changes)  # type: ignore[type-var]
    if _is_container(tree):
        return type(tree)(map_tensors(item, fn) for item in tree)  # type: ignore[call-arg, attr-defined]
    return tree


def with_tensors(tree: T, tensors: list[torch.Tensor]) -> T:
    """`tree` with its tensors, in tensor_leaves order, replaced by `tensors`."""
    replacements: Iterator[torch.Tensor] = iter(tensors)
    rebuilt = map_tensors(tree, lambda _: next(replacements))
    assert next(replacements, None) is None, "more tensors than the tree holds"
    return rebuilt


def structure(tree: object) -> object:
    """What of `tree` is not its tensors' values, in one walk: its dataclasses' and containers' types,
    its other values, each tensor's shape and dtype."""
    if isinstance(tree, torch.Tensor):
        return (tree.shape, tree.dtype)
    if dataclasses.is_dataclass(tree):
        return (type(tree), tuple(structure(getattr(tree, f.name)) for f in dataclasses.fields(tree)))
    if _is_container(tree):
        return (type(tree), tuple(structure(item) for item in tree))  # type: ignore[attr-defined]
    return tree


def same_structure(a: object, b: object) -> bool:
    """True when a and b differ at most in their tensors' values (same fields, same shapes)."""
    return structure(a) == structure(b)
