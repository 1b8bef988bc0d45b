"""Errors raised while loading weights; each names the tensors at fault."""


class WeightLoadError(ValueError):
    """Missing or unexpected checkpoint tensors, or a shape mismatch."""
