"""Linear-attention layers keep a recurrent state per request instead of K/V per token.

A RecurrentStateLayer is a KVCacheLayer whose spec is recurrent (executor/types_/kv_cache_spec.py):
named state tensors of a fixed shape per request (a short-convolution state, a recurrent state). The
worker allocates each as [num_slots, *shape] and binds them with the layer's cache group; a step's
RecurrentStateTables for that group give each row its state slot and whether it continues a state.
Subclasses (module/gated_delta_net.py's GatedDeltaNet) declare their tensors and read their states
through the backend's ops, which write the new states back to the slots.
"""

from __future__ import annotations

import torch

from executor.types_.kv_cache_spec import KVCacheSpec, KVTensorSpec, recurrent_spec
from executor.types_.quant_scheme import KVCacheScheme
from module.attention import KVCacheLayer
from ops.attention.metadata import ForwardMetaData, RecurrentStateTables


class RecurrentStateLayer(KVCacheLayer):
    """A layer with per-request states in slots; subclasses name them in `state_tensors`.

    `keeps_position_states`: its ops honour RecurrentStateTables' ring (read `state_slots`, write
    `write_slots`, and in a verify step every position's state to `position_state_slots`), which
    speculative decoding needs; the engine refuses speculative decoding for a model with a layer
    that does not."""

    keeps_position_states: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.state_caches: dict[str, torch.Tensor] = {}

    def state_tensors(self) -> tuple[KVTensorSpec, ...]:
        """Each state tensor: its name, its shape per slot and its dtype."""
        raise NotImplementedError

    def kv_cache_spec(self) -> KVCacheSpec:
        return recurrent_spec(*self.state_tensors())

    def set_kv_cache_scheme(self, scheme: KVCacheScheme) -> list[torch.nn.Parameter]:
        """C8 quantizes the paged K/V of the attention layers; a recurrent state stays in its dtype."""
        return []

    def bind_kv_cache(self, caches: dict[str, torch.Tensor], group_id: int) -> None:
        """`caches` maps each state tensor's name to [num_slots, *shape]."""
        for spec in self.state_tensors():
            assert caches[spec.name].shape[1:] == spec.shape, (
                f"state {spec.name} must be [num_slots, {', '.join(map(str, spec.shape))}], "
                f"got {tuple(caches[spec.name].shape)}"
            )
        self.state_caches = dict(caches)
        self.kv_cache_group_id = group_id

    def kv_caches(self) -> dict[str, torch.Tensor]:
        return dict(self.state_caches)

    def state_tables(self, forward_metadata: ForwardMetaData) -> RecurrentStateTables:
        """This layer's group's state slots for the step's rows."""
        if self.kv_cache_group_id < 0:
            raise RuntimeError(f"{type(self).__name__} has no state: the worker must call bind_kv_cache first")
        tables = forward_metadata.groups[self.kv_cache_group_id]
        assert isinstance(tables, RecurrentStateTables), "a recurrent layer's cache group holds state slots"
        return tables
