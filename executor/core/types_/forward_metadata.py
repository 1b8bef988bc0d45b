"""ForwardMetaData: everything attention needs to run one packed (TND) forward pass.

It is built once per step by the engine and passed down explicitly; no layer keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardMetaData:
    """Per-step attention metadata for a packed batch of B requests and T tokens.

    Lengths are kept both as device tensors (for kernels and graphs) and as host lists (for
    operators that take host integer lists, such as the NPU fused attention, and for loops in
    the torch reference).
    """

    is_prefill: bool
    # Cumulative query ends, [B]: request i owns rows actual_seq_lengths_q[i-1]:actual_seq_lengths_q[i].
    actual_seq_lengths_q: torch.Tensor
    actual_seq_lengths_q_list: list[int]
    # Per-request KV lengths (cached + new tokens), [B]; not cumulative, as the paged NPU call wants.
    actual_seq_lengths_kv: torch.Tensor
    actual_seq_lengths_kv_list: list[int]
    # [B, max_blocks_per_request] int32 physical block ids, padded with 0 past each request's blocks.
    block_table: torch.Tensor
    # [T] int64 slot (block_id * block_size + offset) where each new token's K/V is written.
    slot_mapping: torch.Tensor
    # [num_selected] int64 rows of the packed hidden states whose logits are needed.
    selected_token_indices: torch.Tensor
    block_size: int
    # Longest KV length in the batch (host int), for sizing gathers without a device sync.
    max_kv_len: int
    # Steps with one query token per request (decode, or a prefill of one-token prompts) only:
    # [B, max_kv_len] cache slot of each request's KV position (padding positions repeat
    # the request's first slot, so a gather reads only written slots) and which positions are real.
    # Built once per step so the torch attention does not rebuild them in every layer.
    decode_kv_slots: torch.Tensor | None = None
    decode_kv_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.actual_seq_lengths_kv_list)

    @property
    def num_tokens(self) -> int:
        return self.actual_seq_lengths_q_list[-1] if self.actual_seq_lengths_q_list else 0

    @property
    def query_lens(self) -> list[int]:
        """Per-request query lengths, derived from the cumulative list."""
        starts = [0, *self.actual_seq_lengths_q_list[:-1]]
        return [end - start for start, end in zip(starts, self.actual_seq_lengths_q_list, strict=True)]

    @property
    def kv_len(self) -> torch.Tensor:
        """cann-recipes name for the per-request KV lengths."""
        return self.actual_seq_lengths_kv
