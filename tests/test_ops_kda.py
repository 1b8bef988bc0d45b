"""KDA's torch reference (ops/kda.py): the chunked form against the per-token recurrence and against
transformers' own torch fallbacks, the state carried across a split, and the ops over state slots."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kda

from ops.attention.metadata import RecurrentStateTables
from ops.kda import chunk_kda, kda_chunked, kda_step, prepare_query_key, recurrent_kda

HEADS, KEY_DIM, VALUE_DIM = 3, 8, 6


def kda_inputs(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k, v [T, H, D], a log decay in (-2, 0) per channel, beta in (0, 1), a start state."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        query=torch.randn(length, HEADS, KEY_DIM, generator=generator),
        key=torch.randn(length, HEADS, KEY_DIM, generator=generator),
        value=torch.randn(length, HEADS, VALUE_DIM, generator=generator),
        gate=-2 * torch.rand(length, HEADS, KEY_DIM, generator=generator),
        beta=torch.rand(length, HEADS, generator=generator),
        state=torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=generator),
    )


def naive_kda(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The defining recurrence, one token at a time, every step written out."""
    query, key = prepare_query_key(inputs["query"], inputs["key"])
    state = inputs["state"].clone()
    outputs = []
    for t in range(query.shape[0]):
        for h in range(HEADS):
            decayed = torch.diag(inputs["gate"][t, h].exp()) @ state[h]
            update = inputs["beta"][t, h] * (inputs["value"][t, h] - decayed.T @ key[t, h])
            state[h] = decayed + torch.outer(key[t, h], update)
        outputs.append(torch.einsum("hk,hkv->hv", query[t], state))
    return torch.stack(outputs), state


def chunked(inputs: dict[str, torch.Tensor], chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    query, key = prepare_query_key(inputs["query"], inputs["key"])
    return kda_chunked(query, key, inputs["value"], inputs["gate"], inputs["beta"], inputs["state"], chunk_size)


@pytest.mark.parametrize("length, chunk_size", [(1, 64), (13, 4), (37, 16), (70, 64)])
def test_chunked_kda_equals_the_recurrence(length: int, chunk_size: int) -> None:
    inputs = kda_inputs(length)
    output, state = chunked(inputs, chunk_size)
    expected_output, expected_state = naive_kda(inputs)
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_kda_step_is_one_token_of_the_recurrence() -> None:
    inputs = kda_inputs(1)
    query, key = prepare_query_key(inputs["query"], inputs["key"])
    value, gate, beta = inputs["value"][0], inputs["gate"][0], inputs["beta"][0]
    output, state = kda_step(query[0], key[0], value, gate, beta, inputs["state"])
    expected_output, expected_state = naive_kda(inputs)
    torch.testing.assert_close(output, expected_output[0])
    torch.testing.assert_close(state, expected_state)


def test_a_split_prompt_carries_the_state() -> None:
    """Two chunks of one prompt, the second starting from the first's state, equal the whole."""
    inputs = kda_inputs(30)
    whole, whole_state = chunked(inputs, 8)
    first = {name: tensor[:11] if name != "state" else tensor for name, tensor in inputs.items()}
    head, carried = chunked(first, 8)
    second = {name: tensor[11:] if name != "state" else carried for name, tensor in inputs.items()}
    tail, state = chunked(second, 8)
    torch.testing.assert_close(torch.cat((head, tail)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [5, 70])
def test_kda_equals_transformers_torch_fallbacks(length: int) -> None:
    """transformers' chunk_kimi_delta_attention (prefill) and recurrent_kimi_delta_attention (decode),
    batch 1, with the state carried from one to the other."""
    inputs = kda_inputs(length + 1)
    batch = {name: tensor[None] for name, tensor in inputs.items() if name != "state"}
    prompt = {name: tensor[:, :length] for name, tensor in batch.items()}
    hf_output, hf_state = hf_kda.chunk_kimi_delta_attention(
        prompt["query"], prompt["key"], prompt["value"], g=prompt["gate"], beta=prompt["beta"],
        initial_state=inputs["state"][None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    last = {name: tensor[:, length:] for name, tensor in batch.items()}
    hf_next, hf_next_state = hf_kda.recurrent_kimi_delta_attention(
        last["query"], last["key"], last["value"], g=last["gate"], beta=last["beta"],
        initial_state=hf_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    output, state = chunked({name: t[:length] if name != "state" else t for name, t in inputs.items()}, 64)
    torch.testing.assert_close(output, hf_output[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, hf_state[0], atol=1e-5, rtol=1e-5)
    query, key = prepare_query_key(inputs["query"][length], inputs["key"][length])
    value, gate, beta = inputs["value"][length], inputs["gate"][length], inputs["beta"][length]
    step, step_state = kda_step(query, key, value, gate, beta, state)
    torch.testing.assert_close(step, hf_next[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step_state, hf_next_state[0], atol=1e-5, rtol=1e-5)


def test_the_decay_matters() -> None:
    """A zero log decay (no forgetting) gives another output: the gate is not ignored."""
    inputs = kda_inputs(20)
    ungated = inputs | {"gate": torch.zeros_like(inputs["gate"])}
    assert not torch.allclose(chunked(inputs, 8)[0], chunked(ungated, 8)[0], atol=1e-3)


def test_the_slot_ops_continue_each_requests_state_and_start_fresh_ones_from_zero() -> None:
    """Three requests packed (a fresh prompt, a prompt's second chunk, a one-token continuation) over
    NaN-filled slots, then a decode step of all three: each equals its request computed alone."""
    lengths = [(0, 7), (5, 4), (9, 1)]  # (tokens computed before, tokens fed)
    total = [done + fed + 1 for done, fed in lengths]  # and one decode token each
    sequences = [kda_inputs(length, seed=index) for index, length in enumerate(total)]
    for inputs in sequences:
        inputs["state"] = torch.zeros(HEADS, KEY_DIM, VALUE_DIM)
    slots = torch.tensor([3, 1, 2])
    cache = torch.full((4, HEADS, KEY_DIM, VALUE_DIM), float("nan"))
    for (done, _), slot, inputs in zip(lengths, slots.tolist(), sequences, strict=True):
        if done:  # the state its earlier tokens left
            cache[slot] = chunked({name: t[:done] if name != "state" else t for name, t in inputs.items()}, 64)[1]
    fields = ("query", "key", "value", "gate", "beta")

    def packed(rows: list[slice]) -> list[torch.Tensor]:
        return [torch.cat([inputs[name][r] for inputs, r in zip(sequences, rows, strict=True)]) for name in fields]

    has_state = torch.tensor([done > 0 for done, _ in lengths])
    ends = torch.tensor([fed for _, fed in lengths]).cumsum(0).tolist()
    prefill_tables = RecurrentStateTables(slots, has_state, ends)
    prefill = chunk_kda(*packed([slice(d, d + f) for d, f in lengths]), cache, prefill_tables)
    decode_tables = RecurrentStateTables(slots, torch.ones(3, dtype=torch.bool))
    decode = recurrent_kda(*packed([slice(t - 1, t) for t in total]), cache, decode_tables)
    for index, (inputs, (done, fed)) in enumerate(zip(sequences, lengths, strict=True)):
        expected, _ = naive_kda(inputs)
        start = ends[index] - fed
        torch.testing.assert_close(prefill[start : ends[index]], expected[done : done + fed], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[index], expected[-1], atol=1e-5, rtol=1e-5)


def test_a_verify_row_keeps_the_state_after_each_position_in_its_slot() -> None:
    """A row of 4 tokens that fits its ring of 4 slots (a verify step of 3 drafts): the state after
    position p goes to slot ring[p], each the recurrence's state after that many tokens."""
    inputs = kda_inputs(4)
    cache = torch.full((6, HEADS, KEY_DIM, VALUE_DIM), float("nan"))
    cache[5] = inputs["state"]
    ring = [2, 3, 4, 5]
    tables = RecurrentStateTables(
        torch.tensor([5]), torch.tensor([True]), [4], final_state_slots=torch.tensor([4]), position_state_slots=[ring]
    )
    output = chunk_kda(*(inputs[name] for name in ("query", "key", "value", "gate", "beta")), cache, tables)
    expected, _ = naive_kda(inputs)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    for position, slot in enumerate(ring):
        prefix = {name: t[: position + 1] if name != "state" else t for name, t in inputs.items()}
        torch.testing.assert_close(cache[slot], naive_kda(prefix)[1], atol=1e-5, rtol=1e-5)
