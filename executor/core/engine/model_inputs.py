"""Packing one step's requests into flat TND model inputs.

Everything is built on the host as Python lists and copied to the device once per tensor, so the
hot loop makes no device round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.core.types_.forward_metadata import ForwardMetaData


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: the new tokens and where its K/V lives."""

    token_ids: list[int]  # the tokens fed this step (whole prompt at prefill, last token at decode)
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: list[int]  # physical blocks holding positions 0 .. num_computed + len(token_ids) - 1


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T]
    forward_metadata: ForwardMetaData


def build_model_inputs(
    sequences: list[ScheduledSequence],
    *,
    is_prefill: bool,
    block_size: int,
    device: torch.device,
    select_all_tokens: bool = False,
) -> ModelInputs:
    """Pack `sequences` into input_ids/position_ids [T], slot mapping and block table.

    Logits are selected for the last token of every sequence (or every token when
    `select_all_tokens`, as a verify step needs).
    """
    assert sequences, "a step needs at least one sequence"
    input_ids: list[int] = []
    position_ids: list[int] = []
    slot_mapping: list[int] = []
    cu_query_lens: list[int] = []
    kv_lens: list[int] = []
    selected: list[int] = []
    for seq in sequences:
        start = seq.num_computed_tokens
        end = start + len(seq.token_ids)
        assert len(seq.block_ids) * block_size >= end, "sequence has too few blocks for its tokens"
        first_row = len(input_ids)
        input_ids.extend(seq.token_ids)
        position_ids.extend(range(start, end))
        slot_mapping.extend(
            seq.block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)
        )
        cu_query_lens.append(len(input_ids))
        kv_lens.append(end)
        selected.extend(range(first_row, len(input_ids)) if select_all_tokens else [len(input_ids) - 1])

    max_blocks = max(len(seq.block_ids) for seq in sequences)
    block_table = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in sequences]

    def to_device(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    block_table_tensor = to_device(block_table, torch.int32)
    kv_lens_tensor = to_device(kv_lens, torch.int64)
    metadata = ForwardMetaData(
        is_prefill=is_prefill,
        actual_seq_lengths_q=to_device(cu_query_lens, torch.int64),
        actual_seq_lengths_q_list=cu_query_lens,
        actual_seq_lengths_kv=kv_lens_tensor,
        actual_seq_lengths_kv_list=kv_lens,
        block_table=block_table_tensor,
        slot_mapping=to_device(slot_mapping, torch.int64),
        selected_token_indices=to_device(selected, torch.int64),
        block_size=block_size,
        max_kv_len=max(kv_lens),
    )
    if len(input_ids) == len(sequences):  # one query token per request: a decode-shaped step
        metadata.decode_kv_slots, metadata.decode_kv_mask = _decode_kv_slots(
            block_table_tensor, kv_lens_tensor, max(kv_lens), block_size
        )
    return ModelInputs(
        input_ids=to_device(input_ids, torch.int64),
        position_ids=to_device(position_ids, torch.int64),
        forward_metadata=metadata,
    )


def _decode_kv_slots(
    block_table: torch.Tensor, kv_lens: torch.Tensor, max_kv_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of every (request, KV position) up to the longest KV, and the mask of real positions."""
    positions = torch.arange(max_kv_len, device=block_table.device)
    slots = block_table[:, positions // block_size].long() * block_size + positions % block_size
    mask = positions[None, :] < kv_lens[:, None]
    return torch.where(mask, slots, slots[:, :1]), mask
